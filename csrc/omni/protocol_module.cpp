// hvd_sparse._protocol: the aggregation protocol's definition (protocol.h, blocks.h) as Python
// values, for tools that must run without torch or Horovod (the aggregator's host, packet
// dissectors, hvd_sparse.tools.wire). Plain CPython API: no pybind11, no torch, nothing to link.
// hvd_sparse/protocol.py is its typed face; nothing else should import this module.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>

#include "../blocks.h"
#include "protocol.h"

namespace {

namespace omni = hvd_sparse::omni;

struct Named {
  const char* name;
  long value;
};

constexpr Named kTypes[] = {{"DATA", omni::kData},         {"RESULT", omni::kResult},
                            {"REGISTER", omni::kRegister}, {"REGACK", omni::kRegAck},
                            {"RELEASE", omni::kRelease},   {"BYE", omni::kBye},
                            {"ERROR", omni::kError},       {"HELD", omni::kHeld}};
constexpr Named kFlags[] = {
    {"SHADOW", omni::kFlagShadow}, {"LAST", omni::kFlagLast}, {"AUTH", omni::kFlagAuth},
    {"OWN", omni::kFlagOwn}};
constexpr Named kErrors[] = {{"MISMATCH", omni::kErrMismatch},
                             {"JOB", omni::kErrJob},
                             {"CAPACITY", omni::kErrCapacity},
                             {"OVERFLOW", omni::kErrOverflow},
                             {"UNSUPPORTED", omni::kErrUnsupported}};

// Adds `obj` (a new reference, may be null after a failed build) as attribute `name`.
bool add(PyObject* m, const char* name, PyObject* obj) {
  if (obj == nullptr) return false;
  int rc = PyModule_AddObjectRef(m, name, obj);
  Py_DECREF(obj);
  return rc == 0;
}

template <size_t N>
PyObject* name_table(const Named (&table)[N]) {
  PyObject* d = PyDict_New();
  for (size_t i = 0; d != nullptr && i < N; ++i) {
    PyObject* v = PyLong_FromLong(table[i].value);
    if (v == nullptr || PyDict_SetItemString(d, table[i].name, v) != 0) Py_CLEAR(d);
    Py_XDECREF(v);
  }
  return d;
}

// ((name, offset, size), ...) of the header fields, in wire order.
PyObject* fields() {
  constexpr size_t n = sizeof(omni::kHeaderFields) / sizeof(omni::kHeaderFields[0]);
  PyObject* t = PyTuple_New(n);
  for (size_t i = 0; t != nullptr && i < n; ++i) {
    const omni::HeaderField& f = omni::kHeaderFields[i];
    PyObject* item = Py_BuildValue("(snn)", f.name, Py_ssize_t(f.offset), Py_ssize_t(f.size));
    if (item == nullptr) Py_CLEAR(t);
    else PyTuple_SET_ITEM(t, i, item);
  }
  return t;
}

// {name: (code, element size)} of the first `n` wire dtypes (blocks.h's tensor dtypes come
// first, then protocol.h's fixed point).
PyObject* dtypes(int n) {
  PyObject* d = PyDict_New();
  for (int code = 0; d != nullptr && code < n; ++code) {
    PyObject* v = Py_BuildValue("(ii)", code, omni::wire_size(uint8_t(code)));
    if (v == nullptr || PyDict_SetItemString(d, omni::wire_dtype_name(uint8_t(code)), v) != 0)
      Py_CLEAR(d);
    Py_XDECREF(v);
  }
  return d;
}

// Parses `n` non-negative integer arguments, each at most its bound (the C++ parameter's
// range): the geometry functions take unsigned widths that must not wrap silently.
bool unsigned_args(PyObject* args, const char* fn, const char* const* names,
                   const unsigned long long* bounds, unsigned long long* out, Py_ssize_t n) {
  if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) != n) {
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments", fn, n);
    return false;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = PyTuple_GET_ITEM(args, i);
    if (!PyLong_Check(a)) {
      PyErr_Format(PyExc_TypeError, "%s(): %s must be an int", fn, names[i]);
      return false;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
    if (v == -1 && PyErr_Occurred()) return false;
    if (overflow != 0 || v < 0 || static_cast<unsigned long long>(v) > bounds[i]) {
      PyErr_Format(PyExc_ValueError, "%s(): %s out of range 0 .. %llu", fn, names[i], bounds[i]);
      return false;
    }
    out[i] = static_cast<unsigned long long>(v);
  }
  return true;
}

constexpr unsigned long long kU32 = UINT32_MAX, kU64 = INT64_MAX;

PyObject* py_layout(PyObject*, PyObject* args) {
  static const char* const names[] = {"nblocks", "block_size", "esize", "payload", "max_slots"};
  static const unsigned long long bounds[] = {kU64, kU32, kU32, kU64, kU64};
  unsigned long long a[5];
  if (!unsigned_args(args, "layout", names, bounds, a, 5)) return nullptr;
  if (a[1] == 0 || a[2] == 0 || a[4] == 0) {
    PyErr_SetString(PyExc_ValueError, "layout(): block_size, esize and max_slots must be > 0");
    return nullptr;
  }
  omni::Layout l = omni::layout(a[0], uint32_t(a[1]), uint32_t(a[2]), a[3], a[4]);
  return Py_BuildValue("(kk)", static_cast<unsigned long>(l.lanes),
                       static_cast<unsigned long>(l.nslots));
}

PyObject* py_stream_length(PyObject*, PyObject* args) {
  static const char* const names[] = {"slot", "lane", "nblocks", "nslots", "lanes"};
  static const unsigned long long bounds[] = {kU32, kU32, kU32, kU32, kU32};
  unsigned long long a[5];
  if (!unsigned_args(args, "stream_length", names, bounds, a, 5)) return nullptr;
  if (a[3] == 0 || a[4] == 0) {
    PyErr_SetString(PyExc_ValueError, "stream_length(): nslots and lanes must be > 0");
    return nullptr;
  }
  return PyLong_FromUnsignedLong(omni::stream_length(uint32_t(a[0]), uint32_t(a[1]), uint32_t(a[2]),
                                                     uint32_t(a[3]), uint32_t(a[4])));
}

PyObject* py_stream_block(PyObject*, PyObject* args) {
  static const char* const names[] = {"slot", "lane", "pos", "nslots", "lanes"};
  static const unsigned long long bounds[] = {kU32, kU32, kU32, kU32, kU32};
  unsigned long long a[5];
  if (!unsigned_args(args, "stream_block", names, bounds, a, 5)) return nullptr;
  return PyLong_FromUnsignedLongLong(omni::stream_block(
      uint32_t(a[0]), uint32_t(a[1]), uint32_t(a[2]), uint32_t(a[3]), uint32_t(a[4])));
}

PyMethodDef kMethods[] = {
    {"layout", py_layout, METH_VARARGS,
     "layout(nblocks, block_size, esize, payload, max_slots) -> (lanes, nslots)"},
    {"stream_length", py_stream_length, METH_VARARGS,
     "stream_length(slot, lane, nblocks, nslots, lanes) -> positions of that stream"},
    {"stream_block", py_stream_block, METH_VARARGS,
     "stream_block(slot, lane, pos, nslots, lanes) -> block index"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "hvd_sparse._protocol",
                       "The aggregation protocol's constants, header fields, dtypes and stream "
                       "geometry, from csrc/omni/protocol.h and csrc/blocks.h.",
                       -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__protocol() {
  PyObject* m = PyModule_Create(&kModule);
  if (m == nullptr) return nullptr;
  const bool ok =
      PyModule_AddIntConstant(m, "MAGIC", omni::kMagic) == 0 &&
      PyModule_AddIntConstant(m, "VERSION", omni::kVersion) == 0 &&
      PyModule_AddIntConstant(m, "HEADER_BYTES", omni::kHeaderBytes) == 0 &&
      PyModule_AddIntConstant(m, "BITMAP_BYTES", omni::kBitmapBytes) == 0 &&
      PyModule_AddIntConstant(m, "LANE_BYTES", omni::kLaneBytes) == 0 &&
      PyModule_AddIntConstant(m, "TAG_BYTES", omni::kTagBytes) == 0 &&
      PyModule_AddIntConstant(m, "AUTH_BYTES", omni::kAuthBytes) == 0 &&
      PyModule_AddIntConstant(m, "AGGREGATOR_SENDER", omni::kAggregatorSender) == 0 &&
      add(m, "INF", PyLong_FromUnsignedLong(omni::kInf)) &&
      PyModule_AddIntConstant(m, "MAX_LANES", omni::kMaxLanes) == 0 &&
      PyModule_AddIntConstant(m, "MAX_WORKERS", omni::kMaxWorkers) == 0 &&
      PyModule_AddIntConstant(m, "MAX_DATAGRAM", omni::kMaxDatagram) == 0 &&
      PyModule_AddIntConstant(m, "AGGREGATOR_PORT", omni::kAggregatorPort) == 0 &&
      add(m, "HELD_AFTER", PyFloat_FromDouble(omni::kHeldAfter)) &&
      PyModule_AddIntConstant(m, "SWITCH_VALUES_PER_PASS", omni::kSwitchValuesPerPass) == 0 &&
      PyModule_AddIntConstant(m, "SWITCH_CELLS_PER_SLOT", omni::kSwitchCellsPerSlot) == 0 &&
      PyModule_AddIntConstant(m, "SWITCH_MAX_WORKERS", omni::kSwitchMaxWorkers) == 0 &&
      PyModule_AddIntConstant(m, "SWITCH_CELLS", omni::kSwitchCells) == 0 &&
      add(m, "TYPES", name_table(kTypes)) && add(m, "FLAGS", name_table(kFlags)) &&
      add(m, "ERRORS", name_table(kErrors)) && add(m, "FIELDS", fields()) &&
      add(m, "DTYPES", dtypes(hvd_sparse::kNumDTypes)) &&
      add(m, "WIRE_DTYPES", dtypes(omni::kNumWireDTypes));
  if (!ok) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}

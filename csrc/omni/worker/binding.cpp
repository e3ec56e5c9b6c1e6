// hvd_sparse._C.OmniWorker: the worker engine (worker.h) for Python, on torch tensors.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "../../torch_dtype.h"
#include "worker.h"

namespace py = pybind11;

namespace hvd_sparse::omni {
namespace {

void set_exponent(TensorW& t, std::optional<int64_t> exponent) {
  if (!exponent) return;
  // Beyond these, 2^e is outside float64 for any finite value: no rule produces them.
  TORCH_CHECK(*exponent >= -1100 && *exponent <= 1200, "omnireduce: fixed-point exponent ",
              *exponent, " out of range");
  t.fixed = true;
  t.exponent = int(*exponent);
}

// A rows submission's result, ordered by row: (rows, values) as torch tensors.
std::pair<at::Tensor, at::Tensor> sorted_rows(const TensorW& t, at::ScalarType dtype) {
  const int64_t n = int64_t(t.out_rows.size());
  std::vector<int64_t> order(size_t(n), 0);
  for (int64_t i = 0; i < n; ++i) order[size_t(i)] = i;
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return t.out_rows[size_t(a)] < t.out_rows[size_t(b)]; });
  at::Tensor rows = at::empty({n}, at::kLong);
  at::Tensor vals = at::empty({n, int64_t(t.bs)}, at::TensorOptions().dtype(dtype));
  const size_t width = size_t(t.bs) * size_t(t.esize);
  int64_t* r = rows.data_ptr<int64_t>();
  auto* v = static_cast<uint8_t*>(vals.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    const size_t k = size_t(order[size_t(i)]);
    r[i] = t.out_rows[k];
    std::memcpy(v + size_t(i) * width, t.out_vals.data() + k * width, width);
  }
  return {rows, vals};
}

class PyWorker {
 public:
  PyWorker(const std::vector<std::pair<std::string, int>>& aggs, uint64_t token, int worker,
           int nworkers, int payload_bytes, int slots_per_agg, double rto, double timeout,
           double drop_rate, double dup_rate, uint64_t seed, const std::string& key,
           std::pair<int, int> ports, uint32_t epoch) {
    TORCH_CHECK(nworkers >= 1 && nworkers <= kMaxWorkers && worker >= 0 && worker < nworkers,
                "omnireduce: bad worker id ", worker, " of ", nworkers);
    WorkerOptions o;
    o.token = token;
    o.epoch = epoch;
    o.worker = uint16_t(worker);
    o.nworkers = uint16_t(nworkers);
    o.payload = payload_bytes;
    o.slots_per_agg = slots_per_agg;
    o.rto = rto;
    o.timeout = timeout;
    o.seed = seed;
    o.drop_rate = drop_rate;
    o.dup_rate = dup_rate;
    o.key = key;
    o.port_lo = ports.first;
    o.port_hi = ports.second;
    w_ = std::make_unique<Worker>(aggs, o);
  }

  // output: the input itself, or zeros; only blocks some worker sends are written.
  // exponent: send as fixed32 q = round(x * 2^exponent) (the same on every rank), or None to
  // send the tensor's own dtype. max_slots: as for submit_rows.
  int64_t submit(uint64_t id, at::Tensor input, at::Tensor output, int64_t bs, int64_t meta,
                 std::optional<at::Tensor> mask, const std::string& name, double scale,
                 std::optional<int64_t> exponent, int64_t max_slots) {
    TORCH_CHECK(max_slots >= 0 && max_slots <= UINT32_MAX, "omnireduce: max_slots out of range");
    TORCH_CHECK(input.is_contiguous() && output.is_contiguous() && input.device().is_cpu() &&
                    output.device().is_cpu(),
                "omnireduce: tensors must be contiguous CPU tensors");
    TORCH_CHECK(input.scalar_type() == output.scalar_type() && input.numel() == output.numel(),
                "omnireduce: output must match the input");
    TORCH_CHECK(bs >= 1 && bs <= 65535, "omnireduce: block_size ", bs, " out of range");
    auto t = std::make_unique<TensorW>();
    t->id = id;
    t->name = name;
    t->in = static_cast<const uint8_t*>(input.data_ptr());
    t->out = static_cast<uint8_t*>(output.data_ptr());
    t->dtype = dtype_code(input.scalar_type());
    t->numel = input.numel();
    t->bs = uint32_t(bs);
    t->meta = uint32_t(meta);
    t->scale = scale;
    t->max_slots = uint32_t(max_slots);
    set_exponent(*t, exponent);
    // The tensors live until finish(), which releases them with the GIL held.
    t->hold = std::make_shared<std::pair<at::Tensor, at::Tensor>>(input, output);
    const uint8_t* m = nullptr;
    if (mask) {
      TORCH_CHECK(mask->scalar_type() == at::kByte &&
                      mask->numel() == num_blocks(input.numel(), bs) && mask->is_contiguous(),
                  "omnireduce: mask must be uint8 with one entry per block");
      m = mask->data_ptr<uint8_t>();
    }
    return w_->submit(std::move(t), m);
  }

  // Rows of a table of `nrows_total` rows: `rows` (int64, distinct, ascending) and their
  // `values` ([rows, width], one block each). finish() returns the sum's rows and values, by
  // row, in its "rows" and "values". `max_slots` (the same on every worker; 0: the engine's
  // number) fits the layout to a union far smaller than the table: fewer, fuller packets.
  int64_t submit_rows(uint64_t id, at::Tensor rows, at::Tensor values, int64_t nrows_total,
                      int64_t meta, const std::string& name, double scale,
                      std::optional<int64_t> exponent, int64_t max_slots) {
    TORCH_CHECK(max_slots >= 0 && max_slots <= UINT32_MAX, "omnireduce: max_slots out of range");
    TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous() &&
                    rows.device().is_cpu(),
                "omnireduce: rows must be a contiguous int64 CPU vector");
    TORCH_CHECK(values.dim() == 2 && values.size(0) == rows.numel() && values.is_contiguous() &&
                    values.device().is_cpu(),
                "omnireduce: values must be a contiguous CPU matrix, a row per entry of rows");
    const int64_t bs = values.size(1);
    TORCH_CHECK(bs >= 1 && bs <= 65535, "omnireduce: row width ", bs, " out of range");
    TORCH_CHECK(nrows_total >= 1 && nrows_total <= INT64_MAX / bs, "omnireduce: ",
                nrows_total, " rows out of range");
    auto t = std::make_unique<TensorW>();
    t->id = id;
    t->name = name;
    t->in = static_cast<const uint8_t*>(values.data_ptr());
    t->by_rows = true;
    t->max_slots = uint32_t(max_slots);
    t->rows = rows.data_ptr<int64_t>();
    t->nrows = rows.numel();
    t->dtype = dtype_code(values.scalar_type());
    t->numel = nrows_total * bs;
    t->bs = uint32_t(bs);
    t->meta = uint32_t(meta);
    t->scale = scale;
    set_exponent(*t, exponent);
    t->out_rows.reserve(size_t(t->nrows));  // the sum has at least this rank's rows
    t->out_vals.reserve(size_t(values.nbytes()));
    t->hold = std::make_shared<std::pair<at::Tensor, at::Tensor>>(rows, values);
    return w_->submit(std::move(t), nullptr);
  }

  // Forgets a finished ticket; returns its counters or raises its error. Called with the GIL:
  // it is released while waiting for the engine's lock (the background thread may hold it for
  // a while), and the tensors are released only after, with the GIL back: dropping the last
  // reference to a tensor whose Python object Python has already let go of runs Python code.
  py::dict finish(int64_t ticket) {
    std::unique_ptr<TensorW> t;
    std::pair<at::Tensor, at::Tensor> rows;
    {
      py::gil_scoped_release nogil;
      t = w_->take(ticket);
      if (t->by_rows && t->error.empty()) {
        auto held = std::static_pointer_cast<std::pair<at::Tensor, at::Tensor>>(t->hold);
        rows = sorted_rows(*t, held->second.scalar_type());
      }
    }
    if (!t->error.empty()) {
      if (t->timed_out) throw AggregatorTimeout(t->error);
      throw std::runtime_error(t->error);
    }
    py::dict d;
    d["packets"] = t->packets;
    d["bytes_sent"] = t->bytes_sent;
    d["bytes_received"] = t->bytes_received;
    d["retransmits"] = t->retransmits;
    d["rounds"] = t->rounds;
    d["union"] = t->union_blocks;
    d["nnz_local"] = t->nnz_local;
    d["lanes"] = t->lanes;
    d["nslots"] = t->nslots;
    if (t->by_rows) {
      d["rows"] = rows.first;
      d["values"] = rows.second;
    }
    return d;
  }

  py::dict stats() {
    Worker::Stats s;
    {
      py::gil_scoped_release nogil;  // never wait for the engine's lock holding the GIL
      s = w_->stats();
    }
    py::dict d;
    for (auto& [k, v] : s.counters) d[k] = v;
    py::list aggs;  // the congestion state of each aggregator's path, and when it answered
    const double now = monotonic_s();
    for (size_t i = 0; i < s.paths.size(); ++i) {
      const AggregatorPath& a = s.paths[i];
      aggs.append(py::dict(py::arg("name") = a.name, py::arg("window") = a.cwnd,
                           py::arg("ssthresh") = a.ssthresh, py::arg("srtt") = a.srtt,
                           py::arg("rto") = s.rto[i], py::arg("window_cuts") = double(a.cuts),
                           py::arg("heard_ago") = a.heard ? now - a.heard : INFINITY));
    }
    d["aggregators"] = aggs;
    return d;
  }

  Worker& worker() { return *w_; }

 private:
  std::unique_ptr<Worker> w_;
};

}  // namespace

void register_omni(py::module_& m) {
  using nogil = py::call_guard<py::gil_scoped_release>;
  const WorkerOptions d;  // the engine's defaults, which are hvd_sparse.config.Config's
  py::register_exception<AggregatorTimeout>(m, "AggregatorTimeout", PyExc_RuntimeError);
  py::class_<PyWorker>(m, "OmniWorker")
      .def(py::init<const std::vector<std::pair<std::string, int>>&, uint64_t, int, int, int, int,
                    double, double, double, double, uint64_t, const std::string&,
                    std::pair<int, int>, uint32_t>(),
           py::arg("aggregators"), py::arg("token"), py::arg("worker"), py::arg("nworkers"),
           py::arg("payload_bytes") = d.payload, py::arg("slots_per_aggregator") = d.slots_per_agg,
           py::arg("rto") = d.rto, py::arg("timeout") = d.timeout, py::arg("drop_rate") = 0.0,
           py::arg("dup_rate") = 0.0, py::arg("seed") = 0, py::arg("key") = py::bytes(),
           py::arg("ports") = std::pair<int, int>(0, 0), py::arg("epoch") = d.epoch)
      .def(
          "local_port", [](PyWorker& w) { return w.worker().local_port(); },
          "The UDP port the worker's socket is bound to.")
      .def(
          "register", [](PyWorker& w, double timeout) { w.worker().register_all(timeout); },
          py::arg("timeout"), nogil())
      .def("submit", &PyWorker::submit, py::arg("tensor_id"), py::arg("input"), py::arg("output"),
           py::arg("block_size"), py::arg("meta"), py::arg("mask") = py::none(),
           py::arg("name") = "", py::arg("scale") = 1.0, py::arg("exponent") = py::none(),
           py::arg("max_slots") = 0, nogil())
      .def("submit_rows", &PyWorker::submit_rows, py::arg("tensor_id"), py::arg("rows"),
           py::arg("values"), py::arg("nrows"), py::arg("meta"), py::arg("name") = "",
           py::arg("scale") = 1.0, py::arg("exponent") = py::none(), py::arg("max_slots") = 0,
           nogil())
      .def(
          "poll", [](PyWorker& w, int64_t t) { return w.worker().poll(t); }, nogil())
      .def(
          "wait",
          [](PyWorker& w, int64_t t, double timeout) { return w.worker().wait(t, timeout); },
          py::arg("ticket"), py::arg("timeout"), nogil())
      .def("finish", &PyWorker::finish)
      .def("stats", &PyWorker::stats)
      .def(
          "payload_bytes", [](PyWorker& w) { return w.worker().payload(); }, nogil(),
          "Bytes of block values per packet: payload_bytes, capped at what one slot of a "
          "switch holds once its REGACK said so (register first).")
      .def(
          "slot_geometry",
          [](PyWorker& w) {
            const RegAck g = w.worker().slot_geometry();
            return std::make_pair(g.values_per_pass, g.cells_per_slot);
          },
          nogil(),
          "(values_per_pass, cells_per_slot) of a switch's slots, from its REGACK; (0, 0) "
          "from software aggregators: no per-slot cap.")
      .def(
          "slots_per_aggregator", [](PyWorker& w) { return w.worker().slots_per_agg(); },
          nogil(),
          "Slots a tensor lays out per aggregator: slots_per_aggregator, times what a "
          "switch's REGACK cut each packet by, at most the job's groups there (register "
          "first).")
      .def(
          "close", [](PyWorker& w) { w.worker().close(); }, nogil());
}

}  // namespace hvd_sparse::omni

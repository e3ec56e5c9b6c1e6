// hvd_sparse._C.AggregatorCore: the aggregator's protocol logic with no socket, for tests that
// drive it packet by packet (tests/test_aggregator_core.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "binding.h"

namespace py = pybind11;

namespace hvd_sparse::omni {

void register_aggregator_core(py::module_& m) {
  py::class_<AggregatorCore> c(m, "AggregatorCore");
  def_core(c)
      .def(py::init([](int workers, double idle, size_t max_slot_bytes, size_t max_jobs) {
             return std::make_unique<AggregatorCore>(
                 CoreOptions{workers, idle, max_slot_bytes, max_jobs});
           }),
           py::arg("workers") = 0, py::arg("idle") = 120.0,
           py::arg("max_slot_bytes") = size_t(2) << 30, py::arg("max_jobs") = 256)
      .def("expire", &AggregatorCore::expire, py::arg("now"))
      .def("active_jobs", &AggregatorCore::active_jobs);
}

}  // namespace hvd_sparse::omni

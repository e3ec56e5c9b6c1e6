// hvd_sparse._C.AggregatorCore: the aggregator's protocol logic with no socket, for tests that
// drive it packet by packet (tests/test_aggregator_core.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "binding.h"

namespace py = pybind11;

namespace hvd_sparse::omni {

void register_aggregator_core(py::module_& m) {
  py::class_<AggregatorCore>(m, "AggregatorCore")
      .def(py::init([](int workers, double idle, size_t max_slot_bytes, size_t max_jobs) {
             return std::make_unique<AggregatorCore>(
                 CoreOptions{workers, idle, max_slot_bytes, max_jobs});
           }),
           py::arg("workers") = 0, py::arg("idle") = 120.0,
           py::arg("max_slot_bytes") = size_t(2) << 30, py::arg("max_jobs") = 256)
      .def("handle",
           [](AggregatorCore& core, py::bytes packet, const std::pair<std::string, int>& from,
              double now) {
             std::string_view p = packet;
             std::vector<Out> out;
             core.handle(reinterpret_cast<const uint8_t*>(p.data()), p.size(), endpoint(from),
                         now, out);
             return sent(out);
           },
           py::arg("packet"), py::arg("sender"), py::arg("now") = 0.0,
           "Handles one datagram from sender (host, port); returns [((host, port), bytes)] to send.")
      .def("expire", &AggregatorCore::expire, py::arg("now"))
      .def("active_jobs", &AggregatorCore::active_jobs)
      .def("counters", [](const AggregatorCore& core) {
        py::dict d;
        for (auto& [name, v] : core.counters()) d[name] = v;
        return d;
      });
}

}  // namespace hvd_sparse::omni

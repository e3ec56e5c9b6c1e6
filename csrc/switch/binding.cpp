// hvd_sparse._C.SwitchPipeline: the emulated switch's aggregation data plane with no port, for
// tests that drive it packet by packet (tests/test_switch_pipeline.py). handle, counters and
// expire are its base's, hvd_sparse._C.Aggregation (csrc/omni/aggregator/binding.cpp).
#include <arpa/inet.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>

#include "pipeline.h"

namespace py = pybind11;

namespace hvd_sparse::omni {

void register_switch_pipeline(py::module_& m) {
  const PipelineOptions d;
  py::class_<Pipeline, Aggregation>(m, "SwitchPipeline")
      .def(py::init([](uint32_t cells, uint32_t values_per_pass, uint32_t cells_per_slot,
                       uint32_t max_workers, uint32_t auto_groups, double hold, double idle,
                       double abandon) {
             PipelineOptions o{cells, values_per_pass, cells_per_slot, max_workers, auto_groups,
                               hold};
             o.idle = idle;
             o.abandon = abandon;
             return std::make_unique<Pipeline>(o);
           }),
           py::arg("cells") = d.cells, py::arg("values_per_pass") = d.values_per_pass,
           py::arg("cells_per_slot") = d.cells_per_slot, py::arg("max_workers") = d.max_workers,
           py::arg("auto_groups") = d.auto_groups, py::arg("hold") = d.hold,
           py::arg("idle") = d.idle, py::arg("abandon") = d.abandon)
      .def(
          "install",
          [](Pipeline& p, uint64_t token, uint16_t nworkers, uint32_t groups, double now,
             const std::vector<std::string>& ips, uint32_t epoch) {
            std::vector<uint32_t> bin(ips.size());
            for (size_t i = 0; i < ips.size(); ++i)
              if (inet_pton(AF_INET, ips[i].c_str(), &bin[i]) != 1)
                throw std::invalid_argument("not an IPv4 address: " + ips[i]);
            return p.install(token, nworkers, groups, now, bin, epoch);
          },
          py::arg("token"), py::arg("nworkers"), py::arg("groups"), py::arg("now") = 0.0,
          py::arg("ips") = std::vector<std::string>{}, py::arg("epoch") = 1)
      .def("remove", &Pipeline::remove, py::arg("token"), py::arg("epoch") = UINT32_MAX)
      .def("jobs",
           [](const Pipeline& p) {
             py::list v;
             for (const SwitchJob& j : p.jobs())
               v.append(py::dict(py::arg("token") = j.token, py::arg("nworkers") = j.nworkers,
                                 py::arg("epoch") = j.epoch, py::arg("first") = j.first,
                                 py::arg("groups") = j.groups,
                                 py::arg("automatic") = j.automatic));
             return v;
           })
      .def("occupied", &Pipeline::occupied);
}

}  // namespace hvd_sparse::omni

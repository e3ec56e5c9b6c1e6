// hvd_sparse._C.SwitchPipeline: the emulated switch's aggregation data plane with no port, for
// tests that drive it packet by packet (tests/test_switch_pipeline.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "../../csrc/omni/aggregator/binding.h"
#include "pipeline.h"

namespace py = pybind11;

namespace hvd_sparse::omni {

void register_switch_pipeline(py::module_& m) {
  py::class_<Pipeline> c(m, "SwitchPipeline");
  def_core(c)
      .def(py::init([](uint32_t cells, uint32_t values_per_pass, uint32_t cells_per_slot,
                       uint32_t max_workers, uint32_t auto_groups, double hold, double idle) {
             return std::make_unique<Pipeline>(PipelineOptions{
                 cells, values_per_pass, cells_per_slot, max_workers, auto_groups, hold, idle});
           }),
           py::arg("cells") = 8192, py::arg("values_per_pass") = 64,
           py::arg("cells_per_slot") = 32, py::arg("max_workers") = 32,
           py::arg("auto_groups") = 0, py::arg("hold") = 2.0, py::arg("idle") = 120.0)
      .def("install", &Pipeline::install, py::arg("token"), py::arg("nworkers"),
           py::arg("groups"), py::arg("now") = 0.0)
      .def("remove", &Pipeline::remove, py::arg("token"))
      .def("jobs", [](const Pipeline& p) {
        py::list v;
        for (const SwitchJob& j : p.jobs())
          v.append(py::dict(py::arg("token") = j.token, py::arg("nworkers") = j.nworkers,
                            py::arg("first") = j.first, py::arg("groups") = j.groups,
                            py::arg("automatic") = j.automatic));
        return v;
      })
      .def("expire", &Pipeline::expire, py::arg("now"))
      .def("occupied", &Pipeline::occupied);
}

}  // namespace hvd_sparse::omni

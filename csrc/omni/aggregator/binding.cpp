// hvd_sparse._C.Aggregation, the Python face of aggregation.h that both socket-free cores share
// (handle, counters, expire), and its software implementation hvd_sparse._C.AggregatorCore, the
// aggregator's protocol logic with no socket, for tests that drive it packet by packet
// (tests/test_aggregator_core.py; csrc/switch/binding.cpp binds the switch's).
#include <arpa/inet.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core.h"

namespace py = pybind11;

namespace hvd_sparse::omni {
namespace {

Endpoint endpoint(const std::pair<std::string, int>& a) {
  Endpoint e;
  if (inet_pton(AF_INET, a.first.c_str(), &e.ip) != 1)
    throw std::invalid_argument("not an IPv4 address: " + a.first);
  e.port = htons(uint16_t(a.second));
  return e;
}

py::tuple address(const Endpoint& e) {
  char b[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &e.ip, b, sizeof b);
  return py::make_tuple(std::string(b), int(ntohs(e.port)));
}

// [((host, port), bytes)] of what a core asked to send.
py::list sent(const std::vector<Out>& out) {
  py::list v;
  for (const Out& o : out)
    v.append(py::make_tuple(
        address(o.to), py::bytes(reinterpret_cast<const char*>(o.bytes->data()), o.bytes->size())));
  return v;
}

}  // namespace

// The base class: registered before AggregatorCore and SwitchPipeline (module.cpp).
void register_aggregation(py::module_& m) {
  py::class_<Aggregation>(m, "Aggregation")
      .def(
          "handle",
          [](Aggregation& core, py::bytes packet, const std::pair<std::string, int>& from,
             double now) {
            std::string_view p = packet;
            std::vector<Out> out;
            core.handle(reinterpret_cast<const uint8_t*>(p.data()), p.size(), endpoint(from), now,
                        out);
            return sent(out);
          },
          py::arg("packet"), py::arg("sender"), py::arg("now") = 0.0,
          "Handles one datagram from sender (host, port); returns [((host, port), bytes)] to send.")
      .def("counters",
           [](const Aggregation& core) {
             py::dict d;
             for (auto& [name, v] : core.counters()) d[name] = v;
             return d;
           })
      .def("expire", &Aggregation::expire, py::arg("now"));
}

void register_aggregator_core(py::module_& m) {
  const CoreOptions d;
  py::class_<AggregatorCore, Aggregation>(m, "AggregatorCore")
      .def(py::init([](int workers, double idle, size_t max_slot_bytes, size_t max_jobs) {
             return std::make_unique<AggregatorCore>(
                 CoreOptions{workers, idle, max_slot_bytes, max_jobs});
           }),
           py::arg("workers") = d.workers, py::arg("idle") = d.idle,
           py::arg("max_slot_bytes") = d.max_slot_bytes, py::arg("max_jobs") = d.max_jobs)
      .def("active_jobs", &AggregatorCore::active_jobs);
}

}  // namespace hvd_sparse::omni

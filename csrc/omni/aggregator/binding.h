// Endpoints and outgoing datagrams as Python values, for the bindings of the socket-free
// aggregation cores (this directory's AggregatorCore, switch_emu's SwitchPipeline).
#pragma once
#include <arpa/inet.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core.h"

namespace hvd_sparse::omni {

inline Endpoint endpoint(const std::pair<std::string, int>& a) {
  Endpoint e;
  if (inet_pton(AF_INET, a.first.c_str(), &e.ip) != 1)
    throw std::invalid_argument("not an IPv4 address: " + a.first);
  e.port = htons(uint16_t(a.second));
  return e;
}

inline pybind11::tuple address(const Endpoint& e) {
  char b[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &e.ip, b, sizeof b);
  return pybind11::make_tuple(std::string(b), int(ntohs(e.port)));
}

// [((host, port), bytes)] of what a core asked to send.
inline pybind11::list sent(const std::vector<Out>& out) {
  pybind11::list v;
  for (const Out& o : out)
    v.append(pybind11::make_tuple(
        address(o.to),
        pybind11::bytes(reinterpret_cast<const char*>(o.bytes->data()), o.bytes->size())));
  return v;
}

// The methods every socket-free core has: handle (one datagram in, what it sends out) and
// counters.
template <class Core>
pybind11::class_<Core>& def_core(pybind11::class_<Core>& c) {
  namespace py = pybind11;
  return c
      .def("handle",
           [](Core& core, py::bytes packet, const std::pair<std::string, int>& from, double now) {
             std::string_view p = packet;
             std::vector<Out> out;
             core.handle(reinterpret_cast<const uint8_t*>(p.data()), p.size(), endpoint(from),
                         now, out);
             return sent(out);
           },
           py::arg("packet"), py::arg("sender"), py::arg("now") = 0.0,
           "Handles one datagram from sender (host, port); returns [((host, port), bytes)] to send.")
      .def("counters", [](const Core& core) {
        py::dict d;
        for (auto& [name, v] : core.counters()) d[name] = v;
        return d;
      });
}

}  // namespace hvd_sparse::omni

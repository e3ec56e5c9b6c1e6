// hvd_sparse._C.Aggregation, the Python face of aggregation.h that both socket-free cores share
// (handle, counters, expire), and its software implementation hvd_sparse._C.AggregatorCore, the
// aggregator's protocol logic with no socket, for tests that drive it packet by packet
// (tests/test_aggregator_core.py; csrc/switch/binding.cpp binds the switch's).
#include <arpa/inet.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../auth.h"
#include "../protocol.h"
#include "core.h"

namespace py = pybind11;

namespace hvd_sparse::omni {
namespace {

Endpoint endpoint(const std::pair<std::string, int>& a) {
  Endpoint e;
  if (!parse_ip(a.first, e))
    throw std::invalid_argument("not an IPv4 or IPv6 address: " + a.first);
  e.port = htons(uint16_t(a.second));
  return e;
}

py::tuple address(const Endpoint& e) { return py::make_tuple(e.host(), int(ntohs(e.port))); }

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
      .def(py::init([](int workers, double idle, size_t max_slot_bytes, size_t max_jobs,
                       size_t max_job_bytes, size_t max_tensors, const std::string& secret) {
             CoreOptions o;
             o.workers = workers;
             o.idle = idle;
             o.max_slot_bytes = max_slot_bytes;
             o.max_jobs = max_jobs;
             o.max_job_bytes = max_job_bytes;
             o.max_tensors = max_tensors;
             o.secret = secret;
             return std::make_unique<AggregatorCore>(o);
           }),
           py::arg("workers") = d.workers, py::arg("idle") = d.idle,
           py::arg("max_slot_bytes") = d.max_slot_bytes, py::arg("max_jobs") = d.max_jobs,
           py::arg("max_job_bytes") = d.max_job_bytes, py::arg("max_tensors") = d.max_tensors,
           py::arg("secret") = py::bytes())
      .def("active_jobs", &AggregatorCore::active_jobs);
}

// transport.h's address parsing, for the tests that hold the aggregator's --bind to it.
void register_endpoint(py::module_& m) {
  m.def(
      "parse_endpoint",
      [](const std::string& s) {
        Endpoint e;
        std::string why;
        if (!parse_endpoint(s, e, &why)) throw std::invalid_argument(why);
        return py::make_tuple(e.host(), int(ntohs(e.port)), e.is_v4() ? 4 : 6, e.str());
      },
      py::arg("text"),
      "ADDR:PORT as the aggregator's --bind takes it: (host, port, 4 or 6, canonical text); "
      "ValueError saying what is accepted.");
}

// The key material of auth.h, for hvd_sparse/auth.py and the tests that hold it to the spec.
void register_auth(py::module_& m) {
  m.def(
      "derive_job_key",
      [](const std::string& secret, uint64_t token) {
        return py::bytes(derive_job_key(secret, token));
      },
      py::arg("secret"), py::arg("token"));
  m.def("x25519_keypair", [] {
    std::string priv, pub;
    x25519_keypair(priv, pub);
    return py::make_tuple(py::bytes(priv), py::bytes(pub));
  });
  m.def(
      "x25519",
      [](const std::string& priv, const std::string& pub) { return py::bytes(x25519(priv, pub)); },
      py::arg("private"), py::arg("peer_public"));
  m.def(
      "gmac_sign",
      [](const std::string& key, const std::string& packet, uint32_t sender, uint64_t seq) {
        std::string b = packet;
        b.resize(b.size() + kAuthBytes);
        Mac(key).sign(reinterpret_cast<uint8_t*>(b.data()), packet.size(), sender, seq);
        return py::bytes(b);
      },
      py::arg("key"), py::arg("packet"), py::arg("sender"), py::arg("seq"),
      "packet + its trailer (sequence number, GMAC tag): what a peer of the job sends.");
  m.def(
      "gmac_rate",
      [](size_t packet_bytes, double seconds) {
        // One core signing, then verifying, packets of this size: bytes per second of each
        // (scripts/bench/bench_transport.py sets them against link rates).
        Mac mac(std::string(kKeyBytes, '\x5a'));
        std::vector<uint8_t> b(packet_bytes + kAuthBytes, 0x33);
        auto rate = [&](bool sign) {
          uint64_t n = 0, seq = 0;
          const auto t0 = std::chrono::steady_clock::now();
          double dt = 0;
          while (dt < seconds) {
            for (int i = 0; i < 64; ++i, ++n) {
              if (sign) mac.sign(b.data(), packet_bytes, 1, ++seq);
              else if (!mac.verify(b.data(), b.size(), 1, seq)) throw std::logic_error("GMAC");
            }
            dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          }
          return double(n) * double(packet_bytes) / dt;
        };
        const double s = rate(true);
        return std::make_pair(s, rate(false));
      },
      py::arg("packet_bytes"), py::arg("seconds") = 0.5, py::call_guard<py::gil_scoped_release>());
}

}  // namespace hvd_sparse::omni

// The emulated switch's ports (hvd-sparse-switch, main.cpp): one DPDK port per host (an
// af_packet vdev on each of the switch namespace's veth ends). Ordinary frames are forwarded by
// MAC learning (unknown and broadcast destinations flood to every other port), so ARP, MPI and
// Gloo flow as through a Linux bridge; each port's output queue is drained by a thread of its
// own; loss is emulated per port and switch-wide. Frames for the switch's own aggregation
// address (AggregationEndpoint) are answered (ARP) or handed to the aggregation program.
//
// Hosts are bound by the control plane, never learnt from traffic: `bind` installs a host's
// (port, MAC, IPv4). Aggregation datagrams are taken from bound hosts only, and results leave
// toward bound hosts only. At ingress a source guard drops frames that claim a bound host's
// IPv4 from another port or MAC, and frames that claim the switch's own addresses (so no host
// can speak as a worker or as the switch). Tables are bounded: kMaxMacs learnt MACs (beyond,
// unknown destinations flood), kMaxHosts bindings.
#pragma once
#include <rte_ethdev.h>
#include <rte_ether.h>
#include <rte_mbuf.h>
#include <rte_ring.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "pipeline.h"

namespace hvd_sparse::switch_emu {

namespace omni = hvd_sparse::omni;

constexpr uint16_t kRing = 512;        // descriptors of each port's receive and transmit rings
constexpr unsigned kEgress = 512;      // frames an egress port buffers beyond its driver's ring
constexpr uint16_t kDataRoom = 16384;  // a whole jumbo frame per mbuf
constexpr uint16_t kBurst = 32;
constexpr size_t kMaxMacs = 4096;   // the forwarding table's entries, as a switch's MAC table
constexpr size_t kMaxHosts = 1024;  // host bindings the control plane may install

// Prints "hvd-sparse switch: WHY" and exits with status 2.
[[noreturn]] void fail(const std::string& why);

// A port's output queue, drained by a thread of its own. The af_packet driver's transmit
// blocks (poll() without a timeout) while the port's ring is full, and it is full whenever
// more arrives for the port than its link carries (incast, a rate-capped veth): done in the
// polling loop, that would stall every port, the control socket with them, for as long as
// the slowest link takes. Here it stalls only this queue, which drops at its tail when full,
// as a switch's output buffer does.
class Egress {
 public:
  Egress(uint16_t port, const std::string& name);
  ~Egress();

  // Queues n frames (the polling loop's only call); returns how many did not fit, freed.
  unsigned push(rte_mbuf** m, unsigned n);

  uint64_t sent() const { return sent_.load(std::memory_order_relaxed); }
  uint64_t failed() const { return failed_.load(std::memory_order_relaxed); }

 private:
  void run();

  uint16_t port_;
  rte_ring* ring_ = nullptr;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::atomic<bool> idle_{false};
  std::atomic<uint64_t> sent_{0}, failed_{0};
  std::thread thread_;
};

struct Port {
  uint16_t id = 0;
  std::string name;
  uint64_t rx = 0, flooded = 0, dropped = 0, lost = 0;
  uint64_t spoofed = 0;  // dropped by the source guard
  double loss = 0;  // drop rate of frames entering or leaving this port
  std::unique_ptr<Egress> egress;
};

// Starts every port the EAL found (one queue each way, promiscuous, an Egress each), named by
// `names` in port order where given, else by their device names. Exits on failure.
std::vector<Port> open_ports(rte_mempool* pool, const std::vector<std::string>& names);
// Stops and closes every port (after Switch::stop()).
void close_ports();

// A host as the control plane bound it.
struct Binding {
  rte_ether_addr mac;
  size_t port;
};

// The switch's own endpoint and the aggregation program behind it.
struct AggregationEndpoint {
  omni::Endpoint self;
  rte_ether_addr mac{};  // locally administered, owned by no host
  std::unique_ptr<omni::Pipeline> pipeline;
  // unbound: datagrams from no bound host; bad_checksum: UDP checksum failed (never summed)
  uint64_t rx = 0, tx = 0, no_route = 0, ignored = 0, unbound = 0, bad_checksum = 0;
  uint16_t ip_id = 0;
  std::vector<omni::Out> out;
  // A RESULT leaves once per worker as the same bytes: its payload is summed once (the
  // pointer held, so the sum never outlives its bytes)
  std::shared_ptr<const std::vector<uint8_t>> summed;
  uint32_t payload_sum = 0;
};

class Switch {
 public:
  Switch(std::vector<Port> ports, rte_mempool* pool, std::unique_ptr<AggregationEndpoint> agg)
      : ports_(std::move(ports)), pool_(pool), agg_(std::move(agg)) {}

  // One pass over every port at time `now`: receive a burst, learn, forward. Returns the frames
  // received.
  unsigned poll(double now);
  // Control plane: binds IPv4 `ip` to the host on port `port` (its name) with `mac`
  // ("aa:bb:.."), replacing that address's binding. Returns "" or why it cannot.
  std::string bind(const std::string& port, const std::string& mac, const std::string& ip);
  bool bound(uint32_t ip) const { return hosts_.count(ip) != 0; }
  std::string stats_json() const;
  // Stops the egress threads (before the ports close).
  void stop();

  omni::Pipeline* pipeline() { return agg_ ? agg_->pipeline.get() : nullptr; }
  double now() const { return now_; }

  // Loss as the bridge's nftables rules make it (hvd_sparse/tools/testbed/loss.py): the
  // switch-wide rate once per frame, a port's rate on the frames entering and leaving it; with
  // udp_only, only IPv4/UDP frames are lost.
  void set_loss(const std::string& port, double rate, bool udp_only);

 private:
  void forward(size_t in, rte_mbuf* m);
  bool spoofed(size_t in, rte_mbuf* m) const;
  bool take(size_t in, rte_mbuf* m);
  void send(const omni::Out& o);
  bool lost(size_t port, rte_mbuf* m, double rate);
  void queue(size_t p, rte_mbuf* m, bool own = false);
  void flush();
  void flush_port(size_t p);

  std::vector<Port> ports_;
  rte_mempool* pool_;
  std::unique_ptr<AggregationEndpoint> agg_;
  double now_ = 0;
  double loss_ = 0;
  bool udp_only_ = false;
  std::mt19937_64 rng_{0x5157};
  std::uniform_real_distribution<double> unif_{0.0, 1.0};
  std::unordered_map<uint64_t, size_t> macs_;  // MAC -> port
  uint64_t macs_full_ = 0;                      // frames whose source MAC found no room
  std::unordered_map<uint32_t, Binding> hosts_;  // IPv4 -> its host, as the control plane bound it
  std::unordered_map<uint64_t, size_t> bound_macs_;  // a bound host's MAC -> its port
  std::unordered_map<size_t, std::vector<rte_mbuf*>> out_;
};

}  // namespace hvd_sparse::switch_emu

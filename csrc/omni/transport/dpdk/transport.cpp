#include "transport.h"

#include <sched.h>
#include <time.h>

#include <rte_eal.h>
#include <rte_ethdev.h>
#include <rte_lcore.h>

#include "frames.h"

#include <cstring>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

namespace hvd_sparse::omni {
namespace {

constexpr uint16_t kRing = 1024;       // descriptors per queue and direction
constexpr uint16_t kDataRoom = 16384;  // bytes per mbuf: a whole jumbo frame
using frames::kHeaders;
constexpr double kArpRetry = 0.05;  // seconds between ARP requests for one peer
constexpr uint32_t kSpins = 256;    // empty polls before an idle queue sleeps

// State every queue shares: the port, its pool, and the neighbour table (a peer's packets may
// arrive on one queue while another queue sends it a RESULT).
struct Port {
  uint16_t id = 0;
  rte_mempool* pool = nullptr;
  rte_ether_addr mac{};
  Endpoint self;
  std::mutex mu;
  std::unordered_map<uint32_t, rte_ether_addr> neighbours;
  std::unordered_map<uint32_t, double> asked;  // ip -> when we last sent an ARP request

  ~Port() {
    rte_eth_dev_stop(id);
    rte_eth_dev_close(id);
    rte_eal_cleanup();
  }

  void learn(uint32_t ip, const rte_ether_addr& mac) {
    std::lock_guard<std::mutex> lock(mu);
    neighbours[ip] = mac;
  }
  bool lookup(uint32_t ip, rte_ether_addr* out) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = neighbours.find(ip);
    if (it == neighbours.end()) return false;
    *out = it->second;
    return true;
  }
  bool should_ask(uint32_t ip, double now) {
    std::lock_guard<std::mutex> lock(mu);
    double& last = asked[ip];
    if (now - last < kArpRetry) return false;
    last = now;
    return true;
  }
};

class DpdkQueue : public Transport {
 public:
  DpdkQueue(std::shared_ptr<Port> port, uint16_t queue) : port_(std::move(port)), q_(queue) {}
  ~DpdkQueue() override { release(); }

  size_t recv(std::vector<Datagram>& in, size_t max) override {
    if (!registered_) {
      // The calling thread is the aggregator's, not the EAL's: registered, it gets an lcore id
      // and with it the mempool's per-lcore cache (else every mbuf goes through the ring).
      rte_thread_register();
      registered_ = true;
    }
    release();
    in.clear();
    rte_mbuf* m[64];
    const uint16_t n = rte_eth_rx_burst(port_->id, q_, m, uint16_t(std::min<size_t>(max, 64)));
    idle_ = n == 0 ? idle_ + 1 : 0;
    for (uint16_t i = 0; i < n; ++i) {
      Datagram d;
      if (parse(m[i], &d)) {
        in.push_back(d);
        held_.push_back(m[i]);
        AtomicCounters::add(c_.rx_packets, 1);
        AtomicCounters::add(c_.rx_bytes, d.len);
      } else {
        rte_pktmbuf_free(m[i]);
      }
    }
    return in.size();
  }

  void send(const Datagram* out, size_t n) override {
    summed_ = nullptr;  // the cache below holds within one call only
    rte_mbuf* m[64];
    uint16_t k = 0;
    for (size_t i = 0; i < n; ++i) {
      rte_mbuf* b = build(out[i]);
      if (b) m[k++] = b;
      if (k == 64 || (i + 1 == n && k)) {
        flush(m, k);
        k = 0;
      }
    }
    if (k) flush(m, k);
  }

  // A poll-mode driver has nothing to block on: it polls, and only after many empty polls in a
  // row sleeps a little, so that an idle aggregator sharing its cores with workers leaves them
  // the CPU while a busy one never sleeps between bursts.
  void wait(int timeout_ms, int) override {
    if (idle_ < kSpins || timeout_ms <= 0) return;
    timespec ts{0, 20 * 1000};
    nanosleep(&ts, nullptr);
  }

  Endpoint local() const override { return port_->self; }
  TransportCounters counters() const override { return c_.load(); }

 private:
  void release() {
    for (rte_mbuf* m : held_) rte_pktmbuf_free(m);
    held_.clear();
  }

  void flush(rte_mbuf** m, uint16_t k) {
    uint16_t sent = rte_eth_tx_burst(port_->id, q_, m, k);
    for (uint16_t j = sent; j < k; ++j) rte_pktmbuf_free(m[j]);
    if (sent < k) AtomicCounters::add(c_.tx_dropped, k - sent);
  }

  // A UDP datagram for us: fills `d` (pointing into the mbuf) and returns true. ARP is
  // answered here; everything else is counted as ignored.
  bool parse(rte_mbuf* m, Datagram* d) {
    if (rte_arp_hdr* arp = frames::arp_of(m)) {
      on_arp(arp);
      return ignore();
    }
    frames::Udp u;
    if (!frames::parse_udp(m, &u) || !(u.to == port_->self) || u.fragment) return ignore();
    if (!u.checksum_ok) {  // changed on the way: never summed
      AtomicCounters::add(c_.rx_bad_checksum, 1);
      return false;
    }
    // No learning from data frames: a frame with a spoofed source would divert results. Peers'
    // MACs come from ARP, as a host's neighbour table does.
    d->data = u.data;
    d->len = u.len;
    d->peer = u.from;
    return true;
  }

  bool ignore() {
    AtomicCounters::add(c_.rx_ignored, 1);
    return false;
  }

  void on_arp(const rte_arp_hdr* arp) {
    const rte_arp_ipv4& a = arp->arp_data;
    if (a.arp_sip) port_->learn(a.arp_sip, a.arp_sha);
    if (rte_be_to_cpu_16(arp->arp_opcode) != RTE_ARP_OP_REQUEST || a.arp_tip != port_->self.ip4())
      return;
    rte_mbuf* r = arp_frame(RTE_ARP_OP_REPLY, a.arp_sha, a.arp_sha, a.arp_sip);
    if (r) flush(&r, 1);
  }

  rte_mbuf* arp_frame(uint16_t op, const rte_ether_addr& to_mac, const rte_ether_addr& target,
                      uint32_t target_ip) {
    return frames::arp_frame(port_->pool, op, port_->mac, port_->self.ip4(), to_mac, target,
                             target_ip);
  }

  // The frame carrying `d`, or nullptr (dropped and counted) when the peer's MAC is not known
  // yet (an ARP request goes out; the protocol's timers resend) or it does not fit one mbuf.
  rte_mbuf* build(const Datagram& d) {
    rte_ether_addr dst;
    if (d.len + kHeaders > kDataRoom) return drop();
    if (!d.peer.is_v4()) return drop();  // IPv4 only: open_dpdk refuses an IPv6 address
    if (!port_->lookup(d.peer.ip4(), &dst)) {
      if (port_->should_ask(d.peer.ip4(), now())) {
        rte_ether_addr bcast, zero{};
        std::memset(&bcast, 0xff, sizeof bcast);
        if (rte_mbuf* r = arp_frame(RTE_ARP_OP_REQUEST, bcast, zero, d.peer.ip4())) flush(&r, 1);
      }
      return drop();
    }
    rte_mbuf* m = rte_pktmbuf_alloc(port_->pool);
    if (!m) return drop();
    rte_udp_hdr* udp =
        frames::write_udp(m, port_->mac, dst, port_->self, d.peer, d.data, d.len, ip_id_++);
    auto* ip = reinterpret_cast<const rte_ipv4_hdr*>(udp) - 1;
    udp->dgram_cksum = udp_checksum(ip, udp, d);  // receivers' kernels verify it
    AtomicCounters::add(c_.tx_packets, 1);
    AtomicCounters::add(c_.tx_bytes, d.len);
    return m;
  }

  // The UDP checksum in software (virtual devices offload nothing). A RESULT goes to every
  // worker of the job as the same bytes: its payload is summed once per send() and only the
  // headers per copy.
  uint16_t udp_checksum(const rte_ipv4_hdr* ip, const rte_udp_hdr* udp, const Datagram& d) {
    if (summed_ != d.data || summed_len_ != d.len) {
      summed_ = d.data;
      summed_len_ = d.len;
      payload_sum_ = rte_raw_cksum(d.data, d.len);
    }
    return frames::udp_checksum(ip, udp, payload_sum_);
  }

  rte_mbuf* drop() {
    AtomicCounters::add(c_.tx_dropped, 1);
    return nullptr;
  }

  std::shared_ptr<Port> port_;
  const uint16_t q_;
  std::vector<rte_mbuf*> held_;  // the datagrams of the last recv() point into these
  uint16_t ip_id_ = 0;
  uint32_t idle_ = 0;                // empty polls in a row
  const uint8_t* summed_ = nullptr;  // the payload whose checksum is payload_sum_
  size_t summed_len_ = 0;
  uint32_t payload_sum_ = 0;
  bool registered_ = false;
  AtomicCounters c_;
};

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error("dpdk: " + what); }

}  // namespace

std::vector<std::unique_ptr<Transport>> open_dpdk(const DpdkOptions& o) {
  // The EAL pins the calling thread to its first lcore; the aggregator's queue threads are
  // its own, so give the process its CPUs back afterwards.
  cpu_set_t cpus;
  sched_getaffinity(0, sizeof cpus, &cpus);
  std::vector<std::string> args{"hvd-sparse-aggregator"};
  std::istringstream words(o.eal_args);
  for (std::string w; words >> w;) args.push_back(w);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  if (rte_eal_init(int(argv.size()), argv.data()) < 0)
    fail("EAL initialization failed (" + std::string(rte_strerror(rte_errno)) +
         "), arguments: " + o.eal_args);
  sched_setaffinity(0, sizeof cpus, &cpus);
  if (rte_eth_dev_count_avail() == 0)
    fail(
        "no Ethernet port: give one with --dpdk \"--vdev=net_af_packet0,iface=IF ...\" or a PCI "
        "device");
  auto port = std::make_shared<Port>();
  uint16_t pid;
  RTE_ETH_FOREACH_DEV(pid) {
    port->id = pid;
    break;
  }
  if (!o.bind.is_v4())  // Ethernet/IPv4/UDP and ARP only: no IPv6 header or neighbour discovery
    fail("IPv4 only: cannot own " + o.bind.str() + " (use the udp transport for IPv6)");
  port->self = o.bind;
  const uint16_t q = uint16_t(o.queues);
  const unsigned mbufs = q * 2u * kRing + 2047;
  port->pool =
      rte_pktmbuf_pool_create("hvd_sparse", mbufs, 256, 0,
                              uint16_t(kDataRoom + RTE_PKTMBUF_HEADROOM), int(rte_socket_id()));
  if (!port->pool) fail("cannot create the mbuf pool: " + std::string(rte_strerror(rte_errno)));
  rte_eth_conf conf{};
  if (q > 1) conf.rxmode.mq_mode = RTE_ETH_MQ_RX_RSS;
  int rc = rte_eth_dev_configure(port->id, q, q, &conf);
  if (rc < 0)
    fail("cannot configure port with " + std::to_string(q) + " queues: " + rte_strerror(-rc));
  for (uint16_t i = 0; i < q; ++i) {
    if ((rc = rte_eth_rx_queue_setup(port->id, i, kRing, rte_eth_dev_socket_id(port->id), nullptr,
                                     port->pool)) < 0 ||
        (rc = rte_eth_tx_queue_setup(port->id, i, kRing, rte_eth_dev_socket_id(port->id),
                                     nullptr)) < 0)
      fail("queue " + std::to_string(i) + " setup: " + rte_strerror(-rc));
  }
  if ((rc = rte_eth_dev_start(port->id)) < 0) fail(std::string("port start: ") + rte_strerror(-rc));
  rte_eth_macaddr_get(port->id, &port->mac);
  rte_eth_promiscuous_enable(port->id);  // af_packet: see frames for our MAC whatever the kernel's
  std::vector<std::unique_ptr<Transport>> out;
  for (uint16_t i = 0; i < q; ++i) out.push_back(std::make_unique<DpdkQueue>(port, i));
  return out;
}

}  // namespace hvd_sparse::omni

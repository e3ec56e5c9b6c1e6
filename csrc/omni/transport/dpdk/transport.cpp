#include "transport.h"

#include <sched.h>
#include <time.h>

#include <rte_arp.h>
#include <rte_eal.h>
#include <rte_ethdev.h>
#include <rte_ether.h>
#include <rte_ip.h>
#include <rte_lcore.h>
#include <rte_mbuf.h>
#include <rte_udp.h>

#include <cstring>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

namespace hvd_sparse::omni {
namespace {

constexpr uint16_t kRing = 1024;                 // descriptors per queue and direction
constexpr uint16_t kDataRoom = 16384;            // bytes per mbuf: a whole jumbo frame
constexpr size_t kHeaders = sizeof(rte_ether_hdr) + sizeof(rte_ipv4_hdr) + sizeof(rte_udp_hdr);
constexpr double kArpRetry = 0.05;               // seconds between ARP requests for one peer
constexpr uint32_t kSpins = 256;                 // empty polls before an idle queue sleeps

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
    if (m->nb_segs != 1 || m->data_len < sizeof(rte_ether_hdr)) return ignore();
    auto* eth = rte_pktmbuf_mtod(m, rte_ether_hdr*);
    const uint16_t type = rte_be_to_cpu_16(eth->ether_type);
    if (type == RTE_ETHER_TYPE_ARP) {
      on_arp(m, eth);
      return ignore();
    }
    if (type != RTE_ETHER_TYPE_IPV4 || m->data_len < kHeaders) return ignore();
    auto* ip = reinterpret_cast<rte_ipv4_hdr*>(eth + 1);
    const size_t ihl = size_t(ip->version_ihl & 0x0f) * 4;
    const size_t total = rte_be_to_cpu_16(ip->total_length);
    if ((ip->version_ihl >> 4) != 4 || ihl < sizeof(rte_ipv4_hdr) ||
        total < ihl + sizeof(rte_udp_hdr) || sizeof(rte_ether_hdr) + total > m->data_len ||
        ip->next_proto_id != IPPROTO_UDP || ip->dst_addr != port_->self.ip)
      return ignore();
    if (rte_ipv4_cksum(ip) != 0xFFFF && rte_raw_cksum(ip, ihl) != 0xFFFF) return ignore();
    // Fragments (more-fragments flag or an offset): never reassembled, see transport.h.
    if (rte_be_to_cpu_16(ip->fragment_offset) & (RTE_IPV4_HDR_MF_FLAG | RTE_IPV4_HDR_OFFSET_MASK))
      return ignore();
    auto* udp = reinterpret_cast<rte_udp_hdr*>(reinterpret_cast<uint8_t*>(ip) + ihl);
    const size_t ulen = rte_be_to_cpu_16(udp->dgram_len);
    if (udp->dst_port != port_->self.port || ulen < sizeof(rte_udp_hdr) || ulen > total - ihl)
      return ignore();
    // The UDP checksum is not verified: senders on virtual links leave it to an offload that
    // never happens (the kernel marks it partial), and the protocol validates every field.
    port_->learn(ip->src_addr, eth->src_addr);
    d->data = reinterpret_cast<const uint8_t*>(udp + 1);
    d->len = ulen - sizeof(rte_udp_hdr);
    d->peer = {ip->src_addr, udp->src_port};
    return true;
  }

  bool ignore() {
    AtomicCounters::add(c_.rx_ignored, 1);
    return false;
  }

  void on_arp(rte_mbuf* m, rte_ether_hdr* eth) {
    if (m->data_len < sizeof(rte_ether_hdr) + sizeof(rte_arp_hdr)) return;
    auto* arp = reinterpret_cast<rte_arp_hdr*>(eth + 1);
    if (rte_be_to_cpu_16(arp->arp_hardware) != RTE_ARP_HRD_ETHER ||
        rte_be_to_cpu_16(arp->arp_protocol) != RTE_ETHER_TYPE_IPV4)
      return;
    const rte_arp_ipv4& a = arp->arp_data;
    if (a.arp_sip) port_->learn(a.arp_sip, a.arp_sha);
    if (rte_be_to_cpu_16(arp->arp_opcode) != RTE_ARP_OP_REQUEST || a.arp_tip != port_->self.ip)
      return;
    rte_mbuf* r = arp_frame(RTE_ARP_OP_REPLY, a.arp_sha, a.arp_sha, a.arp_sip);
    if (r) flush(&r, 1);
  }

  rte_mbuf* arp_frame(uint16_t op, const rte_ether_addr& to_mac, const rte_ether_addr& target,
                      uint32_t target_ip) {
    rte_mbuf* r = rte_pktmbuf_alloc(port_->pool);
    if (!r) return nullptr;
    const uint16_t len = sizeof(rte_ether_hdr) + sizeof(rte_arp_hdr);
    auto* eth = reinterpret_cast<rte_ether_hdr*>(rte_pktmbuf_append(r, len));
    eth->dst_addr = to_mac;
    eth->src_addr = port_->mac;
    eth->ether_type = rte_cpu_to_be_16(RTE_ETHER_TYPE_ARP);
    auto* arp = reinterpret_cast<rte_arp_hdr*>(eth + 1);
    arp->arp_hardware = rte_cpu_to_be_16(RTE_ARP_HRD_ETHER);
    arp->arp_protocol = rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4);
    arp->arp_hlen = RTE_ETHER_ADDR_LEN;
    arp->arp_plen = 4;
    arp->arp_opcode = rte_cpu_to_be_16(op);
    arp->arp_data.arp_sha = port_->mac;
    arp->arp_data.arp_sip = port_->self.ip;
    arp->arp_data.arp_tha = target;
    arp->arp_data.arp_tip = target_ip;
    return r;
  }

  // The frame carrying `d`, or nullptr (dropped and counted) when the peer's MAC is not known
  // yet (an ARP request goes out; the protocol's timers resend) or it does not fit one mbuf.
  rte_mbuf* build(const Datagram& d) {
    rte_ether_addr dst;
    if (d.len + kHeaders > kDataRoom) return drop();
    if (!port_->lookup(d.peer.ip, &dst)) {
      if (port_->should_ask(d.peer.ip, now())) {
        rte_ether_addr bcast, zero{};
        std::memset(&bcast, 0xff, sizeof bcast);
        if (rte_mbuf* r = arp_frame(RTE_ARP_OP_REQUEST, bcast, zero, d.peer.ip)) flush(&r, 1);
      }
      return drop();
    }
    rte_mbuf* m = rte_pktmbuf_alloc(port_->pool);
    if (!m) return drop();
    auto* eth = reinterpret_cast<rte_ether_hdr*>(rte_pktmbuf_append(m, uint16_t(kHeaders + d.len)));
    eth->dst_addr = dst;
    eth->src_addr = port_->mac;
    eth->ether_type = rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4);
    auto* ip = reinterpret_cast<rte_ipv4_hdr*>(eth + 1);
    ip->version_ihl = RTE_IPV4_VHL_DEF;
    ip->type_of_service = 0;
    ip->total_length = rte_cpu_to_be_16(uint16_t(sizeof(rte_ipv4_hdr) + sizeof(rte_udp_hdr) + d.len));
    ip->packet_id = rte_cpu_to_be_16(ip_id_++);
    ip->fragment_offset = rte_cpu_to_be_16(RTE_IPV4_HDR_DF_FLAG);
    ip->time_to_live = 64;
    ip->next_proto_id = IPPROTO_UDP;
    ip->src_addr = port_->self.ip;
    ip->dst_addr = d.peer.ip;
    ip->hdr_checksum = 0;
    auto* udp = reinterpret_cast<rte_udp_hdr*>(ip + 1);
    udp->src_port = port_->self.port;
    udp->dst_port = d.peer.port;
    udp->dgram_len = rte_cpu_to_be_16(uint16_t(sizeof(rte_udp_hdr) + d.len));
    udp->dgram_cksum = 0;
    std::memcpy(udp + 1, d.data, d.len);
    ip->hdr_checksum = rte_ipv4_cksum(ip);
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
    uint32_t sum = payload_sum_ + rte_raw_cksum(udp, sizeof *udp) + rte_ipv4_phdr_cksum(ip, 0);
    while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
    const uint16_t c = uint16_t(~sum);
    return c == 0 ? 0xffff : c;  // 0 would mean "no checksum"
  }

  rte_mbuf* drop() {
    AtomicCounters::add(c_.tx_dropped, 1);
    return nullptr;
  }

  std::shared_ptr<Port> port_;
  const uint16_t q_;
  std::vector<rte_mbuf*> held_;  // the datagrams of the last recv() point into these
  uint16_t ip_id_ = 0;
  uint32_t idle_ = 0;  // empty polls in a row
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
    fail("EAL initialization failed (" + std::string(rte_strerror(rte_errno)) + "), arguments: " +
         o.eal_args);
  sched_setaffinity(0, sizeof cpus, &cpus);
  if (rte_eth_dev_count_avail() == 0)
    fail("no Ethernet port: give one with --dpdk \"--vdev=net_af_packet0,iface=IF ...\" or a PCI "
         "device");
  auto port = std::make_shared<Port>();
  uint16_t pid;
  RTE_ETH_FOREACH_DEV(pid) { port->id = pid; break; }
  port->self = o.bind;
  const uint16_t q = uint16_t(o.queues);
  const unsigned mbufs = q * 2u * kRing + 2047;
  port->pool = rte_pktmbuf_pool_create("hvd_sparse", mbufs, 256, 0,
                                       uint16_t(kDataRoom + RTE_PKTMBUF_HEADROOM),
                                       int(rte_socket_id()));
  if (!port->pool) fail("cannot create the mbuf pool: " + std::string(rte_strerror(rte_errno)));
  rte_eth_conf conf{};
  if (q > 1) conf.rxmode.mq_mode = RTE_ETH_MQ_RX_RSS;
  int rc = rte_eth_dev_configure(port->id, q, q, &conf);
  if (rc < 0) fail("cannot configure port with " + std::to_string(q) + " queues: " + rte_strerror(-rc));
  for (uint16_t i = 0; i < q; ++i) {
    if ((rc = rte_eth_rx_queue_setup(port->id, i, kRing, rte_eth_dev_socket_id(port->id), nullptr,
                                     port->pool)) < 0 ||
        (rc = rte_eth_tx_queue_setup(port->id, i, kRing, rte_eth_dev_socket_id(port->id), nullptr)) < 0)
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

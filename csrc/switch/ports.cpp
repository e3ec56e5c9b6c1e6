// The emulated switch's ports: see ports.h.
#include "ports.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "../omni/transport/dpdk/frames.h"

namespace hvd_sparse::switch_emu {

namespace frames = hvd_sparse::omni::frames;

void fail(const std::string& why) {
  std::fprintf(stderr, "hvd-sparse switch: %s\n", why.c_str());
  std::exit(2);
}

// ---- Egress ------------------------------------------------------------------------------

Egress::Egress(uint16_t port, const std::string& name) : port_(port) {
  ring_ = rte_ring_create(("egress-" + name).substr(0, RTE_RING_NAMESIZE - 1).c_str(), kEgress,
                          SOCKET_ID_ANY, RING_F_SP_ENQ | RING_F_SC_DEQ);
  if (!ring_) throw std::runtime_error("egress ring for " + name + ": " + rte_strerror(rte_errno));
  thread_ = std::thread([this] { run(); });
}

Egress::~Egress() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  wake_.notify_one();
  thread_.join();
  for (rte_mbuf* m; rte_ring_sc_dequeue(ring_, reinterpret_cast<void**>(&m)) == 0;)
    rte_pktmbuf_free(m);
  rte_ring_free(ring_);
}

unsigned Egress::push(rte_mbuf** m, unsigned n) {
  const unsigned in = rte_ring_sp_enqueue_burst(ring_, reinterpret_cast<void**>(m), n, nullptr);
  for (unsigned i = in; i < n; ++i) rte_pktmbuf_free(m[i]);
  std::atomic_thread_fence(std::memory_order_seq_cst);  // the enqueue before reading idle_
  if (idle_.load(std::memory_order_relaxed)) {
    std::lock_guard<std::mutex> l(mu_);
    wake_.notify_one();
  }
  return n - in;
}

void Egress::run() {
  rte_mbuf* m[kBurst];
  for (;;) {
    const unsigned n =
        rte_ring_sc_dequeue_burst(ring_, reinterpret_cast<void**>(m), kBurst, nullptr);
    if (n == 0) {
      std::unique_lock<std::mutex> l(mu_);
      idle_.store(true, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_seq_cst);  // idle_ before reading the ring
      wake_.wait_for(l, std::chrono::milliseconds(10),
                     [this] { return stop_ || !rte_ring_empty(ring_); });
      idle_.store(false, std::memory_order_relaxed);
      if (stop_) return;
      continue;
    }
    const uint16_t sent = rte_eth_tx_burst(port_, 0, m, uint16_t(n));
    for (unsigned i = sent; i < n; ++i) rte_pktmbuf_free(m[i]);
    sent_.fetch_add(sent, std::memory_order_relaxed);
    failed_.fetch_add(n - sent, std::memory_order_relaxed);
  }
}

// ---- the ports ---------------------------------------------------------------------------

std::vector<Port> open_ports(rte_mempool* pool, const std::vector<std::string>& names) {
  std::vector<Port> ports;
  uint16_t pid;
  RTE_ETH_FOREACH_DEV(pid) {
    rte_eth_conf conf{};
    if (rte_eth_dev_configure(pid, 1, 1, &conf) < 0 ||
        rte_eth_rx_queue_setup(pid, 0, kRing, rte_eth_dev_socket_id(pid), nullptr, pool) < 0 ||
        rte_eth_tx_queue_setup(pid, 0, kRing, rte_eth_dev_socket_id(pid), nullptr) < 0 ||
        rte_eth_dev_start(pid) < 0)
      fail("cannot start port " + std::to_string(pid));
    rte_eth_promiscuous_enable(pid);
    char name[RTE_ETH_NAME_MAX_LEN] = "";
    rte_eth_dev_get_name_by_port(pid, name);
    Port& port = ports.emplace_back();
    port.id = pid;
    port.name = ports.size() <= names.size() ? names[ports.size() - 1] : name;
    try {
      port.egress = std::make_unique<Egress>(pid, port.name);
    } catch (const std::exception& e) {
      fail(e.what());
    }
  }
  return ports;
}

void close_ports() {
  uint16_t pid;
  RTE_ETH_FOREACH_DEV(pid) {
    rte_eth_dev_stop(pid);
    rte_eth_dev_close(pid);
  }
}

// ---- Switch ------------------------------------------------------------------------------

namespace {

uint64_t mac_key(const rte_ether_addr& a) {
  uint64_t k = 0;
  std::memcpy(&k, a.addr_bytes, RTE_ETHER_ADDR_LEN);
  return k;
}

}  // namespace

unsigned Switch::poll(double now) {
  unsigned got = 0;
  rte_mbuf* m[kBurst];
  now_ = now;
  for (size_t p = 0; p < ports_.size(); ++p) {
    const uint16_t n = rte_eth_rx_burst(ports_[p].id, 0, m, kBurst);
    ports_[p].rx += n;
    got += n;
    for (uint16_t i = 0; i < n; ++i) forward(p, m[i]);
  }
  flush();
  return got;
}

std::string Switch::stats_json() const {
  std::string s = "{\"ports\": [";
  for (size_t p = 0; p < ports_.size(); ++p) {
    const Port& q = ports_[p];
    rte_eth_stats e{};
    rte_eth_stats_get(q.id, &e);  // imissed: frames the kernel dropped, the port's ring full
    s += (p ? ", " : "") + std::string("{\"name\": \"") + q.name +
         "\", \"rx\": " + std::to_string(q.rx) + ", \"tx\": " + std::to_string(q.egress->sent()) +
         ", \"flooded\": " + std::to_string(q.flooded) +
         ", \"dropped\": " + std::to_string(q.dropped + q.egress->failed()) +
         ", \"lost\": " + std::to_string(q.lost) + ", \"missed\": " + std::to_string(e.imissed) +
         ", \"spoofed\": " + std::to_string(q.spoofed) + "}";
  }
  s += "], \"macs\": " + std::to_string(macs_.size()) +
       ", \"macs_full\": " + std::to_string(macs_full_) +
       ", \"hosts\": " + std::to_string(hosts_.size());
  if (agg_) {
    const omni::Pipeline& p = *agg_->pipeline;
    s += ", \"aggregation\": {\"rx\": " + std::to_string(agg_->rx) +
         ", \"tx\": " + std::to_string(agg_->tx) +
         ", \"no_route\": " + std::to_string(agg_->no_route) +
         ", \"ignored\": " + std::to_string(agg_->ignored) +
         ", \"unbound\": " + std::to_string(agg_->unbound) +
         ", \"bad_checksum\": " + std::to_string(agg_->bad_checksum) +
         ", \"occupied\": " + std::to_string(p.occupied()) +
         ", \"jobs_installed\": " + std::to_string(p.jobs().size());
    for (auto& [name, v] : p.counters())
      s += ", \"" + std::string(name) + "\": " + std::to_string(v);
    s += "}";
  }
  return s + "}";
}

void Switch::stop() {
  for (Port& p : ports_) p.egress.reset();
}

void Switch::set_loss(const std::string& port, double rate, bool udp_only) {
  udp_only_ = udp_only;
  if (port == "*") loss_ = rate;
  for (Port& p : ports_)
    if (p.name == port) p.loss = rate;
}

std::string Switch::bind(const std::string& port, const std::string& mac, const std::string& ip) {
  size_t p = 0;
  while (p < ports_.size() && ports_[p].name != port) ++p;
  Binding b{{}, p};
  uint32_t addr = 0;
  if (p == ports_.size()) return "no port " + port;
  if (rte_ether_unformat_addr(mac.c_str(), &b.mac) != 0 || !rte_is_unicast_ether_addr(&b.mac))
    return "not a unicast MAC: " + mac;
  if (inet_pton(AF_INET, ip.c_str(), &addr) != 1 || addr == 0)
    return "not an IPv4 address (the emulated switch is IPv4 only): " + ip;
  if (agg_ && (addr == agg_->self.ip4() || rte_is_same_ether_addr(&b.mac, &agg_->mac)))
    return "the switch's own address";
  if (!hosts_.count(addr) && hosts_.size() >= kMaxHosts)
    return "host table full (" + std::to_string(kMaxHosts) + ")";
  if (auto old = hosts_.find(addr); old != hosts_.end()) bound_macs_.erase(mac_key(old->second.mac));
  hosts_[addr] = b;
  bound_macs_[mac_key(b.mac)] = p;
  macs_[mac_key(b.mac)] = p;  // a static entry: learning never moves it (the guard drops that)
  return "";
}

// The source guard (ports.h): does this frame claim an address that is not its sender's?
bool Switch::spoofed(size_t in, rte_mbuf* m) const {
  const auto* eth = rte_pktmbuf_mtod(m, const rte_ether_hdr*);
  if (agg_ && rte_is_same_ether_addr(&eth->src_addr, &agg_->mac)) return true;
  if (auto b = bound_macs_.find(mac_key(eth->src_addr)); b != bound_macs_.end() && b->second != in)
    return true;
  uint32_t sip = 0;
  if (const rte_arp_hdr* arp = frames::arp_of(m)) {
    sip = arp->arp_data.arp_sip;
  } else if (eth->ether_type == rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4) &&
             m->data_len >= sizeof *eth + sizeof(rte_ipv4_hdr)) {
    sip = reinterpret_cast<const rte_ipv4_hdr*>(eth + 1)->src_addr;
  }
  if (sip == 0) return false;
  if (agg_ && sip == agg_->self.ip4()) return true;
  auto h = hosts_.find(sip);
  return h != hosts_.end() &&
         (h->second.port != in || !rte_is_same_ether_addr(&h->second.mac, &eth->src_addr));
}

void Switch::forward(size_t in, rte_mbuf* m) {
  if (m->data_len < sizeof(rte_ether_hdr)) {
    rte_pktmbuf_free(m);
    return;
  }
  if (lost(in, m, loss_ + ports_[in].loss)) return;
  if (spoofed(in, m)) {
    ports_[in].spoofed++;
    rte_pktmbuf_free(m);
    return;
  }
  if (agg_ && take(in, m)) return;
  auto* eth = rte_pktmbuf_mtod(m, rte_ether_hdr*);
  if (!rte_is_multicast_ether_addr(&eth->src_addr)) {
    const uint64_t k = mac_key(eth->src_addr);
    if (auto it = macs_.find(k); it != macs_.end()) it->second = in;
    else if (macs_.size() < kMaxMacs) macs_.emplace(k, in);
    else macs_full_++;  // not learnt: frames to it flood, as a full switch table does
  }
  auto it =
      rte_is_unicast_ether_addr(&eth->dst_addr) ? macs_.find(mac_key(eth->dst_addr)) : macs_.end();
  if (it != macs_.end()) {
    // Already on its segment.
    if (it->second == in) {
      rte_pktmbuf_free(m);
      return;
    }
    queue(it->second, m);
    return;
  }
  // Unknown or broadcast: every other port gets the same mbuf (its reference count).
  ports_[in].flooded++;
  const uint16_t copies = uint16_t(ports_.size() - 1);
  if (copies == 0) {
    rte_pktmbuf_free(m);
    return;
  }
  rte_mbuf_refcnt_update(m, int16_t(copies - 1));
  for (size_t p = 0; p < ports_.size(); ++p)
    if (p != in) queue(p, m);
}

// Frames for the switch's own address: ARP requests for it are answered, datagrams to its
// aggregation port from bound hosts go through the pipeline (the source guard has checked
// their port and MAC). Returns false for frames to forward.
bool Switch::take(size_t in, rte_mbuf* m) {
  AggregationEndpoint& a = *agg_;
  if (const rte_arp_hdr* arp = frames::arp_of(m)) {
    const rte_arp_ipv4& d = arp->arp_data;
    if (d.arp_tip != a.self.ip4()) return false;
    if (rte_be_to_cpu_16(arp->arp_opcode) == RTE_ARP_OP_REQUEST)
      if (rte_mbuf* r = frames::arp_frame(pool_, RTE_ARP_OP_REPLY, a.mac, a.self.ip4(), d.arp_sha,
                                          d.arp_sha, d.arp_sip))
        queue(in, r, true);
    rte_pktmbuf_free(m);
    return true;
  }
  const auto* eth = rte_pktmbuf_mtod(m, rte_ether_hdr*);
  if (!rte_is_same_ether_addr(&eth->dst_addr, &a.mac)) return false;
  frames::Udp u;
  if (frames::parse_udp(m, &u) && u.to == a.self && !u.fragment) {
    a.rx++;
    if (!u.checksum_ok || !hosts_.count(u.from.ip4())) {
      ++(u.checksum_ok ? a.unbound : a.bad_checksum);
      rte_pktmbuf_free(m);
      return true;
    }
    a.out.clear();
    omni::Aggregation& program = *a.pipeline;
    program.handle(u.data, u.len, u.from, now_, a.out);
    for (const omni::Out& o : a.out) send(o);
  } else {
    a.ignored++;  // to the switch's MAC but not its aggregation port: nobody else's
  }
  rte_pktmbuf_free(m);
  return true;
}

// One datagram from the switch's endpoint, out of its addressee's bound port, checksummed.
void Switch::send(const omni::Out& o) {
  AggregationEndpoint& a = *agg_;
  auto it = hosts_.find(o.to.ip4());
  rte_mbuf* m = it == hosts_.end() ? nullptr : rte_pktmbuf_alloc(pool_);
  if (!m || o.bytes->size() + frames::kHeaders > kDataRoom) {
    if (m) rte_pktmbuf_free(m);
    a.no_route++;
    return;
  }
  rte_udp_hdr* udp = frames::write_udp(m, a.mac, it->second.mac, a.self, o.to, o.bytes->data(),
                                       o.bytes->size(), a.ip_id++);
  if (a.summed != o.bytes) {
    a.summed = o.bytes;
    a.payload_sum = rte_raw_cksum(o.bytes->data(), o.bytes->size());
  }
  udp->dgram_cksum =
      frames::udp_checksum(reinterpret_cast<const rte_ipv4_hdr*>(udp) - 1, udp, a.payload_sum);
  a.tx++;
  queue(it->second.port, m, true);
}

bool Switch::lost(size_t port, rte_mbuf* m, double rate) {
  if (rate <= 0 || unif_(rng_) >= rate) return false;
  if (udp_only_) {
    const auto* eth = rte_pktmbuf_mtod(m, const rte_ether_hdr*);
    const auto* ip = reinterpret_cast<const rte_ipv4_hdr*>(eth + 1);
    if (eth->ether_type != rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4) ||
        m->data_len < sizeof *eth + sizeof *ip || ip->next_proto_id != IPPROTO_UDP)
      return false;
  }
  ports_[port].lost++;
  rte_pktmbuf_free(m);  // one reference: a flooded frame's other copies go on
  return true;
}

// Frames the switch makes itself (results, ARP replies) meet the switch-wide rate here,
// forwarded ones met it on the way in.
void Switch::queue(size_t p, rte_mbuf* m, bool own) {
  if (lost(p, m, ports_[p].loss + (own ? loss_ : 0))) return;
  auto& q = out_[p];
  q.push_back(m);
  if (q.size() == kBurst) flush_port(p);
}

void Switch::flush() {
  for (size_t p = 0; p < ports_.size(); ++p) flush_port(p);
}

void Switch::flush_port(size_t p) {
  auto& q = out_[p];
  if (q.empty()) return;
  ports_[p].dropped += ports_[p].egress->push(q.data(), unsigned(q.size()));  // full: lost
  q.clear();
}

}  // namespace hvd_sparse::switch_emu

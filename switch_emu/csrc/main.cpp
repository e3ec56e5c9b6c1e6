// hvd-sparse-switch: the switch of the emulated network, on DPDK. One port per host (an
// af_packet vdev on each of the switch namespace's veth ends); ordinary frames are forwarded
// by MAC learning (unknown and broadcast destinations flood to every other port), so ARP, MPI
// and Gloo flow as through a Linux bridge. With --aggregate IP:PORT the switch also owns that
// address (it answers ARP for it) and runs the aggregation program (pipeline.h; declared and
// fitted to the switch's limits by switch_emu/program.py) on the datagrams sent to it: each
// RESULT leaves once per worker, from the port it is learned on (the job's multicast group).
// A local control socket (--control PATH, text commands, JSON replies) installs, removes and
// lists jobs and reads the counters: switch_emu/control.py speaks it.
//
//   hvd-sparse-switch --dpdk "--no-huge --no-pci -m 512 --vdev=net_af_packet0,iface=w0 ..."
//                     [--names w0,w1,..] [--stats SECONDS] [--ready-file PATH]
//                     [--aggregate IP:PORT [--cells N] [--values-per-pass N]
//                      [--cells-per-slot N] [--auto-groups N] [--hold S] [--control PATH]]
#include <arpa/inet.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <rte_eal.h>
#include <rte_ethdev.h>
#include <rte_ether.h>
#include <rte_lcore.h>
#include <rte_mbuf.h>
#include <rte_ring.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <memory>
#include <random>
#include <unordered_map>
#include <vector>

#include "../../csrc/omni/transport/dpdk/frames.h"
#include "pipeline.h"

namespace {

namespace omni = hvd_sparse::omni;
namespace frames = hvd_sparse::omni::frames;

constexpr uint16_t kRing = 512;
constexpr unsigned kEgress = 512;  // frames an egress port buffers beyond its driver's ring
constexpr uint16_t kDataRoom = 16384;  // a whole jumbo frame per mbuf
constexpr uint16_t kBurst = 32;
constexpr uint32_t kSpins = 256;  // empty polls of every port before sleeping a little
constexpr long kNapMaxUs = 1000;  // the longest sleep of a loop whose ports stay silent

std::atomic<bool> g_stop{false}, g_dump{false};
void on_signal(int sig) { (sig == SIGUSR1 ? g_dump : g_stop).store(true); }

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A port's output queue, drained by a thread of its own. The af_packet driver's transmit
// blocks (poll() without a timeout) while the port's ring is full, and it is full whenever
// more arrives for the port than its link carries (incast, a rate-capped veth): done in the
// polling loop, that would stall every port, the control socket with them, for as long as
// the slowest link takes. Here it stalls only this queue, which drops at its tail when full,
// as a switch's output buffer does.
class Egress {
 public:
  Egress(uint16_t port, const std::string& name) : port_(port) {
    ring_ = rte_ring_create(("egress-" + name).substr(0, RTE_RING_NAMESIZE - 1).c_str(),
                            kEgress, SOCKET_ID_ANY, RING_F_SP_ENQ | RING_F_SC_DEQ);
    if (!ring_)
      throw std::runtime_error("egress ring for " + name + ": " + rte_strerror(rte_errno));
    thread_ = std::thread([this] { run(); });
  }
  ~Egress() {
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

  // Queues n frames (the polling loop's only call); returns how many did not fit, freed.
  unsigned push(rte_mbuf** m, unsigned n) {
    const unsigned in = rte_ring_sp_enqueue_burst(ring_, reinterpret_cast<void**>(m), n, nullptr);
    for (unsigned i = in; i < n; ++i) rte_pktmbuf_free(m[i]);
    std::atomic_thread_fence(std::memory_order_seq_cst);  // the enqueue before reading idle_
    if (idle_.load(std::memory_order_relaxed)) {
      std::lock_guard<std::mutex> l(mu_);
      wake_.notify_one();
    }
    return n - in;
  }

  uint64_t sent() const { return sent_.load(std::memory_order_relaxed); }
  uint64_t failed() const { return failed_.load(std::memory_order_relaxed); }

 private:
  void run() {
    rte_mbuf* m[kBurst];
    for (;;) {
      const unsigned n = rte_ring_sc_dequeue_burst(ring_, reinterpret_cast<void**>(m), kBurst,
                                                   nullptr);
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
  double loss = 0;  // drop rate of frames entering or leaving this port
  std::unique_ptr<Egress> egress;
};

uint64_t mac_key(const rte_ether_addr& a) {
  uint64_t k = 0;
  std::memcpy(&k, a.addr_bytes, RTE_ETHER_ADDR_LEN);
  return k;
}

[[noreturn]] void fail(const std::string& why) {
  std::fprintf(stderr, "hvd-sparse switch: %s\n", why.c_str());
  std::exit(2);
}

// The switch's own endpoint and the aggregation program behind it.
struct Aggregation {
  omni::Endpoint self;
  rte_ether_addr mac{};  // locally administered, owned by no host
  std::unique_ptr<omni::Pipeline> pipeline;
  std::unordered_map<uint32_t, std::pair<rte_ether_addr, size_t>> hosts;  // ip -> (MAC, port)
  uint64_t rx = 0, tx = 0, no_route = 0, ignored = 0;
  uint16_t ip_id = 0;
  std::vector<omni::Out> out;
};

class Switch {
 public:
  Switch(std::vector<Port> ports, rte_mempool* pool, std::unique_ptr<Aggregation> agg)
      : ports_(std::move(ports)), pool_(pool), agg_(std::move(agg)) {}

  // One pass over every port at time `now`: receive a burst, learn, forward. Returns the frames
  // received.
  unsigned poll(double now) {
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

  std::string stats_json() const {
    std::string s = "{\"ports\": [";
    for (size_t p = 0; p < ports_.size(); ++p) {
      const Port& q = ports_[p];
      rte_eth_stats e{};
      rte_eth_stats_get(q.id, &e);  // imissed: frames the kernel dropped, the port's ring full
      s += (p ? ", " : "") + std::string("{\"name\": \"") + q.name + "\", \"rx\": " +
           std::to_string(q.rx) + ", \"tx\": " + std::to_string(q.egress->sent()) +
           ", \"flooded\": " + std::to_string(q.flooded) + ", \"dropped\": " +
           std::to_string(q.dropped + q.egress->failed()) +
           ", \"lost\": " + std::to_string(q.lost) + ", \"missed\": " +
           std::to_string(e.imissed) + "}";
    }
    s += "], \"macs\": " + std::to_string(macs_.size());
    if (agg_) {
      const omni::Pipeline& p = *agg_->pipeline;
      s += ", \"aggregation\": {\"rx\": " + std::to_string(agg_->rx) + ", \"tx\": " +
           std::to_string(agg_->tx) + ", \"no_route\": " + std::to_string(agg_->no_route) +
           ", \"ignored\": " + std::to_string(agg_->ignored) + ", \"occupied\": " +
           std::to_string(p.occupied()) + ", \"jobs_installed\": " +
           std::to_string(p.jobs().size());
      for (auto& [name, v] : p.counters()) s += ", \"" + std::string(name) + "\": " + std::to_string(v);
      s += "}";
    }
    return s + "}";
  }

  void stop() {
    for (Port& p : ports_) p.egress.reset();
  }

  omni::Pipeline* pipeline() { return agg_ ? agg_->pipeline.get() : nullptr; }
  double now() const { return now_; }

  // Loss as the bridge's nftables rules make it (hvd_sparse/tools/testbed/loss.py): the switch-wide
  // rate once per frame, a port's rate on the frames entering and leaving it; with udp_only,
  // only IPv4/UDP frames are lost.
  void set_loss(const std::string& port, double rate, bool udp_only) {
    udp_only_ = udp_only;
    if (port == "*") loss_ = rate;
    for (Port& p : ports_)
      if (p.name == port) p.loss = rate;
  }

 private:
  void forward(size_t in, rte_mbuf* m) {
    if (m->data_len < sizeof(rte_ether_hdr)) { rte_pktmbuf_free(m); return; }
    if (lost(in, m, loss_ + ports_[in].loss)) return;
    if (agg_ && take(in, m)) return;
    auto* eth = rte_pktmbuf_mtod(m, rte_ether_hdr*);
    if (!rte_is_multicast_ether_addr(&eth->src_addr)) macs_[mac_key(eth->src_addr)] = in;
    auto it = rte_is_unicast_ether_addr(&eth->dst_addr) ? macs_.find(mac_key(eth->dst_addr))
                                                        : macs_.end();
    if (it != macs_.end()) {
      if (it->second == in) { rte_pktmbuf_free(m); return; }  // already on its segment
      queue(it->second, m);
      return;
    }
    // Unknown or broadcast: every other port gets the same mbuf (its reference count).
    ports_[in].flooded++;
    const uint16_t copies = uint16_t(ports_.size() - 1);
    if (copies == 0) { rte_pktmbuf_free(m); return; }
    rte_mbuf_refcnt_update(m, int16_t(copies - 1));
    for (size_t p = 0; p < ports_.size(); ++p)
      if (p != in) queue(p, m);
  }

  // Frames for the switch's own address: ARP requests for it are answered, datagrams to its
  // aggregation port go through the pipeline. Returns false for frames to forward.
  bool take(size_t in, rte_mbuf* m) {
    Aggregation& a = *agg_;
    if (const rte_arp_hdr* arp = frames::arp_of(m)) {
      const rte_arp_ipv4& d = arp->arp_data;
      if (d.arp_sip) a.hosts[d.arp_sip] = {d.arp_sha, in};
      if (d.arp_tip != a.self.ip) return false;
      if (rte_be_to_cpu_16(arp->arp_opcode) == RTE_ARP_OP_REQUEST)
        if (rte_mbuf* r = frames::arp_frame(pool_, RTE_ARP_OP_REPLY, a.mac, a.self.ip, d.arp_sha,
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
      a.hosts[u.from.ip] = {u.eth->src_addr, in};
      a.out.clear();
      a.pipeline->handle(u.data, u.len, u.from, now_, a.out);
      for (const omni::Out& o : a.out) send(o);
    } else {
      a.ignored++;  // to the switch's MAC but not its aggregation port: nobody else's
    }
    rte_pktmbuf_free(m);
    return true;
  }

  // One datagram from the switch's endpoint, out of the port its addressee was learned on.
  void send(const omni::Out& o) {
    Aggregation& a = *agg_;
    auto it = a.hosts.find(o.to.ip);
    rte_mbuf* m = it == a.hosts.end() ? nullptr : rte_pktmbuf_alloc(pool_);
    if (!m || o.bytes->size() + frames::kHeaders > kDataRoom) {
      if (m) rte_pktmbuf_free(m);
      a.no_route++;
      return;
    }
    frames::write_udp(m, a.mac, it->second.first, a.self, o.to, o.bytes->data(),
                      o.bytes->size(), a.ip_id++);
    a.tx++;
    queue(it->second.second, m, true);
  }

  bool lost(size_t port, rte_mbuf* m, double rate) {
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
  void queue(size_t p, rte_mbuf* m, bool own = false) {
    if (lost(p, m, ports_[p].loss + (own ? loss_ : 0))) return;
    auto& q = out_[p];
    q.push_back(m);
    if (q.size() == kBurst) flush_port(p);
  }

  void flush() {
    for (size_t p = 0; p < ports_.size(); ++p) flush_port(p);
  }

  void flush_port(size_t p) {
    auto& q = out_[p];
    if (q.empty()) return;
    ports_[p].dropped += ports_[p].egress->push(q.data(), unsigned(q.size()));  // full: lost
    q.clear();
  }

  std::vector<Port> ports_;
  rte_mempool* pool_;
  std::unique_ptr<Aggregation> agg_;
  double now_ = 0;
  double loss_ = 0;
  bool udp_only_ = false;
  std::mt19937_64 rng_{0x5157};
  std::uniform_real_distribution<double> unif_{0.0, 1.0};
  std::unordered_map<uint64_t, size_t> macs_;  // MAC -> port
  std::unordered_map<size_t, std::vector<rte_mbuf*>> out_;
};

// The control plane's local socket: one text command per datagram, one JSON reply to its
// sender (switch_emu/control.py). Commands: limits | jobs | stats |
// install TOKEN WORKERS GROUPS | remove TOKEN | loss PORT|* RATE [udp|all].
class Control {
 public:
  explicit Control(std::string path) : path_(std::move(path)) {
    fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    if (fd_ < 0 || path_.size() >= sizeof a.sun_path) fail("control socket: bad path " + path_);
    std::memcpy(a.sun_path, path_.c_str(), path_.size() + 1);
    unlink(path_.c_str());
    if (bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
      fail("control socket: cannot bind " + path_ + ": " + std::strerror(errno));
  }
  ~Control() {
    close(fd_);
    unlink(path_.c_str());
  }

  void poll(Switch& sw) {
    char buf[256];
    sockaddr_un from{};
    socklen_t len = sizeof from;
    for (ssize_t n; (n = recvfrom(fd_, buf, sizeof buf - 1, 0, reinterpret_cast<sockaddr*>(&from),
                                  &len)) >= 0; len = sizeof from) {
      buf[n] = 0;
      const std::string r = run(sw, buf) + "\n";
      sendto(fd_, r.data(), r.size(), 0, reinterpret_cast<sockaddr*>(&from), len);
    }
  }

 private:
  static std::string run(Switch& sw, const std::string& line) {
    omni::Pipeline* p = sw.pipeline();
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "stats") return sw.stats_json();
    if (cmd == "loss") {
      std::string port, what = "all";
      double rate = -1;
      if (!(in >> port >> rate) || rate < 0 || rate > 1 ||
          ((in >> what) && what != "udp" && what != "all"))
        return R"({"error": "usage: loss PORT|* RATE [udp|all]"})";
      sw.set_loss(port, rate, what == "udp");
      return R"({"loss": true})";
    }
    if (!p) return R"({"error": "no aggregation program: start the switch with --aggregate"})";
    const omni::PipelineOptions& o = p->options();
    if (cmd == "limits")
      return "{\"cells\": " + std::to_string(o.cells) + ", \"values_per_pass\": " +
             std::to_string(o.values_per_pass) + ", \"cells_per_slot\": " +
             std::to_string(o.cells_per_slot) + ", \"groups\": " +
             std::to_string(o.cells / o.cells_per_slot) + ", \"max_workers\": " +
             std::to_string(o.max_workers) + ", \"auto_groups\": " +
             std::to_string(o.auto_groups) + "}";
    if (cmd == "jobs") {
      std::string s = "{\"jobs\": [";
      for (const omni::SwitchJob& j : p->jobs()) {
        int registered = 0;
        for (const omni::Endpoint& e : j.addr) registered += e.port != 0;
        s += std::string(s.back() == '[' ? "" : ", ") + "{\"token\": " + std::to_string(j.token) +
             ", \"workers\": " + std::to_string(j.nworkers) + ", \"registered\": " +
             std::to_string(registered) + ", \"first\": " + std::to_string(j.first) +
             ", \"groups\": " + std::to_string(j.groups) + ", \"automatic\": " +
             (j.automatic ? "true" : "false") + "}";
      }
      return s + "]}";
    }
    uint64_t token = 0;
    if (cmd == "install") {
      unsigned workers = 0, groups = 0;
      if (!(in >> token >> workers >> groups) || workers > 65535)
        return R"({"error": "usage: install TOKEN WORKERS GROUPS"})";
      try {
        return "{\"first\": " + std::to_string(p->install(token, uint16_t(workers), groups,
                                                          sw.now())) + "}";
      } catch (const std::exception& e) {
        return std::string("{\"error\": \"") + e.what() + "\"}";
      }
    }
    if (cmd == "remove") {
      if (!(in >> token)) return R"({"error": "usage: remove TOKEN"})";
      return std::string("{\"removed\": ") + (p->remove(token) ? "true" : "false") + "}";
    }
    return R"({"error": "unknown command: limits | jobs | stats | install | remove | loss"})";
  }

  std::string path_;
  int fd_ = -1;
};

}  // namespace

int main(int argc, char** argv) {
  std::string eal, ready_file, names_arg;  // --names: the ports' names, in vdev order
  std::string aggregate, control;
  omni::PipelineOptions po;
  double stats_every = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    const bool more = i + 1 < argc;
    if (a == "--dpdk" && more) eal = argv[++i];
    else if (a == "--stats" && more) stats_every = std::atof(argv[++i]);
    else if (a == "--ready-file" && more) ready_file = argv[++i];
    else if (a == "--names" && more) names_arg = argv[++i];
    else if (a == "--aggregate" && more) aggregate = argv[++i];
    else if (a == "--control" && more) control = argv[++i];
    else if (a == "--cells" && more) po.cells = uint32_t(std::atol(argv[++i]));
    else if (a == "--values-per-pass" && more) po.values_per_pass = uint32_t(std::atol(argv[++i]));
    else if (a == "--cells-per-slot" && more) po.cells_per_slot = uint32_t(std::atol(argv[++i]));
    else if (a == "--auto-groups" && more) po.auto_groups = uint32_t(std::atol(argv[++i]));
    else if (a == "--hold" && more) po.hold = std::atof(argv[++i]);
    else {
      std::fprintf(stderr, "usage: hvd-sparse-switch --dpdk \"EAL ARGS (one vdev per port)\" "
                   "[--names A,B,..] [--stats SECONDS] [--ready-file PATH] [--aggregate IP:PORT "
                   "[--cells N] [--values-per-pass N] [--cells-per-slot N] [--auto-groups N] "
                   "[--hold SECONDS] [--control PATH]]\n");
      return a == "-h" || a == "--help" ? 0 : 2;
    }
  }
  std::unique_ptr<Aggregation> agg;
  if (!aggregate.empty()) {
    agg = std::make_unique<Aggregation>();
    const size_t colon = aggregate.rfind(':');
    if (colon == std::string::npos ||
        inet_pton(AF_INET, aggregate.substr(0, colon).c_str(), &agg->self.ip) != 1)
      fail("--aggregate wants IPV4:PORT, not " + aggregate);
    agg->self.port = htons(uint16_t(std::atoi(aggregate.c_str() + colon + 1)));
    agg->mac = {{0x02, 0x68, 0x73, 0x77, 0x00, 0x01}};  // locally administered: "hsw"
    try {
      agg->pipeline = std::make_unique<omni::Pipeline>(po);
    } catch (const std::exception& e) {
      fail(e.what());
    }
  }
  std::vector<std::string> args{"hvd-sparse-switch"};
  std::istringstream words(eal);
  for (std::string w; words >> w;) args.push_back(w);
  std::vector<char*> argv2;
  for (auto& a : args) argv2.push_back(a.data());
  // A switch has silicon of its own; the emulator shares the machine's cores with its hosts.
  // Under the testbed's heavy jobs the scheduler left the polling loop runnable but unrun for up
  // to 27 s at a time (nice -10 did not help), every port silent meanwhile. So the switch's
  // threads take the lowest real-time priority (the kernel still keeps 5% of each second for
  // everyone else), free to run on any core: EAL pins this thread, and with it every thread
  // it starts, to one.
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  const bool got_cpus = sched_getaffinity(0, sizeof cpus, &cpus) == 0;
  if (rte_eal_init(int(argv2.size()), argv2.data()) < 0)
    fail(std::string("EAL initialization failed: ") + rte_strerror(rte_errno));
  if (got_cpus) pthread_setaffinity_np(pthread_self(), sizeof cpus, &cpus);
  const sched_param rt{1};
  if (pthread_setschedparam(pthread_self(), SCHED_FIFO, &rt) != 0)
    std::fprintf(stderr, "hvd-sparse switch: no real-time priority (needs CAP_SYS_NICE): under "
                 "load the host's scheduler may leave the ports unpolled for seconds\n");
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);

  const uint16_t nports = rte_eth_dev_count_avail();
  if (nports < 2) fail("a switch needs at least 2 ports (one --vdev each)");
  rte_mempool* pool = rte_pktmbuf_pool_create(
      "switch", nports * (2u * kRing + kEgress) + 4095, 256, 0,
      uint16_t(kDataRoom + RTE_PKTMBUF_HEADROOM), int(rte_socket_id()));
  if (!pool) fail(std::string("mbuf pool: ") + rte_strerror(rte_errno));
  std::vector<std::string> names;
  std::stringstream list(names_arg);
  for (std::string n; std::getline(list, n, ',');) names.push_back(n);
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
  Switch sw(std::move(ports), pool, std::move(agg));
  std::unique_ptr<Control> ctl;
  if (!control.empty()) ctl = std::make_unique<Control>(control);
  std::printf("hvd-sparse switch: %u ports\n", nports);
  if (!aggregate.empty())
    std::printf("hvd-sparse switch: aggregation at %s: %u cells of %u int32 (%u slot groups of "
                "%u cells, each with a shadow set), at most %u workers per job\n",
                aggregate.c_str(), po.cells, po.values_per_pass, po.cells / po.cells_per_slot,
                po.cells_per_slot, po.max_workers);
  std::fflush(stdout);
  if (!ready_file.empty())
    if (FILE* f = std::fopen(ready_file.c_str(), "w")) std::fclose(f);

  double last_stats = now_s(), last_expire = last_stats;
  uint32_t idle = 0, loops = 0;
  double last_pass = now_s();
  while (!g_stop.load(std::memory_order_relaxed)) {
    const double t = now_s();
    if (t - last_pass > 0.5)  // the loop did not run: starved of CPU, or blocked in a driver
      std::fprintf(stderr, "hvd-sparse switch: no pass over the ports for %.2f s\n", t - last_pass);
    last_pass = t;
    if (sw.poll(t)) {  // one clock read per pass
      idle = 0;
    } else if (++idle >= kSpins) {
      // Idle: leave the CPU to the hosts sharing it. The nap doubles every 64 naps, from 20 us
      // to 1 ms: a silent switch polls 1,000 times a second, not 40,000, and gaps in a stream
      // (a few ms) still meet the short nap.
      const long us = std::min(kNapMaxUs, 20L << std::min(6u, (idle - kSpins) / 64));
      timespec ts{0, us * 1000};
      nanosleep(&ts, nullptr);
    }
    if (ctl && (idle >= kSpins || ++loops % 64 == 0)) ctl->poll(sw);
    if (sw.pipeline() && sw.now() - last_expire > 1.0) {
      sw.pipeline()->expire(sw.now());
      last_expire = sw.now();
    }
    if (g_dump.exchange(false) || (stats_every > 0 && now_s() - last_stats >= stats_every)) {
      std::printf("hvd-sparse switch stats %s\n", sw.stats_json().c_str());
      std::fflush(stdout);
      last_stats = now_s();
    }
  }
  std::printf("hvd-sparse switch stats %s\n", sw.stats_json().c_str());
  sw.stop();  // the egress threads, before their ports
  RTE_ETH_FOREACH_DEV(pid) {
    rte_eth_dev_stop(pid);
    rte_eth_dev_close(pid);
  }
  rte_eal_cleanup();
  return 0;
}

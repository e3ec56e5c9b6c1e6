// hvd-sparse-switch: the switch of the emulated network, on DPDK. One port per host (an
// af_packet vdev on each of the switch namespace's veth ends); ordinary frames are forwarded
// by MAC learning (unknown and broadcast destinations flood to every other port), so ARP, MPI
// and Gloo flow as through a Linux bridge. In-network aggregation of registered jobs builds on
// this forwarding plane (switch_emu/program.py declares the aggregation pipeline).
//
//   hvd-sparse-switch --dpdk "--no-huge --no-pci -m 512 --vdev=net_af_packet0,iface=w0 ..."
//                     [--names w0,w1,..] [--stats SECONDS] [--ready-file PATH]
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <rte_eal.h>
#include <rte_ethdev.h>
#include <rte_ether.h>
#include <rte_lcore.h>
#include <rte_mbuf.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr uint16_t kRing = 512;
constexpr uint16_t kDataRoom = 16384;  // a whole jumbo frame per mbuf
constexpr uint16_t kBurst = 32;
constexpr uint32_t kSpins = 256;  // empty polls of every port before sleeping a little

std::atomic<bool> g_stop{false}, g_dump{false};
void on_signal(int sig) { (sig == SIGUSR1 ? g_dump : g_stop).store(true); }

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Port {
  uint16_t id = 0;
  std::string name;
  uint64_t rx = 0, tx = 0, flooded = 0, dropped = 0;
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

class Switch {
 public:
  explicit Switch(std::vector<Port> ports) : ports_(std::move(ports)) {}

  // One pass over every port: receive a burst, learn, forward. Returns the frames received.
  unsigned poll() {
    unsigned got = 0;
    rte_mbuf* m[kBurst];
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
      s += (p ? ", " : "") + std::string("{\"name\": \"") + q.name + "\", \"rx\": " +
           std::to_string(q.rx) + ", \"tx\": " + std::to_string(q.tx) + ", \"flooded\": " +
           std::to_string(q.flooded) + ", \"dropped\": " + std::to_string(q.dropped) + "}";
    }
    return s + "], \"macs\": " + std::to_string(macs_.size()) + "}";
  }

 private:
  void forward(size_t in, rte_mbuf* m) {
    if (m->data_len < sizeof(rte_ether_hdr)) { rte_pktmbuf_free(m); return; }
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

  void queue(size_t p, rte_mbuf* m) {
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
    const uint16_t sent = rte_eth_tx_burst(ports_[p].id, 0, q.data(), uint16_t(q.size()));
    ports_[p].tx += sent;
    for (size_t i = sent; i < q.size(); ++i) rte_pktmbuf_free(q[i]);  // a full ring: lost
    ports_[p].dropped += q.size() - sent;
    q.clear();
  }

  std::vector<Port> ports_;
  std::unordered_map<uint64_t, size_t> macs_;  // MAC -> port
  std::unordered_map<size_t, std::vector<rte_mbuf*>> out_;
};

}  // namespace

int main(int argc, char** argv) {
  std::string eal, ready_file, names_arg;  // --names: the ports' names, in vdev order
  double stats_every = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--dpdk" && i + 1 < argc) eal = argv[++i];
    else if (a == "--stats" && i + 1 < argc) stats_every = std::atof(argv[++i]);
    else if (a == "--ready-file" && i + 1 < argc) ready_file = argv[++i];
    else if (a == "--names" && i + 1 < argc) names_arg = argv[++i];
    else {
      std::fprintf(stderr, "usage: hvd-sparse-switch --dpdk \"EAL ARGS (one vdev per port)\" "
                   "[--names A,B,..] [--stats SECONDS] [--ready-file PATH]\n");
      return a == "-h" || a == "--help" ? 0 : 2;
    }
  }
  std::vector<std::string> args{"hvd-sparse-switch"};
  std::istringstream words(eal);
  for (std::string w; words >> w;) args.push_back(w);
  std::vector<char*> argv2;
  for (auto& a : args) argv2.push_back(a.data());
  if (rte_eal_init(int(argv2.size()), argv2.data()) < 0)
    fail(std::string("EAL initialization failed: ") + rte_strerror(rte_errno));
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);

  const uint16_t nports = rte_eth_dev_count_avail();
  if (nports < 2) fail("a switch needs at least 2 ports (one --vdev each)");
  rte_mempool* pool = rte_pktmbuf_pool_create("switch", nports * 2u * kRing + 4095, 256, 0,
                                              uint16_t(kDataRoom + RTE_PKTMBUF_HEADROOM),
                                              int(rte_socket_id()));
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
    ports.push_back({pid, ports.size() < names.size() ? names[ports.size()] : name});
  }
  Switch sw(std::move(ports));
  std::printf("hvd-sparse switch: %u ports\n", nports);
  std::fflush(stdout);
  if (!ready_file.empty())
    if (FILE* f = std::fopen(ready_file.c_str(), "w")) std::fclose(f);

  double last_stats = now_s();
  uint32_t idle = 0;
  while (!g_stop.load(std::memory_order_relaxed)) {
    if (sw.poll()) {
      idle = 0;
    } else if (++idle >= kSpins) {
      timespec ts{0, 20 * 1000};  // idle: leave the CPU to the hosts sharing it
      nanosleep(&ts, nullptr);
    }
    if (g_dump.exchange(false) || (stats_every > 0 && now_s() - last_stats >= stats_every)) {
      std::printf("hvd-sparse switch stats %s\n", sw.stats_json().c_str());
      std::fflush(stdout);
      last_stats = now_s();
    }
  }
  std::printf("hvd-sparse switch stats %s\n", sw.stats_json().c_str());
  RTE_ETH_FOREACH_DEV(pid) {
    rte_eth_dev_stop(pid);
    rte_eth_dev_close(pid);
  }
  rte_eal_cleanup();
  return 0;
}

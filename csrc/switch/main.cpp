// hvd-sparse-switch: the switch of the emulated network, on DPDK. One port per host (an
// af_packet vdev on each of the switch namespace's veth ends); ordinary frames are forwarded
// by MAC learning (unknown and broadcast destinations flood to every other port), so ARP, MPI
// and Gloo flow as through a Linux bridge (ports.h). With --aggregate IP:PORT the switch also
// owns that address (it answers ARP for it) and runs the aggregation program (pipeline.h;
// declared and fitted to the switch's limits by hvd_sparse/tools/switch/program.py) on the
// datagrams sent to it from hosts the control plane bound: each RESULT leaves once per worker,
// out of its host's bound port (the job's multicast group). A local control socket (--control
// PATH, text commands, JSON replies; control.h) binds hosts, installs, removes and lists jobs
// and reads the counters:
// hvd_sparse/tools/switch/control.py speaks it. This file: the options, the wiring and the polling
// loop.
//
//   hvd-sparse-switch --dpdk "--no-huge --no-pci -m 512 --vdev=net_af_packet0,iface=w0 ..."
//                     [--names w0,w1,..] [--stats SECONDS] [--ready-file PATH]
//                     [--aggregate IP:PORT [--cells N] [--values-per-pass N]
//                      [--cells-per-slot N] [--auto-groups N] [--hold S] [--control PATH]]
//                     [--poll-spins N] [--poll-nap US]
#include <arpa/inet.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <time.h>

#include <rte_eal.h>
#include <rte_ethdev.h>
#include <rte_lcore.h>
#include <rte_mbuf.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "control.h"
#include "ports.h"

namespace hvd_sparse::switch_emu {
namespace {

constexpr long kNapMaxUs = 1000;  // the longest sleep of a loop whose ports stay silent

std::atomic<bool> g_stop{false}, g_dump{false};
void on_signal(int sig) { (sig == SIGUSR1 ? g_dump : g_stop).store(true); }

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Options {
  std::string eal, ready_file, names;  // --names: the ports' names, in vdev order
  std::string aggregate, control;
  omni::PipelineOptions pipeline;
  double stats_every = 0;
  // Empty passes over the ports before the loop sleeps, and its first nap. A switch has silicon
  // of its own; this loop shares the cores with its hosts at real-time priority, so every
  // spinning pass and wake-up is taken from them. Measured at N=4, 100 Mbit/s, scheme switch
  // (2026-11-28): these defaults spun 0.6 core and woke 16,500 times a second at about
  // 80 kpps; --poll-spins 1 --poll-nap 100 (packets of a nap taken in one burst per port)
  // made 1% density 2.4x faster (182-223 ms against 442-475) but 10% slower in
  // bench_testbed (3.4-3.6 s against 2.0-3.1 s; faster, 1.2 s against 2.9 s, in calls
  // back to back): neither is the default until the 10% case is understood.
  uint32_t spins = 256;
  long nap_us = 20;
};

void usage() {
  std::fprintf(stderr,
               "usage: hvd-sparse-switch --dpdk \"EAL ARGS (one vdev per port)\" "
               "[--names A,B,..] [--stats SECONDS] [--ready-file PATH] [--aggregate IP:PORT "
               "[--cells N] [--values-per-pass N] [--cells-per-slot N] [--auto-groups N] "
               "[--hold SECONDS] [--control PATH]] [--poll-spins N] [--poll-nap US]\n");
}

// The options, or exits (0 for --help, 2 for anything it does not know).
Options parse(int argc, char** argv) {
  Options o;
  omni::PipelineOptions& po = o.pipeline;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    const bool more = i + 1 < argc;
    if (a == "--dpdk" && more) o.eal = argv[++i];
    else if (a == "--stats" && more) o.stats_every = std::atof(argv[++i]);
    else if (a == "--ready-file" && more) o.ready_file = argv[++i];
    else if (a == "--names" && more) o.names = argv[++i];
    else if (a == "--aggregate" && more) o.aggregate = argv[++i];
    else if (a == "--control" && more) o.control = argv[++i];
    else if (a == "--cells" && more) po.cells = uint32_t(std::atol(argv[++i]));
    else if (a == "--values-per-pass" && more) po.values_per_pass = uint32_t(std::atol(argv[++i]));
    else if (a == "--cells-per-slot" && more) po.cells_per_slot = uint32_t(std::atol(argv[++i]));
    else if (a == "--auto-groups" && more) po.auto_groups = uint32_t(std::atol(argv[++i]));
    else if (a == "--hold" && more) po.hold = std::atof(argv[++i]);
    else if (a == "--poll-spins" && more) o.spins = uint32_t(std::max(1L, std::atol(argv[++i])));
    else if (a == "--poll-nap" && more)
      o.nap_us = std::clamp(std::atol(argv[++i]), 1L, kNapMaxUs);
    else {
      usage();
      std::exit(a == "-h" || a == "--help" ? 0 : 2);
    }
  }
  return o;
}

// The switch's aggregation endpoint at --aggregate IP:PORT, with its pipeline (nullptr without
// --aggregate). Exits on a bad address or options the pipeline refuses.
std::unique_ptr<AggregationEndpoint> endpoint(const Options& o) {
  if (o.aggregate.empty()) return nullptr;
  auto agg = std::make_unique<AggregationEndpoint>();
  std::string why;
  if (!omni::parse_endpoint(o.aggregate, agg->self, &why))
    fail("--aggregate wants IPV4:PORT: " + why);
  if (!agg->self.is_v4())  // its ports parse and build Ethernet/IPv4/UDP, and answer ARP only
    fail("--aggregate " + o.aggregate + ": the emulated switch is IPv4 only (Ethernet/IPv4/UDP "
         "frames, ARP; no IPv6 neighbour discovery): give it an IPv4 address");
  agg->mac = {{0x02, 0x68, 0x73, 0x77, 0x00, 0x01}};  // locally administered: "hsw"
  try {
    agg->pipeline = std::make_unique<omni::Pipeline>(o.pipeline);
  } catch (const std::exception& e) {
    fail(e.what());
  }
  return agg;
}

// Starts DPDK's EAL with these arguments, then gives this thread (and every thread it starts)
// real-time priority on any core, and catches SIGTERM, SIGINT (stop) and SIGUSR1 (stats).
void start(const std::string& eal) {
  std::vector<std::string> args{"hvd-sparse-switch"};
  std::istringstream words(eal);
  for (std::string w; words >> w;) args.push_back(w);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  // A switch has silicon of its own; the emulator shares the machine's cores with its hosts.
  // Under the testbed's heavy jobs the scheduler left the polling loop runnable but unrun for up
  // to 27 s at a time (nice -10 did not help), every port silent meanwhile. So the switch's
  // threads take the lowest real-time priority (the kernel still keeps 5% of each second for
  // everyone else), free to run on any core: EAL pins this thread, and with it every thread
  // it starts, to one.
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  const bool got_cpus = sched_getaffinity(0, sizeof cpus, &cpus) == 0;
  if (rte_eal_init(int(argv.size()), argv.data()) < 0)
    fail(std::string("EAL initialization failed: ") + rte_strerror(rte_errno));
  if (got_cpus) pthread_setaffinity_np(pthread_self(), sizeof cpus, &cpus);
  const sched_param rt{1};
  if (pthread_setschedparam(pthread_self(), SCHED_FIFO, &rt) != 0)
    std::fprintf(stderr,
                 "hvd-sparse switch: no real-time priority (needs CAP_SYS_NICE): under "
                 "load the host's scheduler may leave the ports unpolled for seconds\n");
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);
}

void print_stats(const Switch& sw) {
  std::printf("hvd-sparse switch stats %s\n", sw.stats_json().c_str());
  std::fflush(stdout);
}

// Polls the ports until SIGTERM or SIGINT; between passes, the control socket, expiry of idle
// jobs and the periodic stats.
void loop(Switch& sw, Control* ctl, const Options& o) {
  const double stats_every = o.stats_every;
  double last_stats = now_s(), last_expire = last_stats, last_pass = last_stats;
  uint32_t idle = 0, loops = 0;
  while (!g_stop.load(std::memory_order_relaxed)) {
    const double t = now_s();
    if (t - last_pass > 0.5)  // the loop did not run: starved of CPU, or blocked in a driver
      std::fprintf(stderr, "hvd-sparse switch: no pass over the ports for %.2f s\n", t - last_pass);
    last_pass = t;
    if (sw.poll(t)) {  // one clock read per pass
      idle = 0;
    } else if (++idle >= o.spins) {
      // Idle: leave the CPU to the hosts sharing it. The nap doubles every 64 naps, from
      // --poll-nap to 1 ms: a silent switch polls 1,000 times a second, and gaps in a stream
      // (a few ms) still meet the short nap.
      const long us = std::min(kNapMaxUs, o.nap_us << std::min(6u, (idle - o.spins) / 64));
      timespec ts{0, us * 1000};
      nanosleep(&ts, nullptr);
    }
    if (ctl && (idle >= o.spins || ++loops % 64 == 0)) ctl->poll(sw);
    if (omni::Aggregation* program = sw.pipeline(); program && sw.now() - last_expire > 1.0) {
      program->expire(sw.now());
      last_expire = sw.now();
    }
    if (g_dump.exchange(false) || (stats_every > 0 && now_s() - last_stats >= stats_every)) {
      print_stats(sw);
      last_stats = now_s();
    }
  }
}

}  // namespace
}  // namespace hvd_sparse::switch_emu

int main(int argc, char** argv) {
  using namespace hvd_sparse::switch_emu;
  const Options o = parse(argc, argv);
  std::unique_ptr<Control> ctl;  // first: a path that is no socket fails before DPDK starts
  if (!o.control.empty()) ctl = std::make_unique<Control>(o.control);
  std::unique_ptr<AggregationEndpoint> agg = endpoint(o);
  start(o.eal);
  const uint16_t nports = rte_eth_dev_count_avail();
  if (nports < 2) fail("a switch needs at least 2 ports (one --vdev each)");
  // What can be held at once: per port a full egress ring, the burst its thread is sending and
  // the burst queued for it; one received burst; the polling lcore's cache (up to 1.5 x 256).
  // No ring descriptors: af_packet allocates an mbuf per received frame and frees each sent one
  // once copied into its socket ring. 2 x kRing per port more (34,815 mbufs of 16.5 KiB at 20
  // ports) did not fit -m 512; this is 9.5 MiB a port (control.py eal_args sizes -m so).
  const unsigned mbufs = nports * (kEgress + 2 * kBurst) + kBurst + 512;
  rte_mempool* pool =
      rte_pktmbuf_pool_create("switch", mbufs, 256, 0, uint16_t(kDataRoom + RTE_PKTMBUF_HEADROOM),
                              int(rte_socket_id()));
  if (!pool) fail(std::string("mbuf pool: ") + rte_strerror(rte_errno));
  std::vector<std::string> names;
  std::stringstream list(o.names);
  for (std::string n; std::getline(list, n, ',');) names.push_back(n);
  Switch sw(open_ports(pool, names), pool, std::move(agg));
  std::printf("hvd-sparse switch: %u ports\n", nports);
  const omni::PipelineOptions& po = o.pipeline;
  if (!o.aggregate.empty())
    std::printf(
        "hvd-sparse switch: aggregation at %s: %u cells of %u int32 (%u slot groups of "
        "%u cells, each with a shadow set), at most %u workers per job\n",
        o.aggregate.c_str(), po.cells, po.values_per_pass, po.cells / po.cells_per_slot,
        po.cells_per_slot, po.max_workers);
  std::fflush(stdout);
  if (!o.ready_file.empty())
    if (FILE* f = std::fopen(o.ready_file.c_str(), "w")) std::fclose(f);
  loop(sw, ctl.get(), o);
  print_stats(sw);
  sw.stop();  // the egress threads, before their ports
  close_ports();
  rte_eal_cleanup();
  return 0;
}

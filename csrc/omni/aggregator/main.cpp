// hvd-sparse aggregator: sums the non-zero blocks that workers stream to it and returns each
// round's sum to every worker (docs/PROTOCOL.md). A plain process without torch:
//
//   hvd-sparse-aggregator --bind 0.0.0.0:9999 --workers 4 [--threads 1] [--stats 10]
//   hvd-sparse-aggregator --bind [::]:9999   (IPv6 and, dual-stack, IPv4)
//   hvd-sparse-aggregator --transport dpdk --dpdk "--no-huge --no-pci
//   --vdev=net_af_packet0,iface=eth0" --bind 10.77.0.101:9999
// (9999 is the port of the docs, the testbed and the images: protocol.h's kAggregatorPort.)
//
// This file is the process: options, transports, one thread per queue, counters, exit. The
// protocol is core.cpp's; the I/O is the transport's (../transport/).
#include <arpa/inet.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../auth.h"
#include "../protocol.h"
#include "../transport/lossy.h"
#include "../transport/udp/transport.h"
#include "core.h"
#ifdef HVD_SPARSE_DPDK
#include "../transport/dpdk/transport.h"
#endif

namespace hvd_sparse::omni {
namespace {

struct Options {
  Endpoint bind = Endpoint::v4(htonl(INADDR_LOOPBACK), 0);  // --bind
  int port_lo = 0, port_hi = 0;  // --port-range: with port 0, the first free port in it
  std::string transport = "udp";
  std::string dpdk_args;
  int threads = 1;
  LossRates loss;  // test hooks
  double stats_every = 0;
  int parent = 0;
  std::string port_file;
  uint64_t seed = 1;
  CoreOptions core;
};

std::atomic<bool> g_stop{false}, g_dump{false};
void on_signal(int sig) { (sig == SIGUSR1 ? g_dump : g_stop).store(true); }

[[noreturn]] void fail(const std::string& why) {
  std::fprintf(stderr, "hvd-sparse aggregator: %s\n", why.c_str());
  std::exit(2);
}

std::vector<std::unique_ptr<Transport>> open_transports(const Options& o) {
  Endpoint at = o.bind;
  std::vector<std::unique_ptr<Transport>> ts;
  if (o.transport == "udp") {
    // One socket per thread on one port (SO_REUSEPORT); the first picks the port when 0. In
    // a range, one thread's socket is exclusive: two aggregators started at one instant (two
    // jobs sharing a range) cannot both pass the probe and then share the port.
    if (at.port == 0 && o.port_lo > 0)
      ts.push_back(UdpTransport::in_range(at, o.port_lo, o.port_hi, o.threads > 1));
    for (int i = int(ts.size()); i < o.threads; ++i) {
      ts.push_back(std::make_unique<UdpTransport>(at, true));
      at = ts[0]->local();
    }
  } else if (o.transport == "dpdk") {
#ifdef HVD_SPARSE_DPDK
    if (!at.is_v4())
      fail("--transport dpdk is IPv4 only (it builds Ethernet/IPv4/UDP frames and answers ARP; "
           "IPv6 neighbour discovery is not implemented): --bind " + at.str() +
           " needs --transport udp");
    if (at.unspecified() || at.port == 0)
      fail("--transport dpdk needs an explicit --bind ADDR:PORT (it answers ARP for ADDR)");
    ts = open_dpdk({o.dpdk_args, at, o.threads});
#else
    fail(
        "this aggregator was built without DPDK (libdpdk-dev and pkg-config were not found "
        "when it was compiled): install them and rebuild (make build), or use --transport udp");
#endif
  } else {
    fail("unknown --transport " + o.transport + " (udp or dpdk)");
  }
  if (o.loss.any())
    for (size_t i = 0; i < ts.size(); ++i)
      ts[i] = std::make_unique<Lossy>(std::move(ts[i]), o.loss, o.seed * 7919 + i);
  return ts;
}

// One queue: receive a batch, let the core handle it, send what it returns.
void serve(Aggregation& core, Transport& t) {
  std::vector<Datagram> in, send;
  std::vector<Out> out;
  while (!g_stop.load(std::memory_order_relaxed)) {
    if (t.recv(in, 64) == 0) {
      t.wait(100);
      continue;
    }
    out.clear();
    const double now = t.now();
    for (const Datagram& d : in) core.handle(d.data, d.len, d.peer, now, out);
    send.clear();
    for (const Out& o : out) send.push_back({o.bytes->data(), o.bytes->size(), o.to});
    t.send(send.data(), send.size());
  }
}

std::string stats_json(const Aggregation& core, const std::vector<std::unique_ptr<Transport>>& ts) {
  TransportCounters tc;
  for (auto& t : ts) tc += t->counters();
  std::string s = "{";
  auto add = [&](const char* name, uint64_t v) {
    s += std::string(s.size() > 1 ? ", " : "") + "\"" + name + "\": " + std::to_string(v);
  };
#define HS_ADD(n) add(#n, tc.n);
  HS_TRANSPORT_COUNTERS(HS_ADD)
#undef HS_ADD
  for (auto& [name, v] : core.counters()) add(name, v);
  return s + "}";
}

void usage() {
  std::fprintf(
      stderr,
      "usage: hvd-sparse-aggregator --bind ADDR:PORT [--workers N] [--threads T]\n"
      "         [--transport udp|dpdk] [--dpdk \"EAL ARGS\"]\n"
      "         [--secret-file PATH] [--stats SECONDS] [--idle SECONDS] [--parent-pid PID]\n"
      "         [--port-file PATH] [--port-range LO-HI] [--max-job-bytes B] [--max-tensors N]\n"
      "         [--drop-rate P] [--drop-rate-out P] [--dup-rate P] [--reorder-rate P] [--seed S]\n"
      "Sums the non-zero blocks hvd-sparse workers stream to it (docs/PROTOCOL.md).\n"
      "--bind ADDR:PORT: an IPv4 address (0.0.0.0: all) or an IPv6 one in brackets\n"
      "  ([fd00::1]:9999; [::]:9999: all, IPv4 too, dual-stack); PORT 0: any free port.\n"
      "--secret-file: the deployment's secret (>= 16 bytes, a file only its owner reads, or\n"
      "  its group where no other user is in it: docs/security.md):\n"
      "  every packet must then be authenticated under its job's key, as hvd_sparse jobs\n"
      "  do when given the same file (HVD_SPARSE_SECRET_FILE); without it the aggregator\n"
      "  takes only unauthenticated jobs (HVD_SPARSE_AUTH=0: an isolated fabric only).\n"
      "--max-job-bytes, --max-tensors: one job's share (accumulator memory, default 1 GiB of\n"
      "  the 2 GiB; tensors in flight, default 4096): a tensor beyond fails, other jobs go on.\n"
      "--transport dpdk runs on a DPDK port (the first of the EAL's devices, e.g.\n"
      "  --dpdk \"--no-huge --no-pci -m 256 --vdev=net_af_packet0,iface=eth0\"), answering ARP\n"
      "  for ADDR itself (IPv4 only); --threads is then its number of queues.\n"
      "--port-range LO-HI: with --bind ADDR:0, bind the first free port in LO..HI (a job kept\n"
      "  to the ports a firewall opens, HVD_SPARSE_PORTS); an error when all are taken. With\n"
      "  --threads > 1 two aggregators started at the same instant may share a port: start\n"
      "  them one after another.\n"
      "Counters print every --stats seconds, on SIGUSR1 and at exit.\n");
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) {
        usage();
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--bind") {
      std::string v = val(), why;
      if (!parse_endpoint(v, o.bind, &why)) {
        std::fprintf(stderr, "hvd-sparse-aggregator: bad --bind: %s\n", why.c_str());
        std::exit(2);
      }
    } else if (a == "--workers") o.core.workers = std::atoi(val().c_str());
    else if (a == "--threads") o.threads = std::max(1, std::atoi(val().c_str()));
    else if (a == "--transport") o.transport = val();
    else if (a == "--dpdk") o.dpdk_args = val();
    else if (a == "--secret-file") {
      try {
        o.core.secret = read_secret_file(val());
      } catch (const std::exception& e) {
        std::fprintf(stderr, "hvd-sparse-aggregator: %s\n", e.what());
        std::exit(2);
      }
    } else if (a == "--stats") o.stats_every = std::atof(val().c_str());
    else if (a == "--idle") o.core.idle = std::atof(val().c_str());
    else if (a == "--max-job-bytes")
      o.core.max_job_bytes = std::strtoull(val().c_str(), nullptr, 10);
    else if (a == "--max-tensors")
      o.core.max_tensors = std::strtoull(val().c_str(), nullptr, 10);
    else if (a == "--parent-pid") o.parent = std::atoi(val().c_str());
    else if (a == "--port-file") o.port_file = val();
    else if (a == "--port-range") {
      std::string v = val();
      if (std::sscanf(v.c_str(), "%d-%d", &o.port_lo, &o.port_hi) != 2 || o.port_lo < 1 ||
          o.port_hi > 65535 || o.port_lo > o.port_hi) {
        std::fprintf(stderr, "bad --port-range %s (LO-HI, 1 <= LO <= HI <= 65535)\n", v.c_str());
        std::exit(2);
      }
    }
    else if (a == "--drop-rate") o.loss.drop_in = std::atof(val().c_str());
    else if (a == "--drop-rate-out") o.loss.drop_out = std::atof(val().c_str());
    else if (a == "--dup-rate") o.loss.dup_in = std::atof(val().c_str());
    else if (a == "--reorder-rate") o.loss.reorder = std::atof(val().c_str());
    else if (a == "--seed") o.seed = std::strtoull(val().c_str(), nullptr, 10);
    else if (a == "-h" || a == "--help") {
      usage();
      std::exit(0);
    } else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      usage();
      std::exit(2);
    }
  }
  if (o.core.workers < 0 || o.core.workers > kMaxWorkers) {
    usage();
    std::exit(2);
  }
  return o;
}

}  // namespace
}  // namespace hvd_sparse::omni

int main(int argc, char** argv) {
  using namespace hvd_sparse::omni;
  Options o = parse(argc, argv);
  if (o.parent) {
    // No orphans: die with the rank that launched us (checked again below, in case it already
    // died before prctl took effect).
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != o.parent) return 0;
  }
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  std::vector<std::unique_ptr<Transport>> ts;
  try {
    ts = open_transports(o);
  } catch (const std::exception& e) {
    fail(e.what());
  }
  const Endpoint at = ts[0]->local();
  std::printf("hvd-sparse aggregator listening on %s workers=%d threads=%d transport=%s\n",
              at.str().c_str(), o.core.workers, int(ts.size()), o.transport.c_str());
  std::fflush(stdout);
  if (!o.port_file.empty()) {  // written atomically: the launcher polls for it
    std::string tmp = o.port_file + ".tmp";
    if (FILE* f = std::fopen(tmp.c_str(), "w")) {
      std::fprintf(f, "%d\n", ntohs(at.port));
      std::fclose(f);
      std::rename(tmp.c_str(), o.port_file.c_str());
    }
  }

  AggregatorCore core(o.core);
  std::vector<std::thread> threads;
  for (auto& t : ts) threads.emplace_back(serve, std::ref(core), std::ref(*t));
  double last_stats = monotonic_s(), last_expire = monotonic_s();
  auto dump = [&] {
    std::printf("hvd-sparse aggregator stats %s\n", stats_json(core, ts).c_str());
    std::fflush(stdout);
  };
  while (!g_stop.load()) {
    usleep(50 * 1000);
    double t = monotonic_s();
    if (g_dump.exchange(false)) dump();
    if (o.stats_every > 0 && t - last_stats >= o.stats_every) {
      dump();
      last_stats = t;
    }
    if (t - last_expire >= 1.0) {
      core.expire(ts[0]->now());
      last_expire = t;
    }
    if (o.parent && getppid() != o.parent) g_stop = true;
  }
  for (auto& th : threads) th.join();
  dump();
  ts.clear();
  return 0;
}

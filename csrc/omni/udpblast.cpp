// hvd-sparse-udpblast: the raw UDP limit the aggregator is measured against. N sender processes
// blast datagrams of the given size at one receiving socket (as N workers stream to one
// aggregator) with sendmmsg; the receiver counts with recvmmsg. Prints one JSON line:
//
//   hvd-sparse-udpblast --senders 4 --bytes 16440 --seconds 1
//
// With --to ADDR:PORT it only sends, for --seconds, to a receiver elsewhere (another host, or
// an aggregator on any transport, which counts what arrives: scripts/bench/bench_transport.py);
// ADDR is IPv4 or a bracketed IPv6 one ([fd00::1]:9999).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "transport/udp/transport.h"

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

using hvd_sparse::omni::Endpoint;

[[noreturn]] void sender(const Endpoint& at, size_t bytes, double seconds) {
  int fd = socket(at.family(), SOCK_DGRAM, 0);
  hvd_sparse::omni::deepen_buffers(fd);
  sockaddr_storage to;
  const socklen_t len = at.to_sockaddr(at.family(), to);
  constexpr int kBatch = 32;
  std::vector<uint8_t> buf(bytes, 0x5a);
  std::vector<mmsghdr> msgs(kBatch);
  iovec iov{buf.data(), bytes};
  for (auto& m : msgs) {
    m.msg_hdr = {};
    m.msg_hdr.msg_name = &to;
    m.msg_hdr.msg_namelen = len;
    m.msg_hdr.msg_iov = &iov;
    m.msg_hdr.msg_iovlen = 1;
  }
  double end = now_s() + seconds;
  while (now_s() < end) sendmmsg(fd, msgs.data(), kBatch, 0);
  _exit(0);
}

}  // namespace

int main(int argc, char** argv) {
  int senders = 4;
  size_t bytes = 16440;
  double seconds = 1.0;
  std::string to;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--to") to = argv[i + 1];
    else if (a == "--senders") senders = std::atoi(argv[i + 1]);
    else if (a == "--bytes") bytes = std::strtoul(argv[i + 1], nullptr, 10);
    else if (a == "--seconds") seconds = std::atof(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: %s [--senders N] [--bytes B] [--seconds S] [--to ADDR:PORT]\n",
                   argv[0]);
      return 2;
    }
  }
  if (senders < 1 || bytes < 1 || bytes > 65507 || seconds <= 0) return 2;
  using namespace hvd_sparse::omni;
  if (!to.empty()) {
    Endpoint dst;
    std::string why;
    if (!parse_endpoint(to, dst, &why)) {
      std::fprintf(stderr, "%s: bad --to: %s\n", argv[0], why.c_str());
      return 2;
    }
    std::vector<pid_t> kids;
    for (int s = 0; s < senders; ++s) {
      pid_t p = fork();
      if (p == 0) sender(dst, bytes, seconds);
      kids.push_back(p);
    }
    for (pid_t p : kids) waitpid(p, nullptr, 0);
    return 0;
  }
  UdpTransport rx(Endpoint::v4(htonl(INADDR_LOOPBACK), 0), false);
  const Endpoint at = rx.local();
  std::vector<pid_t> kids;
  for (int s = 0; s < senders; ++s) {
    pid_t p = fork();
    if (p == 0) sender(at, bytes, seconds);
    kids.push_back(p);
  }
  std::vector<Datagram> in;
  uint64_t packets = 0, received = 0;
  double start = now_s(), end = start + seconds;
  while (now_s() < end) {
    if (rx.recv(in, 64) == 0) rx.wait(10);
    for (const Datagram& d : in) received += d.len;
    packets += in.size();
  }
  double took = now_s() - start;
  for (pid_t p : kids) {
    kill(p, SIGTERM);
    waitpid(p, nullptr, 0);
  }
  std::printf(
      "{\"senders\": %d, \"bytes\": %zu, \"seconds\": %.3f, \"packets\": %llu, "
      "\"received_bytes\": %llu, \"goodput_Bps\": %.0f}\n",
      senders, bytes, took, (unsigned long long)packets, (unsigned long long)received,
      received / took);
  return 0;
}

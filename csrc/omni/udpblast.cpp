// hvd-sparse-udpblast: the raw UDP limit the aggregator is measured against. N sender processes
// blast datagrams of the given size at one receiving socket (as N workers stream to one
// aggregator) with sendmmsg; the receiver counts with recvmmsg. Prints one JSON line:
//
//   hvd-sparse-udpblast --senders 4 --bytes 16440 --seconds 1
//
// With --to ADDR:PORT it only sends, for --seconds, to a receiver elsewhere (another host, or
// an aggregator on any transport, which counts what arrives: scripts/bench/bench_transport.py).
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

int udp_socket() {
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  hvd_sparse::omni::deepen_buffers(fd);
  return fd;
}

[[noreturn]] void sender(const sockaddr_in& to, size_t bytes, double seconds) {
  int fd = udp_socket();
  constexpr int kBatch = 32;
  std::vector<uint8_t> buf(bytes, 0x5a);
  std::vector<mmsghdr> msgs(kBatch);
  iovec iov{buf.data(), bytes};
  for (auto& m : msgs) {
    m.msg_hdr = {};
    m.msg_hdr.msg_name = const_cast<sockaddr_in*>(&to);
    m.msg_hdr.msg_namelen = sizeof to;
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
    sockaddr_in dst{};
    dst.sin_family = AF_INET;
    const size_t colon = to.rfind(':');
    if (colon == std::string::npos ||
        inet_pton(AF_INET, to.substr(0, colon).c_str(), &dst.sin_addr) != 1)
      return 2;
    dst.sin_port = htons(uint16_t(std::atoi(to.c_str() + colon + 1)));
    std::vector<pid_t> kids;
    for (int s = 0; s < senders; ++s) {
      pid_t p = fork();
      if (p == 0) sender(dst, bytes, seconds);
      kids.push_back(p);
    }
    for (pid_t p : kids) waitpid(p, nullptr, 0);
    return 0;
  }
  UdpTransport rx(Endpoint{htonl(INADDR_LOOPBACK), 0}, false);
  const Endpoint at = rx.local();
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = at.ip;
  a.sin_port = at.port;
  std::vector<pid_t> kids;
  for (int s = 0; s < senders; ++s) {
    pid_t p = fork();
    if (p == 0) sender(a, bytes, seconds);
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

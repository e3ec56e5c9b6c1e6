// Kernel UDP sockets: the default transport. Batched system calls (recvmmsg/sendmmsg), deep
// socket buffers (whole windows of datagrams arrive at once), and SO_REUSEPORT so that one
// socket per thread can share the aggregator's port.
#pragma once
#include <memory>
#include <vector>

#include <sys/socket.h>

#include "../transport.h"

namespace hvd_sparse::omni {

class UdpTransport : public Transport {
 public:
  // Binds to `at` (0.0.0.0 or ::: every address, port 0: any free port): an IPv4 socket for
  // an IPv4 address, else an IPv6 one, dual-stack when bound to :: (IPv4 peers then appear
  // v4-mapped, which Endpoint stores alike). Throws std::runtime_error naming the address
  // when that fails.
  UdpTransport(const Endpoint& at, bool reuse_port, size_t batch = 64);
  // Bound to the first free port of [lo, hi] (host order) at `at` (its port ignored): a job
  // kept to a port range
  // (HVD_SPARSE_PORTS). With `reuse_port` a port some other socket holds, shared or not, is
  // skipped, so a socket never joins another process's port group (but two processes probing
  // one port at the same instant may: prefer an exclusive socket). Throws naming the range
  // when every port is taken.
  static std::unique_ptr<UdpTransport> in_range(const Endpoint& at, int lo, int hi,
                                                bool reuse_port);
  ~UdpTransport() override;
  UdpTransport(const UdpTransport&) = delete;
  UdpTransport& operator=(const UdpTransport&) = delete;

  size_t recv(std::vector<Datagram>& in, size_t max) override;
  void send(const Datagram* out, size_t n) override;
  void wait(int timeout_ms, int wake_fd = -1) override;
  Endpoint local() const override;
  TransportCounters counters() const override { return c_.load(); }
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  int family_ = AF_INET;
  std::vector<std::vector<uint8_t>> buf_;
  std::vector<mmsghdr> rmsg_, smsg_;
  std::vector<iovec> riov_, siov_;
  std::vector<sockaddr_storage> rfrom_, sto_;
  AtomicCounters c_;
};

// Raises the socket's buffers to `bytes`; as root past net.core.{r,w}mem_max.
void deepen_buffers(int fd, int bytes = 64 << 20);

}  // namespace hvd_sparse::omni

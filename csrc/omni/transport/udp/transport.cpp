#include "transport.h"

#include <netinet/in.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace hvd_sparse::omni {

void deepen_buffers(int fd, int bytes) {
  if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &bytes, sizeof bytes))
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
  if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &bytes, sizeof bytes))
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
}

UdpTransport::UdpTransport(const Endpoint& at, bool reuse_port, size_t batch)
    : buf_(batch, std::vector<uint8_t>(65536)), rmsg_(batch), riov_(batch), rfrom_(batch) {
  family_ = at.family();
  fd_ = socket(family_, SOCK_DGRAM, 0);
  if (fd_ < 0)
    throw std::runtime_error(std::string("socket (") + (family_ == AF_INET ? "IPv4" : "IPv6") +
                             ") for " + at.str() + ": " + std::strerror(errno));
  int one = 1;
  if (reuse_port) setsockopt(fd_, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
  if (family_ == AF_INET6) {  // dual-stack on ::, whatever net.ipv6.bindv6only says
    int v6only = at.unspecified() ? 0 : 1;
    setsockopt(fd_, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof v6only);
  }
  deepen_buffers(fd_);
  sockaddr_storage a;
  const socklen_t alen = at.to_sockaddr(family_, a);
  if (bind(fd_, reinterpret_cast<sockaddr*>(&a), alen)) {
    int e = errno;
    ::close(fd_);
    throw std::runtime_error("cannot bind " + at.str() + ": " + std::strerror(e));
  }
}

std::unique_ptr<UdpTransport> UdpTransport::in_range(const Endpoint& ip, int lo, int hi,
                                                     bool reuse_port) {
  std::string why = "empty range";
  for (int p = lo; p <= hi; ++p) {
    Endpoint at = ip;
    at.port = htons(uint16_t(p));
    try {
      if (reuse_port) UdpTransport probe(at, false, 1);  // free for an exclusive socket?
      return std::make_unique<UdpTransport>(at, reuse_port);
    } catch (const std::runtime_error& e) {
      why = e.what();
    }
  }
  throw std::runtime_error("no free UDP port in " + std::to_string(lo) + "-" +
                           std::to_string(hi) + " (HVD_SPARSE_PORTS): the last said: " + why);
}

UdpTransport::~UdpTransport() { ::close(fd_); }

size_t UdpTransport::recv(std::vector<Datagram>& in, size_t max) {
  const size_t n = std::min(max, rmsg_.size());
  for (size_t i = 0; i < n; ++i) {
    riov_[i] = {buf_[i].data(), buf_[i].size()};
    rmsg_[i].msg_hdr = {};
    rmsg_[i].msg_hdr.msg_name = &rfrom_[i];
    rmsg_[i].msg_hdr.msg_namelen = sizeof(sockaddr_storage);
    rmsg_[i].msg_hdr.msg_iov = &riov_[i];
    rmsg_[i].msg_hdr.msg_iovlen = 1;
  }
  int got = recvmmsg(fd_, rmsg_.data(), unsigned(n), MSG_DONTWAIT, nullptr);
  in.clear();
  for (int i = 0; i < got; ++i) {
    in.push_back({buf_[i].data(), rmsg_[i].msg_len, Endpoint::from_sockaddr(rfrom_[i])});
    AtomicCounters::add(c_.rx_bytes, rmsg_[i].msg_len);
  }
  if (got > 0) AtomicCounters::add(c_.rx_packets, uint64_t(got));
  return in.size();
}

void UdpTransport::send(const Datagram* out, size_t n) {
  smsg_.resize(n);
  siov_.resize(n);
  sto_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    // An IPv4 peer as the socket's family (v4-mapped from an IPv6 socket); an IPv6 peer
    // always as IPv6, which an IPv4 socket refuses (EINVAL: counted dropped below) rather
    // than sending to 0.0.0.0, i.e. to this host.
    const int fam = out[i].peer.is_v4() ? family_ : AF_INET6;
    const socklen_t len = out[i].peer.to_sockaddr(fam, sto_[i]);
    siov_[i] = {const_cast<uint8_t*>(out[i].data), out[i].len};
    smsg_[i].msg_hdr = {};
    smsg_[i].msg_hdr.msg_name = &sto_[i];
    smsg_[i].msg_hdr.msg_namelen = len;
    smsg_[i].msg_hdr.msg_iov = &siov_[i];
    smsg_[i].msg_hdr.msg_iovlen = 1;
  }
  size_t done = 0;
  while (done < n) {
    int s = sendmmsg(fd_, smsg_.data() + done, unsigned(n - done), MSG_DONTWAIT);
    if (s < 0 && errno == EINTR) continue;
    if (s <= 0) {  // a full buffer (EAGAIN, ENOBUFS) or an unreachable peer: skip one
      AtomicCounters::add(c_.tx_dropped, 1);
      ++done;
      continue;
    }
    for (int i = 0; i < s; ++i) AtomicCounters::add(c_.tx_bytes, out[done + i].len);
    AtomicCounters::add(c_.tx_packets, uint64_t(s));
    done += size_t(s);
  }
}

void UdpTransport::wait(int timeout_ms, int wake_fd) {
  pollfd p[2] = {{fd_, POLLIN, 0}, {wake_fd, POLLIN, 0}};
  ::poll(p, wake_fd >= 0 ? 2 : 1, timeout_ms);
}

Endpoint UdpTransport::local() const {
  sockaddr_storage a{};
  socklen_t n = sizeof a;
  getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &n);
  return Endpoint::from_sockaddr(a);
}

}  // namespace hvd_sparse::omni

// UDP plumbing shared by the aggregator, the worker engine and the blaster.
#pragma once
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdint>
#include <vector>

namespace hvd_sparse::omni {

// Whole windows of datagrams arrive at once and a shallow buffer drops them. As root the FORCE
// options lift net.core.{r,w}mem_max; otherwise the plain ones are capped by it.
inline void deepen_buffers(int fd, int bytes = 64 << 20) {
  if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &bytes, sizeof bytes))
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
  if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &bytes, sizeof bytes))
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
}

// Up to `n` datagrams per system call (recvmmsg), with their senders.
class RecvBatch {
 public:
  explicit RecvBatch(int n = 64, size_t size = 65536)
      : buf_(n, std::vector<uint8_t>(size)), msgs_(n), iov_(n), from_(n) {}

  // What is queued now, without blocking: the number of datagrams received.
  int recv(int fd) {
    for (size_t i = 0; i < msgs_.size(); ++i) {
      iov_[i] = {buf_[i].data(), buf_[i].size()};
      msgs_[i].msg_hdr = {};
      msgs_[i].msg_hdr.msg_name = &from_[i];
      msgs_[i].msg_hdr.msg_namelen = sizeof(sockaddr_in);
      msgs_[i].msg_hdr.msg_iov = &iov_[i];
      msgs_[i].msg_hdr.msg_iovlen = 1;
    }
    int n = recvmmsg(fd, msgs_.data(), unsigned(msgs_.size()), MSG_DONTWAIT, nullptr);
    return n < 0 ? 0 : n;
  }
  const uint8_t* data(int i) const { return buf_[i].data(); }
  size_t size(int i) const { return msgs_[i].msg_len; }
  const sockaddr_in& from(int i) const { return from_[i]; }

 private:
  std::vector<std::vector<uint8_t>> buf_;
  std::vector<mmsghdr> msgs_;
  std::vector<iovec> iov_;
  std::vector<sockaddr_in> from_;
};

}  // namespace hvd_sparse::omni

// The transport interface: how the aggregator (and the worker engine) move datagrams, whatever
// carries them. One object is one queue, used by one thread; a transport with several queues
// (SO_REUSEPORT sockets, NIC queues) opens one object per queue. Implementations, one folder
// each with the same file names: udp/ (kernel sockets), dpdk/ (poll-mode driver, with its own
// Ethernet/IPv4/UDP). lossy.h wraps any of them with injected loss for tests.
#pragma once
#include <arpa/inet.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace hvd_sparse::omni {

// An IPv4 UDP endpoint. Both fields are in network byte order, as in sockaddr_in and on the
// wire, so transports copy them without conversion.
struct Endpoint {
  uint32_t ip = 0;
  uint16_t port = 0;
  bool operator==(const Endpoint& o) const { return ip == o.ip && port == o.port; }
  std::string str() const {
    char b[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &ip, b, sizeof b);
    return std::string(b) + ":" + std::to_string(ntohs(port));
  }
};

// One datagram: its UDP payload and the peer it came from or goes to.
struct Datagram {
  const uint8_t* data = nullptr;
  size_t len = 0;
  Endpoint peer;
};

// What a transport counted. rx_ignored: frames that were not UDP datagrams for us (ARP, other
// ports, IP fragments); rx_bad_checksum: UDP datagrams whose checksum failed (DPDK: the kernel
// drops those before a socket sees them); tx_dropped: datagrams the link or queue could not take
// (loss recovery resends them).
// clang-format off
#define HS_TRANSPORT_COUNTERS(X) X(rx_packets) X(rx_bytes) X(tx_packets) X(tx_bytes) \
  X(tx_dropped) X(rx_ignored) X(rx_bad_checksum) X(injected_drops) X(injected_dups)
// clang-format on
struct TransportCounters {
#define HS_DECL(n) uint64_t n = 0;
  HS_TRANSPORT_COUNTERS(HS_DECL)
#undef HS_DECL
  TransportCounters& operator+=(const TransportCounters& o) {
#define HS_ADD(n) n += o.n;
    HS_TRANSPORT_COUNTERS(HS_ADD)
#undef HS_ADD
    return *this;
  }
};

inline double monotonic_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class Transport {
 public:
  virtual ~Transport() = default;
  // Replaces `in` with the datagrams queued now (at most `max`), without blocking. They stay
  // valid until the next recv() on this object.
  virtual size_t recv(std::vector<Datagram>& in, size_t max) = 0;
  // Sends the datagrams (copied or queued before returning). What cannot go now is dropped
  // and counted: the protocol's timers resend it.
  virtual void send(const Datagram* out, size_t n) = 0;
  // Waits until datagrams may be queued, at most `timeout_ms`; a polling transport returns at
  // once. `wake_fd` (-1: none) also ends the wait when readable.
  virtual void wait(int timeout_ms, int wake_fd = -1) = 0;
  // Where peers reach this transport.
  virtual Endpoint local() const = 0;
  // Counters so far; safe to call from another thread (approximate while traffic flows).
  virtual TransportCounters counters() const = 0;
  // The clock the protocol's timers use.
  virtual double now() const { return monotonic_s(); }
};

// Relaxed atomic counters that one queue's thread bumps and another thread reads.
struct AtomicCounters {
#define HS_DECL(n) std::atomic<uint64_t> n{0};
  HS_TRANSPORT_COUNTERS(HS_DECL)
#undef HS_DECL
  TransportCounters load() const {
    TransportCounters c;
#define HS_LOAD(n) c.n = n.load(std::memory_order_relaxed);
    HS_TRANSPORT_COUNTERS(HS_LOAD)
#undef HS_LOAD
    return c;
  }
  static void add(std::atomic<uint64_t>& c, uint64_t v) {
    c.fetch_add(v, std::memory_order_relaxed);
  }
};

}  // namespace hvd_sparse::omni

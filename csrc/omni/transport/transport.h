// The transport interface: how the aggregator (and the worker engine) move datagrams, whatever
// carries them. One object is one queue, used by one thread; a transport with several queues
// (SO_REUSEPORT sockets, NIC queues) opens one object per queue. Implementations, one folder
// each with the same file names: udp/ (kernel sockets), dpdk/ (poll-mode driver, with its own
// Ethernet/IPv4/UDP). lossy.h wraps any of them with injected loss for tests.
#pragma once
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace hvd_sparse::omni {

// A UDP endpoint, IPv4 or IPv6. The address is 16 bytes in network order with an IPv4
// address stored v4-mapped (::ffff:a.b.c.d), as a dual-stack IPv6 socket reports a v4 peer:
// one peer compares equal whichever socket family saw it. The port is in network byte order,
// as in sockaddr_in and on the wire. Endpoint{} is "::" port 0 (unspecified, IPv6);
// Endpoint::v4(0, 0) is 0.0.0.0 port 0. Link-local addresses (fe80::/10) need a scope (an
// interface) that this does not carry: they are refused where an address is parsed.
struct Endpoint {
  std::array<uint8_t, 16> addr{};
  uint16_t port = 0;

  // From an IPv4 address and a port, both in network byte order.
  static Endpoint v4(uint32_t ip, uint16_t port) {
    Endpoint e;
    e.addr[10] = e.addr[11] = 0xff;
    std::memcpy(&e.addr[12], &ip, 4);
    e.port = port;
    return e;
  }
  static Endpoint v6(const in6_addr& a, uint16_t port) {
    Endpoint e;
    std::memcpy(e.addr.data(), &a, 16);
    e.port = port;
    return e;
  }
  bool is_v4() const {
    static constexpr uint8_t kMapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    return std::memcmp(addr.data(), kMapped, 12) == 0;
  }
  int family() const { return is_v4() ? AF_INET : AF_INET6; }
  // The IPv4 address in network byte order (0 when this is IPv6).
  uint32_t ip4() const {
    uint32_t ip = 0;
    if (is_v4()) std::memcpy(&ip, &addr[12], 4);
    return ip;
  }
  // 0.0.0.0 or :: (bind to every address).
  bool unspecified() const {
    return is_v4() ? ip4() == 0 : addr == std::array<uint8_t, 16>{};
  }
  bool operator==(const Endpoint& o) const { return addr == o.addr && port == o.port; }
  bool operator!=(const Endpoint& o) const { return !(*this == o); }
  // "10.0.0.1" or "fd00::1".
  std::string host() const {
    char b[INET6_ADDRSTRLEN] = "?";
    if (is_v4())
      inet_ntop(AF_INET, &addr[12], b, sizeof b);
    else
      inet_ntop(AF_INET6, addr.data(), b, sizeof b);
    return b;
  }
  // "10.0.0.1:9999" or "[fd00::1]:9999".
  std::string str() const {
    const std::string p = std::to_string(ntohs(port));
    return is_v4() ? host() + ":" + p : "[" + host() + "]:" + p;
  }
  // As a socket address of `family`: AF_INET (this must be IPv4) or AF_INET6 (an IPv4
  // address v4-mapped, for a dual-stack socket). Returns its length.
  socklen_t to_sockaddr(int fam, sockaddr_storage& out) const {
    out = {};
    if (fam == AF_INET) {
      auto* a = reinterpret_cast<sockaddr_in*>(&out);
      a->sin_family = AF_INET;
      a->sin_addr.s_addr = ip4();
      a->sin_port = port;
      return sizeof(sockaddr_in);
    }
    auto* a = reinterpret_cast<sockaddr_in6*>(&out);
    a->sin6_family = AF_INET6;
    std::memcpy(&a->sin6_addr, addr.data(), 16);
    a->sin6_port = port;
    return sizeof(sockaddr_in6);
  }
  static Endpoint from_sockaddr(const sockaddr_storage& s) {
    if (s.ss_family == AF_INET) {
      auto* a = reinterpret_cast<const sockaddr_in*>(&s);
      return v4(a->sin_addr.s_addr, a->sin_port);
    }
    auto* a = reinterpret_cast<const sockaddr_in6*>(&s);
    return v6(a->sin6_addr, a->sin6_port);
  }
};

// An IP literal: "10.0.0.1", "fd00::1" or "[fd00::1]" (port 0). False for anything else
// ("[10.0.0.1]" too),
// and for a link-local IPv6 address (fe80::/10: it needs a scope this cannot carry).
inline bool parse_ip(std::string host, Endpoint& out) {
  const bool brackets = host.size() > 2 && host.front() == '[' && host.back() == ']';
  if (brackets) host = host.substr(1, host.size() - 2);
  uint32_t ip4 = 0;
  in6_addr ip6{};
  if (host.find(':') == std::string::npos) {
    if (brackets) return false;  // brackets hold IPv6 addresses only
    if (inet_pton(AF_INET, host.c_str(), &ip4) != 1) return false;
    out = Endpoint::v4(ip4, 0);
    return true;
  }
  if (inet_pton(AF_INET6, host.c_str(), &ip6) != 1) return false;
  if (ip6.s6_addr[0] == 0xfe && (ip6.s6_addr[1] & 0xc0) == 0x80) return false;
  out = Endpoint::v6(ip6, 0);
  return true;
}

// "ADDR:PORT" with ADDR an IPv4 literal or a bracketed IPv6 one ("[fd00::1]:9999"), PORT
// in 0..65535. False, with `why` saying what is accepted, for anything else (a bare IPv6
// literal with a port is ambiguous: "fd00::1:9999").
inline bool parse_endpoint(const std::string& s, Endpoint& out, std::string* why = nullptr) {
  auto refuse = [&](const std::string& w) {
    if (why) *why = w + ": expected ADDR:PORT (10.0.0.1:9999, [fd00::1]:9999), got \"" + s + "\"";
    return false;
  };
  const auto colon = s.rfind(':');
  if (colon == std::string::npos) return refuse("no port");
  const std::string host = s.substr(0, colon), port = s.substr(colon + 1);
  if (port.empty() || port.size() > 5 ||
      port.find_first_not_of("0123456789") != std::string::npos || std::stoi(port) > 65535)
    return refuse("the port must be 0..65535");
  if (host.find(':') != std::string::npos && host.front() != '[')
    return refuse("an IPv6 address takes brackets before its port");
  if (!parse_ip(host, out))
    return refuse("not an IPv4 or IPv6 address (nor a link-local one: fe80::/10 needs a scope)");
  out.port = htons(uint16_t(std::stoi(port)));
  return true;
}

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

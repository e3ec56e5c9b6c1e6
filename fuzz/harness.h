// What the packet-decoder fuzz targets share (fuzz/*.cpp, docs/testing.md "Fuzzing"): the
// input read as a script of datagrams, the peers they come from, the authentication the
// harness adds so that the fuzzer gets past the MAC to the parser, and the check every
// datagram a component sends must pass.
//
// An input is one or two configuration bytes (each target says what they choose), then steps:
// {control byte, uint16 little-endian length, that many bytes: one datagram}. The control byte:
//   bits 0-2  the sender: 0-3 peer k (k modulo the peers there are), 4 peer 0's host from
//             another port, 5-7 strangers;
//   bits 3-5  how far the clock moves before the datagram (kAdvance: up to past the idle
//             expiry);
//   bit 6     seal: in an authenticated run the harness flags the datagram AUTH and gives it
//             a valid tag (the job's key, the sender id its header claims; the sequence number
//             of the trailer it carried, else the next one), so that the fuzzer reaches what
//             follows the MAC check; without it the bytes go as they are (the MAC check);
//   bit 7     tick: the component's timers (expire, tick) run after the datagram.
// Each datagram is copied into an allocation of its own size, so that AddressSanitizer
// catches a read past its end.
#pragma once
#include <arpa/inet.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "omni/auth.h"
#include "omni/protocol.h"
#include "omni/transport/transport.h"

namespace fuzz {

using namespace hvd_sparse;
using namespace hvd_sparse::omni;

constexpr uint64_t kToken = 0x5EED;
constexpr uint32_t kEpoch = 1;  // the job's membership: the worker engine's default
// The deployment secret of authenticated runs (aggregator), whence every job's key.
const std::string kSecret = "hvd-sparse fuzzing secret, not a real one";

struct Step {
  uint8_t ctl = 0;
  std::vector<uint8_t> bytes;
};

class Script {
 public:
  Script(const uint8_t* p, size_t n) : p_(p), end_(p + n) {}
  uint8_t config() { return p_ < end_ ? *p_++ : 0; }
  bool next(Step& s) {
    if (end_ - p_ < 3) return false;
    s.ctl = p_[0];
    size_t len = size_t(p_[1]) | size_t(p_[2]) << 8;
    p_ += 3;
    len = std::min<size_t>(len, size_t(end_ - p_));
    s.bytes.assign(p_, p_ + len);
    s.bytes.shrink_to_fit();
    p_ += len;
    return true;
  }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};

// Seconds the clock moves before a step: nothing, a packet's time, a round trip, a timer,
// past HELD_AFTER, past the switch's hold, past its abandon time, past the idle expiry.
constexpr double kAdvance[8] = {0, 1e-3, 0.05, 0.3, kHeldAfter + 0.1, 2.5, 11, 130};
inline double advance(uint8_t ctl) { return kAdvance[ctl >> 3 & 7]; }
inline bool sealed(uint8_t ctl) { return ctl & 0x40; }
inline bool ticks(uint8_t ctl) { return ctl & 0x80; }
// The control byte of a step (what the seed generator writes).
inline uint8_t control(unsigned from, bool seal = false, bool tick = false, unsigned adv = 0) {
  return uint8_t((from & 7) | (adv & 7) << 3 | (seal ? 0x40 : 0) | (tick ? 0x80 : 0));
}

// Peer k: 10.0.0.(k+1), port 5000 + k.
inline Endpoint peer(unsigned k) {
  return Endpoint::v4(htonl(0x0A000001u + k), htons(uint16_t(5000 + k)));
}
inline Endpoint sender(uint8_t ctl, unsigned npeers) {
  const unsigned k = ctl & 7;
  if (k < 4) return peer(k % npeers);
  if (k == 7) {  // IPv6 ::a00:1 (peer 0's 32 bits, not v4-mapped), peer 0's port: a stranger
    Endpoint e = peer(0);
    e.addr[10] = e.addr[11] = 0;
    return e;
  }
  Endpoint e = peer(k == 4 ? 0 : k);  // 4: peer 0's address with another port
  e.port = htons(uint16_t(6000 + k));
  return e;
}
inline int peer_index(const Endpoint& e, unsigned npeers) {
  for (unsigned k = 0; k < npeers; ++k)
    if (peer(k) == e) return int(k);
  return -1;
}

[[noreturn]] inline void die(const char* what, const uint8_t* p, size_t n) {
  std::fprintf(stderr, "fuzz: %s (%zu bytes:", what, n);
  for (size_t i = 0; i < std::min<size_t>(n, 96); ++i) std::fprintf(stderr, " %02x", p[i]);
  std::fprintf(stderr, ")\n");
  std::abort();
}

// One Mac per key: a key schedule per datagram would dominate the run time.
class Keys {
 public:
  explicit Keys(std::string secret) : secret_(std::move(secret)) {}
  // The job key of `token` under the secret (what an aggregator derives).
  Mac& job(uint64_t token) {
    auto it = macs_.find(token);
    if (it == macs_.end())
      it = macs_.emplace(token, std::make_unique<Mac>(derive_job_key(secret_, token))).first;
    return *it->second;
  }

 private:
  std::string secret_;
  std::map<uint64_t, std::unique_ptr<Mac>> macs_;
};

// Flags `b` AUTH and appends a valid tag (sender id `sender`). A datagram that carried a
// trailer keeps its sequence number (the fuzzer's to choose: replays, zero, one older than the
// window) and gets a tag in place of its own; one without gets the next of `seq`.
inline void seal(std::vector<uint8_t>& b, Mac& mac, uint32_t sender, uint64_t& seq) {
  if (b.size() < kHeaderBytes) return;
  uint64_t n_seq = seq + 1;
  if ((b[kFlagsOffset] & kFlagAuth) && b.size() >= kHeaderBytes + kAuthBytes) {
    n_seq = ld64(b.data() + b.size() - kAuthBytes);
    b.resize(b.size() - kAuthBytes);
  } else {
    ++seq;
  }
  b[kFlagsOffset] |= kFlagAuth;
  const size_t n = b.size();
  b.resize(n + kAuthBytes);
  mac.sign(b.data(), n, sender, n_seq);
  b.shrink_to_fit();
}

// What every datagram a component sends must be: structurally valid (what check_structure
// and lanes' bitmap checks accept: a receiver would not drop it as malformed), authenticated
// exactly when the job is, under `mac` with sender id `sender` when given.
inline void check_sent(const uint8_t* p, size_t n, bool authed, Mac* mac = nullptr,
                       uint32_t sender = 0) {
  if (n < kHeaderBytes) die("sent a datagram shorter than the header", p, n);
  const Header h = load_header(p);
  const bool flagged = h.flags & kFlagAuth;
  if (flagged != authed) die("sent a datagram authenticated where it must not be, or not", p, n);
  if (flagged && n < kHeaderBytes + kAuthBytes) die("sent a truncated trailer", p, n);
  const size_t len = flagged ? n - kAuthBytes : n;
  if (const char* why = check_structure(h, len)) {
    std::string w = std::string("sent a malformed datagram: ") + why;
    die(w.c_str(), p, n);
  }
  if (h.type == kData || h.type == kResult) {
    const uint64_t bitmap = ld64(p + kHeaderBytes);
    if ((h.lanes < 64 && bitmap >> h.lanes) || uint32_t(__builtin_popcountll(bitmap)) != h.present)
      die("sent a bitmap that disagrees with its header", p, n);
  }
  uint64_t seq = 0;
  if (flagged && mac && !mac->verify(p, n, sender, seq)) die("sent a bad tag", p, n);
}

}  // namespace fuzz

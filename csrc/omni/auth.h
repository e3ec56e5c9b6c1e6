// Packet authentication (docs/PROTOCOL.md "Authentication"): AES-128-GMAC over every byte of
// a packet but its tag, keyed per job, with a per-sender sequence number that receivers keep
// a window of, so that forged, corrupted and replayed packets are dropped before they touch
// any state. OpenSSL does the cryptography (AES-NI and carry-less multiply where the CPU has
// them); nothing here is thread-safe: each Mac belongs to one thread or one lock.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include <sys/types.h>

namespace hvd_sparse::omni {

constexpr size_t kKeyBytes = 16;  // AES-128

// The job's key: HMAC-SHA256(secret, "hvd-sparse job key v1" || token, big-endian), first
// 16 bytes. Aggregators derive it from the secret they were started with; workers are given
// it (hvd_sparse/session.py derives it the same way).
std::string derive_job_key(const std::string& secret, uint64_t token);

// The deployment's secret from a file: its bytes less trailing whitespace, at least 16 of them,
// in a regular file no one but its owner may read, or that its group may read where that group
// is private to this process (secret_group_refusal; docs/security.md, "Secrets").
// hvd_sparse/auth.py reads it the same way. Throws std::runtime_error saying what is wrong.
std::string read_secret_file(const std::string& path);

// Why group `gid` reading a secret file owned by `uid` is not safe for this process, or "":
// the owner is root or this process's effective user, `gid` is its effective or a
// supplementary group, and the user and group databases name no other user in it.
std::string secret_group_refusal(uid_t uid, gid_t gid);

// GMAC with a 96-bit nonce (sender id, sequence number): unique as long as each sender id is
// used by one sender per key and its sequence numbers never repeat (a sender draws them from
// one counter).
class Mac {
 public:
  explicit Mac(const std::string& key);  // kKeyBytes bytes; throws std::invalid_argument
  ~Mac();
  Mac(const Mac&) = delete;
  Mac& operator=(const Mac&) = delete;

  // Appends the trailer (sequence number, tag) to the `len` bytes at p, which must have
  // kAuthBytes more room.
  void sign(uint8_t* p, size_t len, uint32_t sender, uint64_t seq);
  // Whether the `len` bytes at p (the trailer included) carry a valid tag from `sender`;
  // `seq` gets its sequence number.
  bool verify(const uint8_t* p, size_t len, uint32_t sender, uint64_t& seq);

 private:
  void tag(const uint8_t* p, size_t len, uint32_t sender, uint64_t seq, uint8_t* out);
  struct Ctx;
  std::unique_ptr<Ctx> ctx_;
};

// Where a sender's sequence numbers start: the wall clock in nanoseconds, so that a restarted
// aggregator (same job, same key, same sender id) continues above what its previous life
// signed, which its workers' windows would take for replays otherwise.
uint64_t first_sequence_number();

// Sequence numbers seen from one sender: the highest and the 1024 below it. A number seen
// before, or older than the window, is a replay.
class ReplayWindow {
 public:
  bool accept(uint64_t seq);

 private:
  static constexpr uint64_t kBits = 1024;
  uint64_t top_ = 0;
  uint64_t seen_[kBits / 64] = {};
};

// X25519 key agreement (RFC 7748), so that ranks can agree on the job's key over a channel a
// sniffer reads (hvd_sparse/session.py). Keys are 32 raw bytes.
void x25519_keypair(std::string& priv, std::string& pub);
std::string x25519(const std::string& priv, const std::string& peer_pub);

}  // namespace hvd_sparse::omni

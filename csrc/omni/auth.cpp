// Packet authentication: see auth.h.
#include "auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <ctime>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "protocol.h"

namespace hvd_sparse::omni {

std::string derive_job_key(const std::string& secret, uint64_t token) {
  static const char kLabel[] = "hvd-sparse job key v1";
  uint8_t msg[sizeof kLabel - 1 + 8];
  std::memcpy(msg, kLabel, sizeof kLabel - 1);
  st64(msg + sizeof kLabel - 1, token);
  uint8_t out[32];
  unsigned n = 0;
  if (!HMAC(EVP_sha256(), secret.data(), int(secret.size()), msg, sizeof msg, out, &n))
    throw std::runtime_error("HMAC-SHA256 failed");
  return std::string(reinterpret_cast<char*>(out), kKeyBytes);
}

namespace {

// The name of user `uid` in the user database, or "" where it has none.
std::string user_name(uid_t uid) {
  std::vector<char> buf(16384);
  struct passwd pw {};
  struct passwd* found = nullptr;
  if (getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) != 0 || !found) return "";
  return pw.pw_name;
}

}  // namespace

// Python's auth.group_refusal, word for word: why group `gid` reading a secret file owned by
// `uid` is unsafe for this process, or "" when that group is private to it.
std::string secret_group_refusal(uid_t uid, gid_t gid) {
  const uid_t me = geteuid();
  if (uid != 0 && uid != me)
    return "and owned by uid " + std::to_string(uid) + ", neither this process's user nor root";
  bool in_group = gid == getegid();
  const int n = getgroups(0, nullptr);
  std::vector<gid_t> groups(size_t(n > 0 ? n : 0));
  if (n > 0 && getgroups(n, groups.data()) == n)
    for (gid_t g : groups) in_group = in_group || g == gid;
  if (!in_group) return "which this process is not in";
  const std::string mine = user_name(me);
  std::string others;
  std::vector<char> buf(1 << 16);
  struct group gr {};
  struct group* found = nullptr;
  if (getgrgid_r(gid, &gr, buf.data(), buf.size(), &found) == 0 && found)
    for (char** m = gr.gr_mem; *m; ++m)
      if (mine.empty() || mine != *m) others += (others.empty() ? "" : ", ") + std::string(*m);
  if (!others.empty()) return "which has other members (" + others + ")";
  // getpwent: the same enumeration Python's pwd.getpwall() makes; sorted, without repeats,
  // as Python's set is
  std::vector<std::string> primary;
  setpwent();
  while (struct passwd* p = getpwent())
    if (p->pw_gid == gid && p->pw_uid != me) primary.emplace_back(p->pw_name);
  endpwent();
  std::sort(primary.begin(), primary.end());
  primary.erase(std::unique(primary.begin(), primary.end()), primary.end());
  if (primary.empty()) return "";
  std::string names;
  for (const auto& u : primary) names += (names.empty() ? "" : ", ") + u;
  return "the primary group of other users (" + names + ")";
}

std::string read_secret_file(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("secret file " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    throw std::runtime_error("secret file " + path + ": " + std::strerror(err));
  }
  // The same checks, in the same order, with the same words as Python's read_secret_file.
  std::string refusal;
  if (!S_ISREG(st.st_mode)) refusal = "not a file";
  else if (st.st_mode & 037) refusal = "readable by others (chmod 600 it)";
  else if (st.st_mode & 040) {
    const std::string why = secret_group_refusal(st.st_uid, st.st_gid);
    if (!why.empty())
      refusal = "readable by its group " + std::to_string(st.st_gid) + ", " + why +
                " (chmod 600 it, or see docs/security.md)";
  }
  std::string s;
  char buf[4096];
  ssize_t n = 0;
  if (refusal.empty())
    while ((n = read(fd, buf, sizeof buf)) > 0 && s.size() < (1 << 20)) s.append(buf, size_t(n));
  close(fd);
  if (!refusal.empty()) throw std::runtime_error("secret file " + path + ": " + refusal);
  while (!s.empty() && std::strchr(" \t\r\n", s.back())) s.pop_back();
  if (s.size() < 16)
    throw std::runtime_error("secret file " + path + ": fewer than 16 bytes of secret");
  return s;
}

struct Mac::Ctx {
  EVP_CIPHER_CTX* c = EVP_CIPHER_CTX_new();
  ~Ctx() { EVP_CIPHER_CTX_free(c); }
};

Mac::Mac(const std::string& key) : ctx_(std::make_unique<Ctx>()) {
  if (key.size() != kKeyBytes)
    throw std::invalid_argument("authentication key must be " + std::to_string(kKeyBytes) +
                                " bytes, got " + std::to_string(key.size()));
  // The key schedule is computed once; each packet only sets its nonce.
  if (!ctx_->c || EVP_EncryptInit_ex(ctx_->c, EVP_aes_128_gcm(), nullptr,
                                     reinterpret_cast<const uint8_t*>(key.data()), nullptr) != 1)
    throw std::runtime_error("AES-128-GCM is not available from OpenSSL");
}

Mac::~Mac() = default;

void Mac::tag(const uint8_t* p, size_t len, uint32_t sender, uint64_t seq, uint8_t* out) {
  uint8_t iv[12];
  st32(iv, sender);
  st64(iv + 4, seq);
  int n = 0;
  uint8_t none[16];
  // GMAC: GCM with the whole packet as additional data and nothing to encrypt.
  if (EVP_EncryptInit_ex(ctx_->c, nullptr, nullptr, nullptr, iv) != 1 ||
      EVP_EncryptUpdate(ctx_->c, nullptr, &n, p, int(len)) != 1 ||
      EVP_EncryptFinal_ex(ctx_->c, none, &n) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx_->c, EVP_CTRL_GCM_GET_TAG, int(kTagBytes), out) != 1)
    throw std::runtime_error("GMAC failed");
}

void Mac::sign(uint8_t* p, size_t len, uint32_t sender, uint64_t seq) {
  st64(p + len, seq);
  tag(p, len + 8, sender, seq, p + len + 8);
}

bool Mac::verify(const uint8_t* p, size_t len, uint32_t sender, uint64_t& seq) {
  if (len < kAuthBytes) return false;
  const size_t body = len - kTagBytes;
  seq = ld64(p + body - 8);
  uint8_t want[kTagBytes];
  tag(p, body, sender, seq, want);
  return CRYPTO_memcmp(want, p + body, kTagBytes) == 0;
}

uint64_t first_sequence_number() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return uint64_t(ts.tv_sec) * 1000000000u + uint64_t(ts.tv_nsec);
}

bool ReplayWindow::accept(uint64_t seq) {
  if (seq == 0) return false;  // senders start at 1
  if (seq > top_) {
    const uint64_t shift = seq - top_;
    if (shift >= kBits) std::memset(seen_, 0, sizeof seen_);
    else
      for (uint64_t s = top_ + 1; s < seq; ++s) seen_[s % kBits / 64] &= ~(uint64_t(1) << s % 64);
    top_ = seq;
  } else if (top_ - seq >= kBits) {
    return false;
  } else if (seen_[seq % kBits / 64] >> (seq % 64) & 1) {
    return false;
  }
  seen_[seq % kBits / 64] |= uint64_t(1) << seq % 64;
  return true;
}

namespace {
struct PKey {
  EVP_PKEY* k;
  ~PKey() { EVP_PKEY_free(k); }
};
struct PCtx {
  EVP_PKEY_CTX* c;
  ~PCtx() { EVP_PKEY_CTX_free(c); }
};
}  // namespace

void x25519_keypair(std::string& priv, std::string& pub) {
  PKey k{EVP_PKEY_Q_keygen(nullptr, nullptr, "X25519")};
  size_t n = 32, m = 32;
  priv.resize(32);
  pub.resize(32);
  if (!k.k ||
      EVP_PKEY_get_raw_private_key(k.k, reinterpret_cast<uint8_t*>(priv.data()), &n) != 1 ||
      EVP_PKEY_get_raw_public_key(k.k, reinterpret_cast<uint8_t*>(pub.data()), &m) != 1)
    throw std::runtime_error("X25519 key generation failed");
}

std::string x25519(const std::string& priv, const std::string& peer_pub) {
  if (priv.size() != 32 || peer_pub.size() != 32)
    throw std::invalid_argument("X25519 keys are 32 bytes");
  PKey mine{EVP_PKEY_new_raw_private_key(EVP_PKEY_X25519, nullptr,
                                         reinterpret_cast<const uint8_t*>(priv.data()), 32)};
  PKey peer{EVP_PKEY_new_raw_public_key(EVP_PKEY_X25519, nullptr,
                                        reinterpret_cast<const uint8_t*>(peer_pub.data()), 32)};
  PCtx ctx{mine.k ? EVP_PKEY_CTX_new(mine.k, nullptr) : nullptr};
  std::string out(32, '\0');
  size_t n = 32;
  // Derivation fails on a low-order peer key (an all-zero shared secret): refused.
  if (!peer.k || !ctx.c || EVP_PKEY_derive_init(ctx.c) != 1 ||
      EVP_PKEY_derive_set_peer(ctx.c, peer.k) != 1 ||
      EVP_PKEY_derive(ctx.c, reinterpret_cast<uint8_t*>(out.data()), &n) != 1 || n != 32)
    throw std::invalid_argument("X25519: bad peer key");
  return out;
}

}  // namespace hvd_sparse::omni

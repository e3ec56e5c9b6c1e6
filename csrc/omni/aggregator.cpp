// hvd-sparse aggregator: sums the non-zero blocks that workers stream to it over UDP and returns
// each round's sum to every worker (docs/PROTOCOL.md). A plain process without torch:
//
//   hvd-sparse-aggregator --bind 0.0.0.0:9999 --workers 4 [--threads 1] [--stats 10]
//
// Every packet is validated before it touches state; a bad one is dropped and counted. Per slot
// the aggregator keeps the round in progress and the previous round's result (the shadow set),
// so a retransmitted packet of either round is idempotent: a duplicate of the current round is
// ignored, one of the previous round gets the stored result back.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "halfconv.h"
#include "protocol.h"
#include "udp.h"

namespace hvd_sparse::omni {
namespace {

using Clock = std::chrono::steady_clock;
double now_s() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

struct Options {
  std::string host = "127.0.0.1";
  int port = 0;
  int workers = 0;  // 0: any job size
  int threads = 1;
  double drop_in = 0, drop_out = 0, dup = 0, reorder = 0;
  double stats_every = 0;
  double idle = 120;  // seconds after which an idle tensor or job is forgotten
  int parent = 0;
  std::string port_file;
  uint64_t seed = 1;
  size_t max_slot_bytes = size_t(2) << 30;  // accumulator memory cap
};

// Counters, printed as one JSON line.
#define HS_COUNTERS(X) X(rx_packets) X(rx_bytes) X(tx_packets) X(tx_bytes) X(rounds) \
  X(retransmits) X(duplicates) X(stale) X(malformed) X(unknown_job) X(mismatch)     \
  X(injected_drops) X(injected_dups) X(jobs) X(tensors) X(released) X(expired)
struct Counters {
#define HS_DECL(n) std::atomic<uint64_t> n{0};
  HS_COUNTERS(HS_DECL)
#undef HS_DECL
  std::string json() const {
    std::string s = "{";
#define HS_JSON(n) s += std::string(s.size() > 1 ? ", " : "") + "\"" #n "\": " + std::to_string(n.load());
    HS_COUNTERS(HS_JSON)
#undef HS_JSON
    return s + "}";
  }
};

struct Slot {
  uint32_t round = 0;
  std::vector<uint32_t> cur, next;  // per lane: position of this round, min announced next
  std::vector<double> acc;          // lanes * block_size running sums
  uint64_t present = 0;             // lanes some worker contributed to this round
  std::vector<uint64_t> seen;       // worker bitmap of this round
  uint32_t count = 0;
  bool done = false;
  std::shared_ptr<std::vector<uint8_t>> last;  // previous round's RESULT (the shadow set)
};

struct Tensor {
  Header params;  // dtype, lanes, block_size, nblocks, nslots, meta of the first packet
  std::unordered_map<uint32_t, Slot> slots;
  std::vector<uint64_t> released;
  uint32_t nreleased = 0;
  uint32_t error = 0;
  double touched = 0;
};

struct Job {
  uint16_t nworkers = 0;
  std::vector<sockaddr_in> addr;
  std::vector<uint8_t> bye;
  uint32_t nbye = 0;
  std::unordered_map<uint64_t, Tensor> tensors;
  double touched = 0;
};

struct Out {
  sockaddr_in to;
  std::shared_ptr<std::vector<uint8_t>> bytes;
};

// float64 -> float32 rounded to odd (truncated, lowest bit set when inexact): rounding that to
// float16 or bfloat16 (at least 2 bits narrower than float32) then rounds the float64 sum
// exactly once, as the spec says; rounding to nearest twice can land one ulp off (e.g.
// 1 + 2^-11 + 2^-24 would become 1.0 in float16 instead of 1 + 2^-10).
float to_float_odd(double d) {
  float f = float(d);
  if (std::isfinite(f) && double(f) != d) {
    uint32_t u = float_to_bits(f);
    if (std::fabs(double(f)) > std::fabs(d)) --u;  // toward zero (sign-magnitude)
    f = bits_to_float(u | 1);
  }
  return f;
}

bool test_bit(const std::vector<uint64_t>& v, uint32_t i) { return v[i >> 6] >> (i & 63) & 1; }
void set_bit(std::vector<uint64_t>& v, uint32_t i) { v[i >> 6] |= uint64_t(1) << (i & 63); }

class Aggregator {
 public:
  explicit Aggregator(const Options& o) : o_(o) {}
  Counters c;

  // Handles one datagram; appends what must be sent to `out`. Caller holds no lock.
  void handle(const uint8_t* p, size_t len, const sockaddr_in& from, std::vector<Out>& out) {
    c.rx_packets++;
    c.rx_bytes += len;
    if (len < kHeaderBytes) { c.malformed++; return; }
    Header h = load_header(p);
    if (check_structure(h, len)) { c.malformed++; return; }
    std::lock_guard<std::mutex> lock(mu_);
    if (h.type == kRegister) return on_register(h, from, out);
    auto jt = jobs_.find(h.token);
    if (jt == jobs_.end()) { c.unknown_job++; return; }
    Job& job = jt->second;
    if (h.nworkers != job.nworkers) { c.malformed++; return; }
    // A worker's address and the job's liveness change only with packets found valid: junk
    // carrying the token must not redirect a worker's results (see accept()).
    switch (h.type) {
      case kData: return on_data(job, h, p, from, out);
      case kRelease: job.touched = now_s(); return on_release(job, h);
      case kBye:
        job.touched = now_s();
        if (!job.bye[h.worker]) { job.bye[h.worker] = 1; ++job.nbye; }
        if (job.nbye == job.nworkers) { c.released += job.tensors.size(); jobs_.erase(jt); }
        return;
      default: c.malformed++; return;  // aggregator-bound types only
    }
  }

  // Forgets tensors and jobs idle for longer than --idle (workers died or lost RELEASE/BYE).
  void expire() {
    std::lock_guard<std::mutex> lock(mu_);
    double t = now_s();
    for (auto j = jobs_.begin(); j != jobs_.end();) {
      for (auto it = j->second.tensors.begin(); it != j->second.tensors.end();) {
        if (t - it->second.touched > o_.idle) { it = drop_tensor(j->second, it); c.expired++; }
        else ++it;
      }
      if (t - j->second.touched > o_.idle && j->second.tensors.empty()) j = jobs_.erase(j);
      else ++j;
    }
  }

  size_t active_jobs() {
    std::lock_guard<std::mutex> lock(mu_);
    return jobs_.size();
  }

 private:
  void on_register(const Header& h, const sockaddr_in& from, std::vector<Out>& out) {
    auto it = jobs_.find(h.token);
    uint32_t err = 0;
    if (o_.workers && h.nworkers != o_.workers) err = kErrJob;
    else if (it != jobs_.end() && it->second.nworkers != h.nworkers) err = kErrJob;
    else if (it == jobs_.end() && jobs_.size() >= 256) err = kErrCapacity;
    if (!err && it == jobs_.end()) {
      Job j;
      j.nworkers = h.nworkers;
      j.addr.resize(h.nworkers);
      j.bye.assign(h.nworkers, 0);
      it = jobs_.emplace(h.token, std::move(j)).first;
      c.jobs++;
    }
    if (!err) {
      it->second.addr[h.worker] = from;
      it->second.touched = now_s();
    }
    Header r = make_header(err ? kError : kRegAck, h.token, h.worker, h.nworkers);
    r.round = err;
    auto b = std::make_shared<std::vector<uint8_t>>(kHeaderBytes);
    store_header(b->data(), r);
    out.push_back({from, b});
  }

  void on_release(Job& job, const Header& h) {
    auto it = job.tensors.find(h.tensor);
    if (it == job.tensors.end()) return;
    Tensor& t = it->second;
    if (test_bit(t.released, h.worker)) return;
    set_bit(t.released, h.worker);
    if (++t.nreleased == job.nworkers) { drop_tensor(job, it); c.released++; }
  }

  std::unordered_map<uint64_t, Tensor>::iterator drop_tensor(
      Job& job, std::unordered_map<uint64_t, Tensor>::iterator it) {
    for (auto& [g, s] : it->second.slots) slot_bytes_ -= s.acc.size() * sizeof(double);
    return job.tensors.erase(it);
  }

  void send_error(Job& job, const Header& h, uint32_t code, std::vector<Out>& out) {
    Header e = make_header(kError, h.token, 0, job.nworkers);
    e.tensor = h.tensor; e.slot = h.slot; e.round = code;
    auto b = std::make_shared<std::vector<uint8_t>>(kHeaderBytes);
    store_header(b->data(), e);
    for (uint16_t w = 0; w < job.nworkers; ++w)
      if (job.addr[w].sin_port) out.push_back({job.addr[w], b});
  }

  // The bitmap and lane table of a DATA against the lanes' positions `cur` (nullptr: round 0
  // of the packet's own layout, every non-empty lane at position 0).
  static bool lanes_valid(const Header& h, const uint8_t* p, const uint32_t* cur) {
    const uint64_t bitmap = ld64(p + kHeaderBytes);
    if (h.lanes < 64 && (bitmap >> h.lanes)) return false;
    if (uint32_t(__builtin_popcountll(bitmap)) != h.present) return false;
    const uint8_t* lane = p + kHeaderBytes + kBitmapBytes;
    for (uint32_t l = 0; l < h.lanes; ++l) {
      uint32_t off = ld32(lane + l * kLaneBytes), nxt = ld32(lane + l * kLaneBytes + 4);
      uint32_t len = stream_length(h.slot, l, h.nblocks, h.nslots, h.lanes);
      uint32_t want = cur ? cur[l] : len ? 0 : kInf;
      if (off != want || (off == kInf && ((bitmap >> l & 1) || nxt != kInf)) ||
          (nxt != kInf && (nxt <= off || nxt >= len)))
        return false;
    }
    return true;
  }

  // A valid DATA from `from`: the worker lives there, the job and tensor are alive.
  static void accept(Job& job, Tensor& t, const Header& h, const sockaddr_in& from) {
    job.touched = t.touched = now_s();
    job.addr[h.worker] = from;
  }

  void on_data(Job& job, const Header& h, const uint8_t* p, const sockaddr_in& from,
               std::vector<Out>& out) {
    if (((h.flags & kFlagShadow) != 0) != ((h.round & 1) != 0)) { c.malformed++; return; }
    auto it = job.tensors.find(h.tensor);
    if (it != job.tensors.end()) {
      Tensor& t = it->second;
      const Header& q = t.params;
      if (!t.error && (h.dtype != q.dtype || h.lanes != q.lanes || h.block_size != q.block_size ||
                       h.nblocks != q.nblocks || h.nslots != q.nslots || h.meta != q.meta)) {
        // Ranks that disagree on a tensor send well-formed first rounds of their own layouts;
        // anything else is junk and must not kill the tensor.
        if (h.round != 0 || !lanes_valid(h, p, nullptr)) { c.malformed++; return; }
        t.error = kErrMismatch;
        c.mismatch++;
      }
      if (t.error) return send_error(job, h, t.error, out);
    }
    Slot* sp = nullptr;
    if (it != job.tensors.end()) {
      auto st = it->second.slots.find(h.slot);
      if (st != it->second.slots.end()) sp = &st->second;
    }
    if (!sp) {
      // A tensor and each of its slots start at round 0 (else: expired, or junk); nothing is
      // created for a packet that is not a valid first round.
      if (h.round != 0) { c.stale++; return; }
      if (!lanes_valid(h, p, nullptr)) { c.malformed++; return; }
      if (it == job.tensors.end()) {
        Tensor t;
        t.params = h;
        t.released.assign((job.nworkers + 63) / 64, 0);
        it = job.tensors.emplace(h.tensor, std::move(t)).first;
        c.tensors++;
      }
      Tensor& t = it->second;
      size_t bytes = size_t(h.lanes) * h.block_size * sizeof(double);
      if (slot_bytes_ + bytes > o_.max_slot_bytes) {
        t.error = kErrCapacity;
        return send_error(job, h, t.error, out);
      }
      Slot s;
      s.cur.resize(h.lanes);
      for (uint32_t l = 0; l < h.lanes; ++l)
        s.cur[l] = stream_length(h.slot, l, h.nblocks, h.nslots, h.lanes) ? 0 : kInf;
      s.next.assign(h.lanes, kInf);
      s.acc.assign(size_t(h.lanes) * h.block_size, 0.0);
      s.seen.assign((job.nworkers + 63) / 64, 0);
      slot_bytes_ += bytes;
      sp = &t.slots.emplace(h.slot, std::move(s)).first->second;
    }
    Tensor& t = it->second;
    Slot& s = *sp;
    if (s.last && h.round + 1 == s.round) {  // the sender lost our previous RESULT
      // Its lane table must be the one of that round (the stored RESULT's offsets).
      uint32_t prev[kMaxLanes];
      const uint8_t* lt = s.last->data() + kHeaderBytes + kBitmapBytes;
      for (uint32_t l = 0; l < h.lanes; ++l) prev[l] = ld32(lt + l * kLaneBytes);
      if (!lanes_valid(h, p, prev)) { c.malformed++; return; }
      c.retransmits++;
      accept(job, t, h, from);
      out.push_back({from, s.last});
      return;
    }
    if (s.done || h.round != s.round) { c.stale++; return; }
    if (test_bit(s.seen, h.worker)) {  // a retransmission: the worker waits for a slow peer
      c.duplicates++;
      job.touched = t.touched = now_s();
      return;
    }
    // Validate the lane table against this round before changing anything.
    if (!lanes_valid(h, p, s.cur.data())) { c.malformed++; return; }
    accept(job, t, h, from);

    const uint8_t* lane = p + kHeaderBytes + kBitmapBytes;
    const uint64_t bitmap = ld64(p + kHeaderBytes);
    // Accumulate in double: the order packets arrive in then barely matters, and every worker
    // receives the same rounded result anyway.
    const uint8_t* v = lane + size_t(h.lanes) * kLaneBytes;
    const size_t bs = h.block_size;
    for (uint32_t l = 0; l < h.lanes; ++l) {
      uint32_t nxt = ld32(lane + l * kLaneBytes + 4);
      if (nxt < s.next[l]) s.next[l] = nxt;
      if (!(bitmap >> l & 1)) continue;
      double* a = s.acc.data() + l * bs;
      add_block(a, v, bs, h.dtype);
      v += bs * dtype_size(h.dtype);
    }
    s.present |= bitmap;
    set_bit(s.seen, h.worker);
    if (++s.count < job.nworkers) return;
    complete(job, h, s, out);
  }

  static void add_block(double* a, const uint8_t* v, size_t bs, uint8_t dtype) {
    switch (dtype) {
      case kF32: { float x; for (size_t i = 0; i < bs; ++i) { std::memcpy(&x, v + 4 * i, 4); a[i] += x; } break; }
      case kF64: { double x; for (size_t i = 0; i < bs; ++i) { std::memcpy(&x, v + 8 * i, 8); a[i] += x; } break; }
      case kF16: { uint16_t x; for (size_t i = 0; i < bs; ++i) { std::memcpy(&x, v + 2 * i, 2); a[i] += f16_to_float(x); } break; }
      default: { uint16_t x; for (size_t i = 0; i < bs; ++i) { std::memcpy(&x, v + 2 * i, 2); a[i] += bf16_to_float(x); } break; }
    }
  }

  static void store_block(uint8_t* v, const double* a, size_t bs, uint8_t dtype) {
    switch (dtype) {
      case kF32: for (size_t i = 0; i < bs; ++i) { float x = float(a[i]); std::memcpy(v + 4 * i, &x, 4); } break;
      case kF64: std::memcpy(v, a, bs * 8); break;
      case kF16: for (size_t i = 0; i < bs; ++i) { uint16_t x = float_to_f16(to_float_odd(a[i])); std::memcpy(v + 2 * i, &x, 2); } break;
      default: for (size_t i = 0; i < bs; ++i) { uint16_t x = float_to_bf16(to_float_odd(a[i])); std::memcpy(v + 2 * i, &x, 2); } break;
    }
  }

  // Every worker has sent this round: build the RESULT, keep it as the shadow copy, send it to
  // all workers, and open the next round at the lanes' minimum announced positions.
  void complete(Job& job, const Header& h, Slot& s, std::vector<Out>& out) {
    const uint32_t present = uint32_t(__builtin_popcountll(s.present));
    bool last = true;
    for (uint32_t n : s.next) last = last && n == kInf;
    Header r = make_header(kResult, h.token, 0, job.nworkers);
    r.dtype = h.dtype; r.slot = h.slot; r.tensor = h.tensor; r.round = s.round;
    r.flags = uint8_t((s.round & 1 ? kFlagShadow : 0) | (last ? kFlagLast : 0));
    r.lanes = h.lanes; r.block_size = h.block_size; r.nblocks = h.nblocks; r.nslots = h.nslots;
    r.meta = h.meta; r.present = present;
    auto b = std::make_shared<std::vector<uint8_t>>(
        data_bytes(h.lanes, present, h.block_size, h.dtype));
    uint8_t* p = b->data();
    store_header(p, r);
    st64(p + kHeaderBytes, s.present);
    uint8_t* lane = p + kHeaderBytes + kBitmapBytes;
    uint8_t* v = lane + size_t(h.lanes) * kLaneBytes;
    const size_t bs = h.block_size, vb = bs * dtype_size(h.dtype);
    for (uint32_t l = 0; l < h.lanes; ++l) {
      st32(lane + l * kLaneBytes, s.cur[l]);
      st32(lane + l * kLaneBytes + 4, s.next[l]);
      if (!(s.present >> l & 1)) continue;
      double* a = s.acc.data() + l * bs;
      store_block(v, a, bs, h.dtype);
      std::fill(a, a + bs, 0.0);
      v += vb;
    }
    c.rounds++;
    s.last = b;
    s.cur.swap(s.next);
    std::fill(s.next.begin(), s.next.end(), kInf);
    std::fill(s.seen.begin(), s.seen.end(), 0);
    s.present = 0;
    s.count = 0;
    s.round++;
    if (last) {
      s.done = true;
      slot_bytes_ -= s.acc.size() * sizeof(double);
      std::vector<double>().swap(s.acc);
    }
    for (uint16_t w = 0; w < job.nworkers; ++w) out.push_back({job.addr[w], b});
  }

  const Options& o_;
  std::mutex mu_;
  std::unordered_map<uint64_t, Job> jobs_;
  size_t slot_bytes_ = 0;
};

std::atomic<bool> g_stop{false}, g_dump{false};
void on_signal(int sig) { (sig == SIGUSR1 ? g_dump : g_stop).store(true); }

int open_socket(const Options& o, int port) {
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  if (fd < 0) { perror("socket"); std::exit(2); }
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);  // --threads sockets, one port
  deepen_buffers(fd);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  if (inet_pton(AF_INET, o.host.c_str(), &a.sin_addr) != 1) {
    std::fprintf(stderr, "hvd-sparse aggregator: bad bind address %s\n", o.host.c_str());
    std::exit(2);
  }
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a)) {
    std::fprintf(stderr, "hvd-sparse aggregator: cannot bind %s:%d: %s\n", o.host.c_str(), port,
                 std::strerror(errno));
    std::exit(2);
  }
  return fd;
}

int bound_port(int fd) {
  sockaddr_in a{};
  socklen_t n = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  return ntohs(a.sin_port);
}

void serve(Aggregator& agg, const Options& o, int fd, uint64_t seed) {
  RecvBatch batch;
  std::vector<int> order(64);
  std::vector<Out> out;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  pollfd pfd{fd, POLLIN, 0};
  while (!g_stop.load()) {
    if (poll(&pfd, 1, 100) <= 0) continue;
    int n = batch.recv(fd);
    if (n == 0) continue;
    for (int i = 0; i < n; ++i) order[i] = i;
    if (o.reorder > 0)  // test hook: deliver the batch out of order
      for (int i = 0; i < n; ++i)
        if (u(rng) < o.reorder) std::swap(order[i], order[rng() % n]);
    out.clear();
    for (int k = 0; k < n; ++k) {
      int i = order[k];
      if (o.drop_in > 0 && u(rng) < o.drop_in) { agg.c.injected_drops++; continue; }
      int copies = o.dup > 0 && u(rng) < o.dup ? 2 : 1;
      if (copies == 2) agg.c.injected_dups++;
      for (int r = 0; r < copies; ++r) agg.handle(batch.data(i), batch.size(i), batch.from(i), out);
    }
    // Send in batches; a full socket buffer drops the datagram, which loss recovery repairs.
    std::vector<mmsghdr> smsgs;
    std::vector<iovec> siov(out.size());
    smsgs.reserve(out.size());
    for (size_t i = 0; i < out.size(); ++i) {
      if (o.drop_out > 0 && u(rng) < o.drop_out) { agg.c.injected_drops++; continue; }
      siov[i] = {out[i].bytes->data(), out[i].bytes->size()};
      mmsghdr m{};
      m.msg_hdr.msg_name = &out[i].to;
      m.msg_hdr.msg_namelen = sizeof(sockaddr_in);
      m.msg_hdr.msg_iov = &siov[i];
      m.msg_hdr.msg_iovlen = 1;
      smsgs.push_back(m);
      agg.c.tx_packets++;
      agg.c.tx_bytes += out[i].bytes->size();
    }
    for (size_t done = 0; done < smsgs.size();) {
      int s = sendmmsg(fd, smsgs.data() + done, unsigned(smsgs.size() - done), 0);
      if (s <= 0) {
        if (errno == EINTR) continue;
        break;  // e.g. ENOBUFS: the receivers' timers retransmit
      }
      done += size_t(s);
    }
  }
}

void usage() {
  std::fprintf(stderr,
      "usage: hvd-sparse-aggregator --bind ADDR:PORT [--workers N] [--threads T]\n"
      "         [--stats SECONDS] [--idle SECONDS] [--parent-pid PID] [--port-file PATH]\n"
      "         [--drop-rate P] [--drop-rate-out P] [--dup-rate P] [--reorder-rate P] [--seed S]\n"
      "Sums the non-zero blocks hvd-sparse workers stream to it (docs/PROTOCOL.md).\n"
      "Counters print every --stats seconds, on SIGUSR1 and at exit.\n");
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) { usage(); std::exit(2); }
      return argv[++i];
    };
    if (a == "--bind") {
      std::string v = val();
      auto colon = v.rfind(':');
      if (colon == std::string::npos) { usage(); std::exit(2); }
      o.host = v.substr(0, colon);
      o.port = std::atoi(v.c_str() + colon + 1);
    } else if (a == "--workers") o.workers = std::atoi(val().c_str());
    else if (a == "--threads") o.threads = std::max(1, std::atoi(val().c_str()));
    else if (a == "--stats") o.stats_every = std::atof(val().c_str());
    else if (a == "--idle") o.idle = std::atof(val().c_str());
    else if (a == "--parent-pid") o.parent = std::atoi(val().c_str());
    else if (a == "--port-file") o.port_file = val();
    else if (a == "--drop-rate") o.drop_in = std::atof(val().c_str());
    else if (a == "--drop-rate-out") o.drop_out = std::atof(val().c_str());
    else if (a == "--dup-rate") o.dup = std::atof(val().c_str());
    else if (a == "--reorder-rate") o.reorder = std::atof(val().c_str());
    else if (a == "--seed") o.seed = std::strtoull(val().c_str(), nullptr, 10);
    else if (a == "-h" || a == "--help") { usage(); std::exit(0); }
    else { std::fprintf(stderr, "unknown argument %s\n", a.c_str()); usage(); std::exit(2); }
  }
  if (o.workers < 0 || o.workers > kMaxWorkers) { usage(); std::exit(2); }
  return o;
}

}  // namespace
}  // namespace hvd_sparse::omni

int main(int argc, char** argv) {
  using namespace hvd_sparse::omni;
  Options o = parse(argc, argv);
  if (o.parent) {
    // No orphans: die with the rank that launched us (checked again below, in case it already
    // died before prctl took effect).
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != o.parent) return 0;
  }
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  std::vector<int> fds{open_socket(o, o.port)};
  const int port = bound_port(fds[0]);
  for (int i = 1; i < o.threads; ++i) fds.push_back(open_socket(o, port));
  std::printf("hvd-sparse aggregator listening on %s:%d workers=%d threads=%d\n", o.host.c_str(),
              port, o.workers, o.threads);
  std::fflush(stdout);
  if (!o.port_file.empty()) {  // written atomically: the launcher polls for it
    std::string tmp = o.port_file + ".tmp";
    if (FILE* f = std::fopen(tmp.c_str(), "w")) {
      std::fprintf(f, "%d\n", port);
      std::fclose(f);
      std::rename(tmp.c_str(), o.port_file.c_str());
    }
  }

  Aggregator agg(o);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < fds.size(); ++i)
    threads.emplace_back(serve, std::ref(agg), std::cref(o), fds[i], o.seed * 7919 + i);
  double last_stats = now_s(), last_expire = now_s();
  auto dump = [&] {
    std::printf("hvd-sparse aggregator stats %s\n", agg.c.json().c_str());
    std::fflush(stdout);
  };
  while (!g_stop.load()) {
    usleep(50 * 1000);
    double t = now_s();
    if (g_dump.exchange(false)) dump();
    if (o.stats_every > 0 && t - last_stats >= o.stats_every) { dump(); last_stats = t; }
    if (t - last_expire >= 1.0) { agg.expire(); last_expire = t; }
    if (o.parent && getppid() != o.parent) g_stop = true;
  }
  for (auto& th : threads) th.join();
  dump();
  for (int fd : fds) close(fd);
  return 0;
}

// The aggregator core: see core.h. Per slot it keeps the round in progress and the previous
// round's result (the shadow set), so a retransmitted packet of either round is idempotent: a
// duplicate of the current round changes nothing (and, once the round has waited kHeldAfter,
// is answered HELD), one of the previous round gets the stored result back. Every packet is
// validated before it touches state; a bad one is dropped and counted.
#include "core.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "../auth.h"
#include "../protocol.h"
#include "../values.h"

namespace hvd_sparse::omni {
namespace {

struct Slot {
  uint32_t round = 0;
  std::vector<uint32_t> cur, next;  // per lane: position of this round, min announced next
  std::vector<double> acc;          // lanes * block_size running sums
  uint64_t present = 0;             // lanes some worker contributed to this round
  std::vector<uint64_t> seen;       // worker bitmap of this round
  uint32_t count = 0;
  double opened = 0;  // when the round's first DATA came
  // per lane: how many workers' DATA of this round carried a block there (counted to 2), and
  // the last of them
  std::vector<uint8_t> holders;
  std::vector<uint16_t> holder;
  bool done = false;
  std::shared_ptr<std::vector<uint8_t>> last;  // previous round's RESULT (the shadow set)
  // ... and its copies for the workers some of whose lanes no other worker carried (flag OWN)
  std::vector<std::pair<uint16_t, std::shared_ptr<std::vector<uint8_t>>>> own;

  const std::shared_ptr<std::vector<uint8_t>>& result_for(uint16_t worker) const {
    for (const auto& [w, b] : own)
      if (w == worker) return b;
    return last;
  }
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
  uint32_t epoch = 0;  // the membership registered (docs/PROTOCOL.md "Memberships")
  uint16_t nworkers = 0;
  // Authenticated jobs: the job's MAC, this aggregator's sender id in it, and a replay window
  // per worker.
  std::unique_ptr<Mac> mac;
  uint32_t sender = 0;
  std::vector<ReplayWindow> windows;
  size_t slot_bytes = 0;  // its accumulators' memory
  std::vector<Endpoint> addr;
  std::vector<uint8_t> bye;
  uint32_t nbye = 0;
  std::unordered_map<uint64_t, Tensor> tensors;
  double touched = 0;
};

bool test_bit(const std::vector<uint64_t>& v, uint32_t i) { return v[i >> 6] >> (i & 63) & 1; }
void set_bit(std::vector<uint64_t>& v, uint32_t i) { v[i >> 6] |= uint64_t(1) << (i & 63); }

}  // namespace

struct AggregatorCore::Impl {
  explicit Impl(const CoreOptions& o) : o_(o) {}
  struct {
#define HS_DECL(n) std::atomic<uint64_t> n{0};
    HS_CORE_COUNTERS(HS_DECL)
#undef HS_DECL
  } c;

  void handle(const uint8_t* p, size_t len, const Endpoint& from, double now,
              std::vector<Out>& out) {
    if (len < kHeaderBytes) {
      c.malformed++;
      return;
    }
    Header h = load_header(p);
    const bool mac = h.flags & kFlagAuth;  // the structure is that of the packet less its trailer
    if (check_structure(h, mac ? (len >= kHeaderBytes + kAuthBytes ? len - kAuthBytes : 0) : len)) {
      c.malformed++;
      return;
    }
    // With a secret every packet carries a MAC, without one none may (it could not be checked).
    if (mac != !o_.secret.empty()) {
      (mac ? c.bad_mac : c.unauthenticated)++;
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    now_ = now;
    if (h.type == kRegister) return on_register(h, p, len, from, out);
    auto jt = jobs_.find(h.token);
    if (jt == jobs_.end()) {
      c.unknown_job++;
      return;
    }
    Job& job = jt->second;
    uint64_t seq = 0;
    // The tag first (a forged epoch must not count as stale), then the epoch: an earlier
    // membership's packet (its own worker count, its own sequence numbers) touches nothing of
    // this one's, not even a replay window. A later one's has not registered here: none of ours.
    if (mac && !mac_valid(*job.mac, h, p, len, seq)) return;
    if (h.epoch != job.epoch) {
      (h.epoch < job.epoch ? c.stale_epoch : c.unknown_job)++;
      return;
    }
    if (h.nworkers != job.nworkers) {
      c.malformed++;
      return;
    }
    if (mac && !unseen(job.windows[h.worker], seq)) return;
    // A worker's address is pinned at its registration: a packet in its name from anywhere
    // else (a forged BYE or RELEASE, DATA of another sender) is dropped and counted as foreign
    // (a malformed one as malformed, whoever sent it).
    if ((h.type == kRelease || h.type == kBye) && !(from == job.addr[h.worker])) {
      c.foreign++;
      return;
    }
    switch (h.type) {
      case kData: return on_data(job, h, p, from, out);
      case kRelease: job.touched = now_; return on_release(job, h);
      case kBye:
        job.touched = now_;
        if (!job.bye[h.worker]) {
          job.bye[h.worker] = 1;
          ++job.nbye;
        }
        if (job.nbye == job.nworkers) {
          c.released += job.tensors.size();
          jobs_.erase(jt);
        }
        return;
      default: c.malformed++; return;  // aggregator-bound types only
    }
  }

  void expire(double now) {
    std::lock_guard<std::mutex> lock(mu_);
    const double t = now_ = now;
    for (auto j = jobs_.begin(); j != jobs_.end();) {
      for (auto it = j->second.tensors.begin(); it != j->second.tensors.end();) {
        if (t - it->second.touched > o_.idle) {
          it = drop_tensor(j->second, it);
          c.expired++;
        } else ++it;
      }
      if (t - j->second.touched > o_.idle && j->second.tensors.empty()) j = jobs_.erase(j);
      else ++j;
    }
  }

  size_t active_jobs() {
    std::lock_guard<std::mutex> lock(mu_);
    return jobs_.size();
  }

  // A tag from worker h.worker under `mac`, with a sequence number not seen before (`window`;
  // none for a job not created yet: `seq` is then kept for the new job's).
  bool authentic(Mac& mac, ReplayWindow* window, const Header& h, const uint8_t* p, size_t len,
                 uint64_t& seq) {
    return mac_valid(mac, h, p, len, seq) && (!window || unseen(*window, seq));
  }
  bool mac_valid(Mac& mac, const Header& h, const uint8_t* p, size_t len, uint64_t& seq) {
    if (mac.verify(p, len, h.worker, seq)) return true;
    c.bad_mac++;
    return false;
  }
  bool unseen(ReplayWindow& window, uint64_t seq) {
    if (window.accept(seq)) return true;
    c.replayed++;
    return false;
  }

  void on_register(const Header& h, const uint8_t* p, size_t len, const Endpoint& from,
                   std::vector<Out>& out) {
    auto it = jobs_.find(h.token);
    // Authenticated: the job's key, derived for a job not known yet (kept if it is created).
    std::unique_ptr<Mac> fresh;
    Mac* mac = nullptr;
    uint64_t seq = 0;
    if (!o_.secret.empty()) {
      if (h.slot >= kAggregatorSender) {  // the aggregator's index, part of its sender id
        c.malformed++;
        return;
      }
      if (it != jobs_.end()) mac = it->second.mac.get();
      else mac = (fresh = std::make_unique<Mac>(derive_job_key(o_.secret, h.token))).get();
      const bool known = it != jobs_.end() && it->second.nworkers == h.nworkers &&
                         it->second.epoch == h.epoch;
      if (!authentic(*mac, known ? &it->second.windows[h.worker] : nullptr, h, p, len, seq))
        return;
    }
    // Memberships (docs/PROTOCOL.md): an earlier one's REGISTER (a straggler's keep-alive) is
    // dropped unanswered; a later one's replaces the job's state, whose tensors only the old
    // membership could have finished.
    if (it != jobs_.end() && h.epoch < it->second.epoch) {
      c.stale_epoch++;
      return;
    }
    const bool newer = it != jobs_.end() && h.epoch > it->second.epoch;
    uint32_t err = 0;
    if (o_.workers && h.nworkers != o_.workers) err = kErrJob;
    else if (newer) {
      if (mac) fresh = std::move(it->second.mac);  // the same token: the same key
      for (auto t = it->second.tensors.begin(); t != it->second.tensors.end();)
        t = drop_tensor(it->second, t);
      jobs_.erase(it);
      it = jobs_.end();
      c.memberships++;
    } else if (it != jobs_.end() && it->second.nworkers != h.nworkers) err = kErrJob;
    else if (it != jobs_.end() && mac && it->second.sender != kAggregatorSender + h.slot)
      err = kErrJob;  // the workers disagree on the aggregator list
    else if (it == jobs_.end() && jobs_.size() >= o_.max_jobs) err = kErrCapacity;
    if (!err && it == jobs_.end()) {
      Job j;
      j.epoch = h.epoch;
      j.nworkers = h.nworkers;
      j.addr.resize(h.nworkers);
      j.bye.assign(h.nworkers, 0);
      if (mac) {
        j.mac = std::move(fresh);
        j.sender = kAggregatorSender + h.slot;
        j.windows.resize(h.nworkers);
        j.windows[h.worker].accept(seq);
      }
      it = jobs_.emplace(h.token, std::move(j)).first;
      c.jobs++;
    }
    if (!err) {
      Endpoint& pinned = it->second.addr[h.worker];
      if (pinned.port && !(pinned == from)) {  // a REGISTER must not move a worker: no reply
        c.foreign++;
        return;
      }
      pinned = from;
      it->second.touched = now_;
    }
    Header r = make_header(err ? kError : kRegAck, h.token, h.epoch, h.worker, h.nworkers);
    r.round = err;
    auto b = packet(kHeaderBytes);
    store_header(b->data(), r);
    out.push_back({from, seal(mac, kAggregatorSender + h.slot, std::move(b))});
  }

  // A packet of `n` bytes, with room for a trailer.
  static std::shared_ptr<std::vector<uint8_t>> packet(size_t n) {
    auto b = std::make_shared<std::vector<uint8_t>>();
    b->reserve(n + kAuthBytes);
    b->resize(n);
    return b;
  }
  // The packet as it goes out: flagged and signed with the next sequence number when the job
  // is authenticated (`mac`).
  std::shared_ptr<std::vector<uint8_t>> seal(Mac* mac, uint32_t sender,
                                             std::shared_ptr<std::vector<uint8_t>> b) {
    if (!mac) return b;
    const size_t n = b->size();
    (*b)[kFlagsOffset] |= kFlagAuth;
    b->resize(n + kAuthBytes);
    mac->sign(b->data(), n, sender, ++seq_);
    return b;
  }
  std::shared_ptr<std::vector<uint8_t>> seal(Job& job, std::shared_ptr<std::vector<uint8_t>> b) {
    return seal(job.mac.get(), job.sender, std::move(b));
  }

  void on_release(Job& job, const Header& h) {
    auto it = job.tensors.find(h.tensor);
    if (it == job.tensors.end()) return;
    Tensor& t = it->second;
    if (test_bit(t.released, h.worker)) return;
    set_bit(t.released, h.worker);
    if (++t.nreleased == job.nworkers) {
      drop_tensor(job, it);
      c.released++;
    }
  }

  std::unordered_map<uint64_t, Tensor>::iterator drop_tensor(
      Job& job, std::unordered_map<uint64_t, Tensor>::iterator it) {
    for (auto& [g, s] : it->second.slots) release_bytes(job, s.acc.size() * sizeof(double));
    return job.tensors.erase(it);
  }

  void release_bytes(Job& job, size_t bytes) {
    slot_bytes_ -= bytes;
    job.slot_bytes -= bytes;
  }

  void send_error(Job& job, const Header& h, uint32_t code, std::vector<Out>& out) {
    Header e = make_header(kError, h.token, job.epoch, 0, job.nworkers);
    e.tensor = h.tensor;
    e.slot = h.slot;
    e.round = code;
    auto b = packet(kHeaderBytes);
    store_header(b->data(), e);
    b = seal(job, std::move(b));
    for (uint16_t w = 0; w < job.nworkers; ++w)
      if (job.addr[w].port) out.push_back({job.addr[w], b});
  }

  // A valid DATA: the job and tensor are alive.
  void accept(Job& job, Tensor& t) { job.touched = t.touched = now_; }

  // What a DATA is, judged before it touches any state.
  enum class Data {
    kMalformed,   // fails a check: dropped
    kStale,       // of a round neither current nor previous, or of a slot not open: dropped
    kMismatch,    // a well-formed round 0 of another layout: the tensor dies
    kDead,        // of a tensor that failed: its error again
    kDuplicate,   // its sender already sent this round (a retransmission): HELD if late
    kRetransmit,  // of the previous round: its sender lost that RESULT, which goes back
    kOpen,        // a valid round 0 of a slot not open yet: opens it (and its tensor), then adds
    kAdd,         // a valid DATA of the round in progress: its blocks are added
  };
  struct Target {
    Tensor* t = nullptr;
    Slot* s = nullptr;
  };

  static bool same_layout(const Header& h, const Header& q) {
    return h.dtype == q.dtype && h.lanes == q.lanes && h.block_size == q.block_size &&
           h.nblocks == q.nblocks && h.nslots == q.nslots && h.meta == q.meta;
  }

  // Every structural and semantic check of a DATA, against the job's state, changing nothing.
  // `at` gets the tensor and slot it is for, where they exist.
  static Data validate(Job& job, const Header& h, const uint8_t* p, Target& at) {
    if (((h.flags & kFlagShadow) != 0) != ((h.round & 1) != 0)) return Data::kMalformed;
    auto it = job.tensors.find(h.tensor);
    if (it != job.tensors.end()) {
      at.t = &it->second;
      // Ranks that disagree on a tensor send well-formed first rounds of their own layouts;
      // anything else is junk and must not kill the tensor.
      if (!at.t->error && !same_layout(h, at.t->params))
        return h.round == 0 && lanes_valid(h, p, nullptr) ? Data::kMismatch : Data::kMalformed;
      if (at.t->error) return Data::kDead;
      auto st = at.t->slots.find(h.slot);
      if (st != at.t->slots.end()) at.s = &st->second;
    }
    // A tensor and each of its slots start at round 0 (else: expired, or junk).
    if (!at.s)
      return h.round != 0                 ? Data::kStale
             : lanes_valid(h, p, nullptr) ? Data::kOpen
                                          : Data::kMalformed;
    const Slot& s = *at.s;
    if (s.last && h.round + 1 == s.round) {  // the sender lost our previous RESULT
      // Its lane table must be the one of that round (the stored RESULT's offsets).
      uint32_t prev[kMaxLanes];
      const uint8_t* lt = s.last->data() + kHeaderBytes + kBitmapBytes;
      for (uint32_t l = 0; l < h.lanes; ++l) prev[l] = ld32(lt + l * kLaneBytes);
      return lanes_valid(h, p, prev) ? Data::kRetransmit : Data::kMalformed;
    }
    if (s.done || h.round != s.round) return Data::kStale;
    if (test_bit(s.seen, h.worker)) return Data::kDuplicate;  // the worker waits for a peer
    return lanes_valid(h, p, s.cur.data()) ? Data::kAdd : Data::kMalformed;
  }

  void on_data(Job& job, const Header& h, const uint8_t* p, const Endpoint& from,
               std::vector<Out>& out) {
    Target at;
    const Data d = validate(job, h, p, at);
    if (d != Data::kMalformed && !(from == job.addr[h.worker])) {
      c.foreign++;
      return;
    }
    switch (d) {
      case Data::kMalformed: c.malformed++; return;
      case Data::kStale: c.stale++; return;
      case Data::kMismatch:
        at.t->error = kErrMismatch;
        c.mismatch++;
        return send_error(job, h, at.t->error, out);
      case Data::kDead: return send_error(job, h, at.t->error, out);
      case Data::kDuplicate: {
        c.duplicates++;
        job.touched = at.t->touched = now_;
        if (now_ - at.s->opened < kHeldAfter) return;
        // A round this old waits for a missing peer: say whom.
        uint16_t missing = 0;
        while (missing < job.nworkers && test_bit(at.s->seen, missing)) ++missing;
        auto b = packet(kHeaderBytes);
        store_header(b->data(), held_header(h, job.nworkers, missing));
        return out.push_back({from, seal(job, std::move(b))});
      }
      case Data::kRetransmit: {
        c.retransmits++;
        accept(job, *at.t);
        const auto& last = at.s->result_for(h.worker);
        if (!job.mac) return out.push_back({from, last});
        // Every transmission carries a sequence number of its own: the sender's window would
        // drop a copy of the one sent before as a replay.
        auto b = packet(last->size() - kAuthBytes);
        std::memcpy(b->data(), last->data(), b->size());
        out.push_back({from, seal(job, std::move(b))});
        return;
      }
      case Data::kOpen:
        if (!open(job, h, at, out)) return;
        [[fallthrough]];
      case Data::kAdd: accept(job, *at.t); return accumulate(job, *at.t, h, *at.s, p, out);
    }
  }

  // Opens the slot of a valid round 0 (and its tensor, for the first): false when the
  // accumulators' memory is full, which fails the tensor.
  bool open(Job& job, const Header& h, Target& at, std::vector<Out>& out) {
    if (!at.t && job.tensors.size() >= o_.max_tensors) {  // nothing kept: its next DATA asks again
      send_error(job, h, kErrCapacity, out);
      return false;
    }
    if (!at.t) {
      Tensor t;
      t.params = h;
      t.released.assign((job.nworkers + 63) / 64, 0);
      at.t = &job.tensors.emplace(h.tensor, std::move(t)).first->second;
      c.tensors++;
    }
    const size_t bytes = size_t(h.lanes) * h.block_size * sizeof(double);
    if (slot_bytes_ + bytes > o_.max_slot_bytes || job.slot_bytes + bytes > o_.max_job_bytes) {
      at.t->error = kErrCapacity;
      send_error(job, h, at.t->error, out);
      return false;
    }
    Slot s;
    s.cur.resize(h.lanes);
    for (uint32_t l = 0; l < h.lanes; ++l)
      s.cur[l] = stream_length(h.slot, l, h.nblocks, h.nslots, h.lanes) ? 0 : kInf;
    s.next.assign(h.lanes, kInf);
    s.holders.assign(h.lanes, 0);
    s.holder.assign(h.lanes, 0);
    s.acc.assign(size_t(h.lanes) * h.block_size, 0.0);
    s.seen.assign((job.nworkers + 63) / 64, 0);
    slot_bytes_ += bytes;
    job.slot_bytes += bytes;
    at.s = &at.t->slots.emplace(h.slot, std::move(s)).first->second;
    return true;
  }

  // A validated DATA of the round in progress: its lanes' nexts into the minimums, its blocks
  // into the sums (in float64: the order packets arrive in then barely matters, and every
  // worker receives the same rounded result anyway); the last worker's completes the round.
  void accumulate(Job& job, Tensor& t, const Header& h, Slot& s, const uint8_t* p,
                  std::vector<Out>& out) {
    const uint8_t* lane = p + kHeaderBytes + kBitmapBytes;
    const uint64_t bitmap = ld64(p + kHeaderBytes);
    const uint8_t* v = lane + size_t(h.lanes) * kLaneBytes;
    const size_t bs = h.block_size;
    for (uint32_t l = 0; l < h.lanes; ++l) {
      uint32_t nxt = ld32(lane + l * kLaneBytes + 4);
      if (nxt < s.next[l]) s.next[l] = nxt;
      if (!(bitmap >> l & 1)) continue;
      add_values(s.acc.data() + l * bs, v, bs, h.dtype);  // fixed32 sums are exact (< 2^53)
      v += bs * wire_size(h.dtype);
    }
    s.present |= bitmap;
    set_bit(s.seen, h.worker);
    if (s.count == 0) s.opened = now_;
    for (uint32_t l = 0; l < h.lanes; ++l)
      if (bitmap >> l & 1) {
        s.holders[l] = uint8_t(std::min(2, s.holders[l] + 1));
        s.holder[l] = h.worker;
      }
    if (++s.count < job.nworkers) return;
    complete(job, t, h, s, out);
  }

  // A fixed32 sum outside the int32 range (some worker ignored the agreed exponent): the whole
  // tensor fails rather than any rank receiving a wrapped or saturated value.
  static bool overflows(const Slot& s, uint32_t lanes, size_t bs) {
    for (uint32_t l = 0; l < lanes; ++l) {
      if (!(s.present >> l & 1)) continue;
      for (const double *a = s.acc.data() + l * bs, *e = a + bs; a != e; ++a)
        if (*a < double(INT32_MIN) || *a > double(INT32_MAX)) return true;
    }
    return false;
  }

  // Every worker has sent this round: build the RESULT, keep it as the shadow copy, send it to
  // all workers, and open the next round at the lanes' minimum announced positions.
  void complete(Job& job, Tensor& t, const Header& h, Slot& s, std::vector<Out>& out) {
    if (h.dtype == kFixed32 && overflows(s, h.lanes, h.block_size)) {
      t.error = kErrOverflow;
      c.overflow++;
      return send_error(job, h, t.error, out);
    }
    const uint32_t present = uint32_t(__builtin_popcountll(s.present));
    bool last = true;
    for (uint32_t n : s.next) last = last && n == kInf;
    const Header r = result_header(h, job.nworkers, h.dtype, s.round, present, last);
    auto b = packet(data_bytes(h.lanes, present, h.block_size, h.dtype));
    uint8_t* p = b->data();
    store_header(p, r);
    st64(p + kHeaderBytes, s.present);
    uint8_t* lane = p + kHeaderBytes + kBitmapBytes;
    uint8_t* v = lane + size_t(h.lanes) * kLaneBytes;
    const size_t bs = h.block_size, vb = bs * wire_size(h.dtype);
    for (uint32_t l = 0; l < h.lanes; ++l) {
      st32(lane + l * kLaneBytes, s.cur[l]);
      st32(lane + l * kLaneBytes + 4, s.next[l]);
      if (!(s.present >> l & 1)) continue;
      double* a = s.acc.data() + l * bs;
      store_values(v, a, bs, h.dtype);
      std::fill(a, a + bs, 0.0);
      v += vb;
    }
    c.rounds++;
    // Lanes one worker alone carried: their sums are its own blocks (0 + x in float64,
    // rounded back: x, but -0 and signalling NaNs, which the worker's own copy turns the same
    // way), so its copy leaves them out, flagged OWN. (A job of one worker gets its sums: it
    // spares no other worker's bytes.)
    s.own.clear();
    if (job.nworkers > 1) {
      std::vector<std::pair<uint16_t, uint64_t>> alone;  // worker, the lanes that are its alone
      for (uint32_t l = 0; l < h.lanes; ++l) {
        if (s.holders[l] != 1) continue;
        auto it = std::find_if(alone.begin(), alone.end(),
                               [&](const auto& a) { return a.first == s.holder[l]; });
        if (it == alone.end()) alone.push_back({s.holder[l], uint64_t(1) << l});
        else it->second |= uint64_t(1) << l;
      }
      for (const auto& [w, mine] : alone) {
        s.own.push_back({w, seal(job, own_copy(r, p, s.present & ~mine, h.lanes, vb))});
        c.own_results++;
      }
    }
    std::fill(s.holders.begin(), s.holders.end(), 0);
    s.last = b = seal(job, std::move(b));
    s.cur.swap(s.next);
    std::fill(s.next.begin(), s.next.end(), kInf);
    std::fill(s.seen.begin(), s.seen.end(), 0);
    s.present = 0;
    s.count = 0;
    s.round++;
    if (last) {
      s.done = true;
      release_bytes(job, s.acc.size() * sizeof(double));
      std::vector<double>().swap(s.acc);
    }
    for (uint16_t w = 0; w < job.nworkers; ++w) out.push_back({job.addr[w], s.result_for(w)});
  }

  // The copy of RESULT `full` (header `r`) that carries only the lanes of `keep`, flagged
  // OWN: its addressee's own lanes left out.
  static std::shared_ptr<std::vector<uint8_t>> own_copy(Header r, const uint8_t* full,
                                                        uint64_t keep, uint32_t lanes,
                                                        size_t vb) {
    const uint64_t present = ld64(full + kHeaderBytes);
    const size_t table = kHeaderBytes + kBitmapBytes + size_t(lanes) * kLaneBytes;
    r.flags |= kFlagOwn;
    r.present = uint32_t(__builtin_popcountll(keep));
    auto q = packet(table + r.present * vb);
    store_header(q->data(), r);
    st64(q->data() + kHeaderBytes, keep);
    std::memcpy(q->data() + kHeaderBytes + kBitmapBytes, full + kHeaderBytes + kBitmapBytes,
                size_t(lanes) * kLaneBytes);
    const uint8_t* from = full + table;
    uint8_t* to = q->data() + table;
    for (uint32_t l = 0; l < lanes; ++l) {
      if (!(present >> l & 1)) continue;
      if (keep >> l & 1) {
        std::memcpy(to, from, vb);
        to += vb;
      }
      from += vb;
    }
    return q;
  }

  const CoreOptions o_;
  double now_ = 0;
  std::mutex mu_;
  std::unordered_map<uint64_t, Job> jobs_;
  size_t slot_bytes_ = 0;
  uint64_t seq_ = first_sequence_number();  // of what this aggregator signs, in any job
};

AggregatorCore::AggregatorCore(const CoreOptions& o) : impl_(std::make_unique<Impl>(o)) {}
AggregatorCore::~AggregatorCore() = default;

void AggregatorCore::handle(const uint8_t* p, size_t len, const Endpoint& from, double now,
                            std::vector<Out>& out) {
  impl_->handle(p, len, from, now, out);
}

void AggregatorCore::expire(double now) { impl_->expire(now); }

size_t AggregatorCore::active_jobs() { return impl_->active_jobs(); }

std::vector<std::pair<const char*, uint64_t>> AggregatorCore::counters() const {
  std::vector<std::pair<const char*, uint64_t>> v;
#define HS_PAIR(n) v.emplace_back(#n, impl_->c.n.load());
  HS_CORE_COUNTERS(HS_PAIR)
#undef HS_PAIR
  return v;
}

}  // namespace hvd_sparse::omni

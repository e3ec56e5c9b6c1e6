// The aggregation program's data plane: see pipeline.h. The state is laid out as a switch's
// register arrays (flat, fixed at start, indexed by group, set and lane or cell); the comments
// name the stage of hvd_sparse/tools/switch/program.py each step stands for.
#include "pipeline.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <map>
#include <stdexcept>
#include <unordered_map>

#include "../omni/protocol.h"
#include "../omni/values.h"

namespace hvd_sparse::omni {
namespace {

uint64_t mix(uint64_t x) {  // splitmix64's finalizer: a tensor id spread over the groups
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Per group and register set (round & 1): the round's bookkeeping registers.
struct SetRegs {
  uint32_t round = 0, seen = 0, count = 0;
  uint32_t holders = 0;  // workers whose DATA carried a block
  uint64_t present = 0;  // lanes some worker contributed to
  bool overflow = false;
  // when the round's first DATA came: register `opened` (program.py), which a late duplicate
  // is answered HELD against (and the round-wait counter reads)
  double opened = 0;
};
constexpr uint32_t kSeenBits = 8 * sizeof(SetRegs::seen);  // workers a job can have, at most
static_assert(kSwitchMaxWorkers <= kSeenBits, "the default worker limit exceeds the seen-bitmap");

// Per group: the tag binding it to one (tensor, slot), and that slot's parameters.
struct GroupRegs {
  uint64_t tag = 0;    // 0: free
  uint32_t round = 0;  // the round in progress (after the last one: its number + 1)
  bool done = false;
  uint32_t error = 0;  // a dead slot: every DATA gets this ERROR back
  uint32_t released = 0;
  double touched = 0;
  Header params{};  // lanes, block_size, nblocks, nslots, meta of the round-0 packet that bound it
  SetRegs set[2];
};

}  // namespace

struct Pipeline::Impl {
  explicit Impl(const PipelineOptions& o)
      : o_(o), groups_(o.cells / std::max(1u, o.cells_per_slot)), g_(groups_),
        lanes_(size_t(groups_) * 2 * kMaxLanes),
        values_(size_t(groups_) * o.cells_per_slot * 2 * o.values_per_pass) {
    if (o.values_per_pass == 0 || o.cells_per_slot == 0 || groups_ == 0)
      throw std::invalid_argument("switch pipeline: empty register pool");
    if (o.max_workers > kSeenBits)
      throw std::invalid_argument("switch pipeline: the seen-bitmap has " +
                                  std::to_string(kSeenBits) + " bits");
    if (o.values_per_pass > kMaxRegAckGeometry || o.cells_per_slot > kMaxRegAckGeometry)
      throw std::invalid_argument(
          "switch pipeline: a REGACK carries values per pass and cells "
          "per slot in 16 bits");
  }

  struct {
#define HS_DECL(n) uint64_t n = 0;
    HS_PIPELINE_COUNTERS(HS_DECL)
#undef HS_DECL
  } c;

  // ---- control plane ----------------------------------------------------------------------

  uint32_t install(uint64_t token, uint16_t nworkers, uint32_t groups, double now, bool automatic,
                   const std::vector<uint32_t>& ips = {}, uint32_t epoch = 1) {
    auto old = jobs_.find(token);
    if (old != jobs_.end() && old->second.epoch >= epoch)
      throw std::runtime_error("job already installed");
    if (!ips.empty() && ips.size() != nworkers)
      throw std::runtime_error(std::to_string(ips.size()) + " worker addresses for " +
                               std::to_string(nworkers) + " workers");
    if (nworkers == 0 || nworkers > o_.max_workers)
      throw std::runtime_error(std::to_string(nworkers) + " workers: a switch job has at most " +
                               std::to_string(o_.max_workers) + " (a " + std::to_string(kSeenBits) +
                               "-bit seen-bitmap)");
    if (groups == 0) throw std::runtime_error("a job needs at least one slot group");
    if (old != jobs_.end()) {  // an earlier membership's: its groups and bindings go
      remove(token);
      c.memberships++;
    }
    uint32_t at = 0;  // first fit among the installed ranges, sorted by start
    for (auto& [first, tok] : ranges_) {
      if (first - at >= groups) break;
      at = first + jobs_.at(tok).groups;
    }
    if (at + groups > groups_ || at + groups < at)
      throw std::runtime_error("register pool exhausted: " + std::to_string(groups) +
                               " slot groups asked, " + std::to_string(free_groups()) + " of " +
                               std::to_string(groups_) + " free");
    SwitchJob j;
    j.token = token;
    j.epoch = epoch;
    j.nworkers = nworkers;
    j.first = at;
    j.groups = groups;
    j.automatic = automatic;
    j.addr.resize(nworkers);
    j.ips = ips;
    j.touched = now;
    unbind(at, groups, now);
    ranges_[at] = token;
    jobs_.emplace(token, std::move(j));
    c.jobs++;
    return at;
  }

  bool remove(uint64_t token, uint32_t epoch = UINT32_MAX) {
    auto it = jobs_.find(token);
    if (it == jobs_.end() || it->second.epoch > epoch) return false;
    unbind(it->second.first, it->second.groups, t_);
    ranges_.erase(it->second.first);
    jobs_.erase(it);
    return true;
  }

  uint32_t free_groups() const {
    uint32_t used = 0;
    for (auto& [t, j] : jobs_) used += j.groups;
    return groups_ - used;
  }

  // Groups [first, first + n) back to their reset state.
  void unbind(uint32_t first, uint32_t n, double now) {
    for (uint32_t g = first; g < first + n; ++g) {
      if (g_[g].tag) bound(-1, now);
      g_[g] = GroupRegs{};
    }
  }

  // The bound-group count changes by `delta` at `now`: first the time it held its old value
  // goes into occupied_us.
  void bound(int delta, double now) {
    if (now > t_) {
      occupied_s_ += double(bound_) * (now - t_);
      t_ = now;
    }
    bound_ = uint32_t(int64_t(bound_) + delta);
    c.occupied_us = uint64_t(occupied_s_ * 1e6);
  }

  void expire(double now) {
    bound(0, now);
    std::vector<uint64_t> idle;
    for (auto& [t, j] : jobs_)
      if (j.automatic && now - j.touched > o_.idle) idle.push_back(t);
    for (uint64_t t : idle) remove(t);
  }

  uint32_t occupied() const { return bound_; }

  // ---- data plane -------------------------------------------------------------------------

  void handle(const uint8_t* p, size_t len, const Endpoint& from, double now,
              std::vector<Out>& out) {
    c.packets++;
    c.passes++;  // the parser and the job table: every packet's first pass
    bound(0, now);
    if (len < kHeaderBytes) {
      c.malformed++;
      return;
    }
    const Header h = load_header(p);
    if (check_structure(h, len)) {
      c.malformed++;
      return;
    }
    if (h.type == kRegister) return on_register(h, from, now, out);
    auto jt = jobs_.find(h.token);
    if (jt == jobs_.end()) {
      c.unknown_job++;
      return;
    }
    SwitchJob& job = jt->second;
    // Another membership's packet: an earlier one's (a straggler's) is stale; a later one is
    // not installed here.
    if (h.epoch != job.epoch) {
      (h.epoch < job.epoch ? c.stale_epoch : c.unknown_job)++;
      return;
    }
    if (h.nworkers != job.nworkers) {
      c.malformed++;
      return;
    }
    // A worker's address is pinned at its REGISTER (the multicast group results go to): a
    // packet in its name from anywhere else, or before it registered, is dropped and counted
    // as foreign (a malformed DATA as malformed, whoever sent it).
    if ((h.type == kRelease || h.type == kBye) && !(from == job.addr[h.worker])) {
      c.foreign++;
      return;
    }
    switch (h.type) {
      case kData: return on_data(job, h, p, from, now, out);
      case kRelease: job.touched = now; return on_release(job, h, now);
      case kBye:
        job.touched = now;
        job.bye |= 1u << h.worker;
        if (job.automatic && job.bye == full(job)) remove(h.token);
        return;
      default: c.malformed++; return;
    }
  }

  static uint32_t full(const SwitchJob& j) {
    return j.nworkers == kSeenBits ? ~0u : (1u << j.nworkers) - 1;
  }

  void reply(const Endpoint& to, uint8_t type, const Header& h, uint16_t nworkers, uint32_t code,
             std::vector<Out>& out, const RegAck& ack = {}) {
    Header r = make_header(type, h.token, h.epoch, h.worker, nworkers);
    r.tensor = h.tensor;
    r.slot = h.slot;
    r.round = code;
    store_regack(r, ack);
    auto b = std::make_shared<std::vector<uint8_t>>(kHeaderBytes);
    store_header(b->data(), r);
    out.push_back({to, b});
  }

  // REGISTER is the control plane's: it programs the job's multicast group (the worker's
  // address), installing the job first when automatic installs are on.
  void on_register(const Header& h, const Endpoint& from, double now, std::vector<Out>& out) {
    auto it = jobs_.find(h.token);
    if (it != jobs_.end() && h.epoch < it->second.epoch) {  // a straggler's keep-alive
      c.stale_epoch++;
      return;
    }
    // A later membership: the control plane installs it (refused until then), or, for a job
    // its REGISTERs installed, this one installs it again.
    const bool newer = it != jobs_.end() && h.epoch > it->second.epoch;
    uint32_t err = 0;
    if (h.nworkers > o_.max_workers) {
      err = kErrUnsupported;
      c.refused++;
    } else if (newer && !it->second.automatic) {
      err = kErrJob;
      c.refused++;
    } else if (it == jobs_.end() || newer) {
      if (o_.auto_groups == 0) {
        err = kErrJob;
        c.refused++;
      } else {
        try {
          install(h.token, h.nworkers, o_.auto_groups, now, true, {}, h.epoch);
          it = jobs_.find(h.token);
        } catch (const std::runtime_error&) {
          err = kErrCapacity;
          c.refused++;
        }
      }
    } else if (it->second.nworkers != h.nworkers) {
      err = kErrJob;
    }
    if (!err) {
      const std::vector<uint32_t>& ips = it->second.ips;
      Endpoint& pinned = it->second.addr[h.worker];
      // A REGISTER must not move a worker, nor claim one installed on another host: no reply
      // (installed hosts are IPv4: the emulated switch's frames are)
      if ((pinned.port && !(pinned == from)) ||
          (!ips.empty() && (!from.is_v4() || ips[h.worker] != from.ip4()))) {
        c.foreign++;
        return;
      }
      pinned = from;
      it->second.touched = now;
    }
    // REGACK tells the workers how many groups the job owns (no tensor uses more slots) and
    // what a slot holds (no packet carries more).
    if (err) return reply(from, kError, h, h.nworkers, err, out);
    reply(from, kRegAck, h, h.nworkers, 0, out,
          RegAck{it->second.groups, o_.values_per_pass, o_.cells_per_slot});
  }

  void on_release(SwitchJob& job, const Header& h, double now) {
    GroupRegs& g = g_[group_of(job, h)];
    if (g.tag != tag_of(h) || !g.done) return;
    g.released |= 1u << h.worker;
    if (g.released == full(job)) {
      g.tag = 0;
      bound(-1, now);
      c.released++;
    }
  }

  static uint64_t tag_of(const Header& h) {
    return mix(h.tensor ^ (uint64_t(h.slot) << 40 | h.slot)) | 1;  // never 0 (free)
  }
  uint32_t group_of(const SwitchJob& job, const Header& h) const {
    return job.first + uint32_t((mix(h.tensor) + h.slot) % job.groups);
  }

  uint32_t chunks(uint32_t bs) const { return (bs + o_.values_per_pass - 1) / o_.values_per_pass; }
  uint32_t* offsets(uint32_t g, int set) { return &lanes_[(size_t(g) * 2 + set) * kMaxLanes]; }
  const uint32_t* offsets(uint32_t g, int set) const {
    return &lanes_[(size_t(g) * 2 + set) * kMaxLanes];
  }
  int32_t* cell(uint32_t g, uint32_t c_in_group, int set) {
    return &values_[((size_t(g) * o_.cells_per_slot + c_in_group) * 2 + set) * o_.values_per_pass];
  }
  // next_min lives beside the offsets: a second lane register array
  uint32_t* next_min(uint32_t g, int set) { return &next_[(size_t(g) * 2 + set) * kMaxLanes]; }

  // Error for every worker of the job: the slot is dead, its tensor falls back.
  void fail_slot(SwitchJob& job, GroupRegs& g, const Header& h, uint32_t code,
                 std::vector<Out>& out) {
    g.error = code;
    g.done = true;
    for (uint16_t w = 0; w < job.nworkers; ++w)
      if (job.addr[w].port) reply(job.addr[w], kError, h, job.nworkers, code, out);
  }

  void open_set(uint32_t gi, int set, uint32_t round, const uint32_t* cur, uint32_t lanes,
                uint32_t bs) {
    SetRegs& s = g_[gi].set[set];
    s = SetRegs{};
    s.round = round;
    std::copy(cur, cur + lanes, offsets(gi, set));
    std::fill(next_min(gi, set), next_min(gi, set) + kMaxLanes, kInf);
    for (uint32_t k = 0; k < lanes * chunks(bs); ++k)
      std::fill(cell(gi, k, set), cell(gi, k, set) + o_.values_per_pass, 0);
  }

  // What a DATA is, judged before it touches any register.
  enum class Data {
    kJunk,         // fails the parser's checks (its first pass): dropped
    kUnsupported,  // a well-formed round 0 the switch cannot sum or hold: ERROR UNSUPPORTED
    kMalformed,    // fails a check further down the pipe: dropped
    kStale,        // of a round neither current nor previous, or for an unbound slot: dropped
    kBusy,         // a round 0 whose group another slot holds: dropped, its worker resends
    kBind,         // a valid round 0 at a free (or reclaimable) group: binds it, then adds
    kMismatch,     // a well-formed round 0 of another layout than the group's: the slot dies
    kDead,         // for a slot that failed: its error again
    kRetransmit,   // of the previous round: its sender lost that RESULT, rebuilt from the set
    kDuplicate,    // its sender is already in this round's seen-bitmap: HELD if late
    kAdd,          // a valid DATA of the round in progress: its values are added
  };
  // Where a DATA goes: its group, the passes it takes, the tag of its (tensor, slot).
  struct Where {
    uint32_t gi, passes;
    uint64_t tag;
  };

  static bool same_layout(const Header& h, const Header& q) {
    return h.lanes == q.lanes && h.block_size == q.block_size && h.nblocks == q.nblocks &&
           h.nslots == q.nslots && h.meta == q.meta;
  }

  // Every structural and semantic check of a DATA against the registers, changing nothing.
  Data validate(const Header& h, const uint8_t* p, const Where& at, double now) const {
    if (h.dtype != kFixed32 || at.passes > o_.cells_per_slot)
      // What the switch cannot sum (floating point) or hold (a packet beyond the slot's
      // cells): the tensor goes elsewhere. Only a well-formed first round says so (junk must
      // not kill a tensor).
      return h.round == 0 && lanes_valid(h, p, nullptr) ? Data::kUnsupported : Data::kJunk;
    if (((h.flags & kFlagShadow) != 0) != ((h.round & 1) != 0)) return Data::kJunk;
    const GroupRegs& g = g_[at.gi];
    if (g.tag != at.tag) {
      // Stage 0: only a round 0 binds a group: a free one, one completed and unreleased for
      // `hold` seconds, or one left mid-round for `abandon`; anything else for an unbound slot
      // is stale, or waits.
      const bool reclaim = g.tag != 0 && now - g.touched > (g.done ? o_.hold : o_.abandon);
      if (h.round != 0) return Data::kStale;
      if (g.tag != 0 && !reclaim) return Data::kBusy;
      return lanes_valid(h, p, nullptr) ? Data::kBind : Data::kMalformed;
    }
    if (!same_layout(h, g.params))
      return h.round == 0 && lanes_valid(h, p, nullptr) ? Data::kMismatch : Data::kMalformed;
    if (g.error) return Data::kDead;
    const int set = h.round & 1;
    if (h.round + 1 == g.round && g.set[set].round == h.round)  // the sender lost this RESULT
      return lanes_valid(h, p, offsets(at.gi, set)) ? Data::kRetransmit : Data::kMalformed;
    if (g.done || h.round != g.round) return Data::kStale;
    // Stage 1: the seen-bitmap (a retransmission of a round this worker is in).
    if (g.set[set].seen >> h.worker & 1) return Data::kDuplicate;
    return lanes_valid(h, p, offsets(at.gi, set)) ? Data::kAdd : Data::kMalformed;
  }

  void on_data(SwitchJob& job, const Header& h, const uint8_t* p, const Endpoint& from,
               double now, std::vector<Out>& out) {
    const Where at{group_of(job, h), h.lanes * chunks(h.block_size), tag_of(h)};
    GroupRegs& g = g_[at.gi];
    const bool bound = g.tag == at.tag;
    const Data d = validate(h, p, at, now);
    if (d == Data::kJunk) {
      c.malformed++;
      return;
    }
    if (d != Data::kMalformed && !(from == job.addr[h.worker])) {
      c.foreign++;
      return;
    }
    job.touched = now;
    if (d == Data::kUnsupported) return refuse(job, h, out);
    c.passes += at.passes - 1;  // stage 0 ran in the first pass; the rest recirculate
    c.recirculations += at.passes - 1;
    if (bound) g.touched = now;
    switch (d) {
      case Data::kMalformed: c.malformed++; return;
      case Data::kStale: c.stale++; return;
      case Data::kBusy: c.busy++; return;
      case Data::kMismatch:
        c.mismatch++;
        if (!g.error) return fail_slot(job, g, h, kErrMismatch, out);
        [[fallthrough]];
      case Data::kDead: return reply(job.addr[h.worker], kError, h, job.nworkers, g.error, out);
      case Data::kRetransmit:
        c.retransmits++;
        out.push_back({job.addr[h.worker], result(job, at.gi, h, h.round & 1, h.worker)});
        return;
      case Data::kDuplicate: {
        // The last stage: the round's opening time (register `opened`), and a ternary table
        // on the seen-bitmap for the lowest worker not heard.
        c.duplicates++;
        if (now - g.set[h.round & 1].opened < kHeldAfter) return;
        const uint32_t seen = g.set[h.round & 1].seen;
        const auto missing = uint16_t(__builtin_ctz(~seen));
        auto b = std::make_shared<std::vector<uint8_t>>(kHeaderBytes);
        store_header(b->data(), held_header(h, job.nworkers, missing));
        return out.push_back({job.addr[h.worker], b});
      }
      case Data::kBind: bind(at, h, now); [[fallthrough]];
      case Data::kAdd: return accumulate(job, at.gi, h, p, now, out);
      default: return;  // kJunk, kUnsupported: above
    }
  }

  // ERROR UNSUPPORTED to every worker of the job; no register is touched.
  void refuse(SwitchJob& job, const Header& h, std::vector<Out>& out) {
    c.unsupported++;
    for (uint16_t w = 0; w < job.nworkers; ++w)
      if (job.addr[w].port) reply(job.addr[w], kError, h, job.nworkers, kErrUnsupported, out);
  }

  // Stage 0 binds the group to this slot's round 0: tag, layout, and set 0 at the lanes'
  // first positions.
  void bind(const Where& at, const Header& h, double now) {
    GroupRegs& g = g_[at.gi];
    if (g.tag != 0) ++(g.done ? c.reclaimed : c.abandoned);
    else bound(+1, now);
    g = GroupRegs{};
    g.tag = at.tag;
    g.params = h;
    g.touched = now;
    uint32_t cur[kMaxLanes];
    for (uint32_t l = 0; l < h.lanes; ++l)
      cur[l] = stream_length(h.slot, l, h.nblocks, h.nslots, h.lanes) ? 0 : kInf;
    open_set(at.gi, 0, 0, cur, h.lanes, h.block_size);
  }

  // A validated DATA of the round in progress: per lane the look-ahead minimum (stage 1) and
  // the values (stages 2..: one pass per values_per_pass, saturating adds); the last worker's
  // completes the round.
  void accumulate(SwitchJob& job, uint32_t gi, const Header& h, const uint8_t* p, double now,
                  std::vector<Out>& out) {
    const int set = h.round & 1;
    SetRegs& s = g_[gi].set[set];
    if (s.count == 0) s.opened = now;
    const uint64_t bitmap = ld64(p + kHeaderBytes);
    const uint8_t* lane = p + kHeaderBytes + kBitmapBytes;
    const uint8_t* v = lane + size_t(h.lanes) * kLaneBytes;
    uint32_t* nm = next_min(gi, set);
    const uint32_t bs = h.block_size, vpp = o_.values_per_pass;
    for (uint32_t l = 0; l < h.lanes; ++l) {
      nm[l] = std::min(nm[l], ld32(lane + l * kLaneBytes + 4));
      if (!(bitmap >> l & 1)) continue;
      for (uint32_t i = 0; i < bs; ++i) {
        int32_t& a = cell(gi, l * chunks(bs) + i / vpp, set)[i % vpp];
        const int64_t sum = int64_t(a) + Value<kFixed32>::get(v, i);
        if (sum > INT32_MAX || sum < INT32_MIN) s.overflow = true;
        a = int32_t(std::clamp<int64_t>(sum, INT32_MIN, INT32_MAX));
      }
      v += 4 * size_t(bs);
    }
    s.present |= bitmap;
    s.seen |= 1u << h.worker;
    if (bitmap) s.holders |= 1u << h.worker;
    if (++s.count == job.nworkers) {
      c.round_wait_us += uint64_t(std::max(0.0, now - s.opened) * 1e6);
      complete(job, gi, h, out);
    }
  }

  // The last worker's pass: the round is complete. Multicast its RESULT (or, for a saturated
  // sum, ERROR OVERFLOW) and open the other set for the next round.
  void complete(SwitchJob& job, uint32_t gi, const Header& h, std::vector<Out>& out) {
    GroupRegs& g = g_[gi];
    const int set = h.round & 1;
    c.results++;
    if (g.set[set].overflow) {
      c.overflow++;
      return fail_slot(job, g, h, kErrOverflow, out);
    }
    // The egress: the one copy to a round's only holder leaves with the header alone
    auto r = result(job, gi, h, set, kNone);
    for (uint16_t w = 0; w < job.nworkers; ++w)
      out.push_back({job.addr[w], alone(job, g.set[set], w) ? result(job, gi, h, set, w) : r});
    const uint32_t* nm = next_min(gi, set);
    bool last = true;
    for (uint32_t l = 0; l < h.lanes; ++l) last = last && nm[l] == kInf;
    g.round = h.round + 1;
    if (last) g.done = true;
    else open_set(gi, set ^ 1, g.round, nm, h.lanes, h.block_size);
  }

  static constexpr uint32_t kNone = kSeenBits;  // result(): a copy for no worker in particular

  // Whether worker `to` alone carried the round held in `s`, in a job of several workers (a
  // job of one gets its sums): its copy is flagged OWN.
  static bool alone(const SwitchJob& job, const SetRegs& s, uint32_t to) {
    return to < kSeenBits && s.holders == 1u << to && job.nworkers > 1;
  }

  // The RESULT of the round held in `set`, for worker `to`: the deparser writes the registers
  // into the packet, but for the round's only holder in a job of several workers, whose copy
  // the egress cuts to the header and lane table (flag OWN: its sums are its own blocks).
  std::shared_ptr<const std::vector<uint8_t>> result(const SwitchJob& job, uint32_t gi,
                                                     const Header& h, int set, uint32_t to) {
    const SetRegs& s = g_[gi].set[set];
    const bool own = alone(job, s, to);
    const uint64_t bitmap = own ? 0 : s.present;
    const uint32_t present = uint32_t(__builtin_popcountll(bitmap));
    const uint32_t* nm = next_min(gi, set);
    bool last = true;
    for (uint32_t l = 0; l < h.lanes; ++l) last = last && nm[l] == kInf;
    Header r = result_header(h, job.nworkers, kFixed32, s.round, present, last);
    if (own) {
      r.flags |= kFlagOwn;
      c.own_results++;
    }
    auto b = std::make_shared<std::vector<uint8_t>>(
        data_bytes(h.lanes, present, h.block_size, kFixed32));
    uint8_t* p = b->data();
    store_header(p, r);
    st64(p + kHeaderBytes, bitmap);
    uint8_t* lane = p + kHeaderBytes + kBitmapBytes;
    uint8_t* v = lane + size_t(h.lanes) * kLaneBytes;
    const uint32_t* cur = offsets(gi, set);
    const uint32_t bs = h.block_size, vpp = o_.values_per_pass;
    for (uint32_t l = 0; l < h.lanes; ++l) {
      st32(lane + l * kLaneBytes, cur[l]);
      st32(lane + l * kLaneBytes + 4, nm[l]);
      if (!(bitmap >> l & 1)) continue;
      for (uint32_t k = 0; k < chunks(bs); ++k) {
        const uint32_t n = std::min(vpp, bs - k * vpp);
        std::memcpy(v + 4 * size_t(k) * vpp, cell(gi, l * chunks(bs) + k, set), 4 * size_t(n));
      }
      v += 4 * size_t(bs);
    }
    return b;
  }

  const PipelineOptions o_;
  const uint32_t groups_;
  std::vector<GroupRegs> g_;
  std::vector<uint32_t> lanes_, next_ = std::vector<uint32_t>(lanes_.size());
  std::vector<int32_t> values_;
  std::unordered_map<uint64_t, SwitchJob> jobs_;
  std::map<uint32_t, uint64_t> ranges_;  // first group -> job token
  uint32_t bound_ = 0;     // groups bound to a slot now
  double t_ = 0;           // the latest time seen
  double occupied_s_ = 0;  // the integral of bound_ over time, slot-seconds
};

Pipeline::Pipeline(const PipelineOptions& o) : impl_(std::make_unique<Impl>(o)) {}
Pipeline::~Pipeline() = default;

uint32_t Pipeline::install(uint64_t token, uint16_t nworkers, uint32_t groups, double now,
                           const std::vector<uint32_t>& ips, uint32_t epoch) {
  try {
    return impl_->install(token, nworkers, groups, now, false, ips, epoch);
  } catch (const std::exception&) {
    impl_->c.refused++;  // as a REGISTER refused at an automatic install is
    throw;
  }
}
bool Pipeline::remove(uint64_t token, uint32_t epoch) { return impl_->remove(token, epoch); }
std::vector<SwitchJob> Pipeline::jobs() const {
  std::vector<SwitchJob> v;
  for (auto& [t, j] : impl_->jobs_) v.push_back(j);
  std::sort(v.begin(), v.end(), [](auto& a, auto& b) { return a.first < b.first; });
  return v;
}
void Pipeline::expire(double now) { impl_->expire(now); }
void Pipeline::handle(const uint8_t* p, size_t len, const Endpoint& from, double now,
                      std::vector<Out>& out) {
  impl_->handle(p, len, from, now, out);
}
const PipelineOptions& Pipeline::options() const { return impl_->o_; }
uint32_t Pipeline::occupied() const { return impl_->occupied(); }
std::vector<std::pair<const char*, uint64_t>> Pipeline::counters() const {
  std::vector<std::pair<const char*, uint64_t>> v;
#define HS_PAIR(n) v.emplace_back(#n, impl_->c.n);
  HS_PIPELINE_COUNTERS(HS_PAIR)
#undef HS_PAIR
  return v;
}

}  // namespace hvd_sparse::omni

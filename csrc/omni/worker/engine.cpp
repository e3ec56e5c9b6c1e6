#include "engine.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "../../blocks.h"
#include "../values.h"

namespace hvd_sparse::omni {

constexpr double kMinWindow = 2, kMaxWindow = 4096, kInitialWindow = 8;
constexpr double kPaceAbove = 16;  // packets: smaller windows go out at once
constexpr double kMaxRto = 1.0;
constexpr double kKeepalive = 10.0;  // seconds; the aggregator's --idle default is 120

namespace {

// x * 2^e, exactly (but for subnormal results, rounded alike): one multiplication where 2^e
// is a normal double (ldexp per element costs 3x more), ldexp otherwise.
struct Pow2 {
  int e;
  double f;
  explicit Pow2(int e) : e(e), f(std::abs(e) <= 1022 ? std::ldexp(1.0, e) : 0) {}
  double operator()(double x) const { return f != 0 ? x * f : std::ldexp(x, e); }
};

// int32 LE q = x * 2^e rounded to nearest, ties to even (nearbyint in the default rounding
// mode), clamped to the int32 range. NaN (never sent in fixed point: the caller falls back
// first) becomes 0 rather than undefined behaviour.
template <typename V>
void quantize(uint8_t* q, const uint8_t* v, size_t n, const Pow2 up) {
  for (size_t i = 0; i < n; ++i) {
    const double r = std::nearbyint(up(double(V::get(v, i))));
    const int32_t x = r >= double(INT32_MAX)   ? INT32_MAX
                      : r <= double(INT32_MIN) ? INT32_MIN
                      : r == r                 ? int32_t(r)
                                               : 0;
    Value<kFixed32>::put(q, i, x);
  }
}
void quantize(uint8_t* q, const uint8_t* v, size_t n, uint8_t dtype, int e) {
  with_dtype(dtype, [=](auto t) { quantize<decltype(t)>(q, v, n, Pow2(e)); });
}

// out = q * 2^-e * scale in float64 (exact but for the scale), rounded once to the dtype.
template <typename V>
void dequantize(uint8_t* o, const uint8_t* q, size_t n, const Pow2 down, double scale) {
  for (size_t i = 0; i < n; ++i)
    V::put_double(o, i, down(double(Value<kFixed32>::get(q, i))) * scale);
}
void dequantize(uint8_t* o, const uint8_t* q, size_t n, uint8_t dtype, int e, double scale) {
  with_dtype(dtype, [=](auto t) { dequantize<decltype(t)>(o, q, n, Pow2(-e), scale); });
}

// CSR of a tensor's `n` non-zero blocks by stream (L streams; `block(k)`: the k-th, ascending):
// a counting sort, so positions stay ascending in each stream. With `src`, each position's k
// too (rows: where its values are in the packed input).
template <typename Block>
void index_blocks(TensorW& t, uint32_t L, int64_t n, Block block, bool src) {
  t.start.assign(L + 1, 0);
  for (int64_t k = 0; k < n; ++k) t.start[block(k) % L + 1]++;
  for (uint32_t j = 0; j < L; ++j) t.start[j + 1] += t.start[j];
  t.nnz_local = uint64_t(n);
  t.pos.resize(size_t(n));
  if (src) t.src.resize(size_t(n));
  std::vector<uint32_t> fill(t.start.begin(), t.start.end() - 1);
  for (int64_t k = 0; k < n; ++k) {
    const uint64_t b = block(k);
    const uint32_t at = fill[b % L]++;
    t.pos[at] = uint32_t(b / L);
    if (src) t.src[at] = uint32_t(k);
  }
}

}  // namespace

Engine::Engine(std::vector<AggregatorPath> aggs, const EngineOptions& o, Transport& io,
               std::function<void()> finished)
    : o_(o), io_(io), finished_(std::move(finished)),
      mac_(o.key.empty() ? nullptr : std::make_unique<Mac>(o.key)), rng_(o.seed),
      aggs_(std::move(aggs)), payload_(o.payload) {
  if (aggs_.empty()) throw std::runtime_error("omnireduce: no aggregators");
  windows_.resize(aggs_.size());
  if (o.nworkers < 1 || o.nworkers > kMaxWorkers || o.worker >= o.nworkers)
    throw std::runtime_error("omnireduce: bad worker id " + std::to_string(o.worker) + " of " +
                             std::to_string(o.nworkers));
}

void Engine::prepare(TensorW& t, const uint8_t* mask) const {
  t.esize = dtype_size(t.dtype);
  t.wire = t.fixed ? kFixed32 : t.dtype;
  t.wsize = wire_size(t.wire);
  const uint64_t bs = t.bs;
  if (bs < 1 || bs > 65535 ||
      bs * t.wsize + kHeaderBytes + kBitmapBytes + kLaneBytes > size_t(kMaxDatagram))
    throw std::runtime_error("omnireduce: block_size " + std::to_string(bs) +
                             " does not fit in one datagram");
  const int64_t nb = num_blocks(t.numel, int64_t(bs));
  if (nb < 1 || nb >= int64_t(kInf))
    throw std::runtime_error("omnireduce: tensor size out of range");
  t.nblocks = uint32_t(nb);
  uint64_t slots = uint64_t(aggs_.size()) * slots_per_agg();
  if (t.max_slots) slots = std::min<uint64_t>(slots, t.max_slots);
  const Layout geo = layout(uint64_t(nb), t.bs, uint32_t(t.wsize), uint64_t(payload_), slots);
  t.lanes = geo.lanes;
  t.nslots = geo.nslots;
  const uint32_t L = t.nslots * t.lanes;
  if (t.by_rows) {
    for (int64_t k = 0; k < t.nrows; ++k)
      if (t.rows[k] < 0 || t.rows[k] >= nb || (k && t.rows[k] <= t.rows[k - 1]))
        throw std::runtime_error("omnireduce: rows must be distinct, ascending and below " +
                                 std::to_string(nb) + "; row " + std::to_string(k) + " is " +
                                 std::to_string(t.rows[k]));
    index_blocks(t, L, t.nrows, [&](int64_t k) { return uint64_t(t.rows[k]); }, true);
    return;
  }
  auto nonzero = [&](uint32_t b) {  // the mask's, or a scan of the input's
    if (mask) return mask[b] != 0;
    const int64_t n = std::min<int64_t>(t.bs, t.numel - int64_t(b) * t.bs);
    return (block_bits(t.in + size_t(b) * t.bs * t.esize, n, t.esize) &
            magnitude_bits(t.esize)) != 0;
  };
  std::vector<uint32_t> nz;  // the non-zero blocks, ascending
  for (uint32_t b = 0; b < t.nblocks; ++b)
    if (nonzero(b)) nz.push_back(b);
  index_blocks(t, L, int64_t(nz.size()), [&](int64_t k) { return uint64_t(nz[size_t(k)]); },
               false);
}

// Opens every slot of a new tensor at round 0 (position 0 of every non-empty lane).
void Engine::start(TensorW& t, double now) {
  if (by_id_.count(t.id))
    throw std::runtime_error("omnireduce: tensor '" + t.name + "' is already in flight");
  by_id_[t.id] = &t;
  t.slots.resize(t.nslots);
  t.remaining = t.nslots;
  for (uint32_t k = 0; k < aggs_.size(); ++k) t.lowest.push_back(k);  // slot g is on g % K
  for (uint32_t g = 0; g < t.nslots; ++g) {
    SlotW& s = t.slots[g];
    s.g = g;
    s.agg = int(g % aggs_.size());
    s.cur.resize(t.lanes);
    s.cursor.resize(t.lanes);
    for (uint32_t l = 0; l < t.lanes; ++l) {
      s.cur[l] = stream_length(g, l, t.nblocks, t.nslots, t.lanes) ? 0 : kInf;
      s.cursor[l] = t.start[g * t.lanes + l];
    }
    s.progress_at = now;
    build_data(t, s);
    offer(t, s, now);
  }
}

// A slot whose next DATA is built. Its first round goes now if the window allows and no
// lower-keyed slot waits, else it waits; later rounds, and its tensor's lowest unfinished slot
// there, always go (engine.h: why the window admits slots, not rounds).
void Engine::offer(TensorW& t, SlotW& s, double now) {
  AggregatorPath& a = aggs_[s.agg];
  const std::pair<uint64_t, uint32_t> key{t.id, s.g};
  if (s.round > 0 || t.lowest[s.agg] == s.g ||
      ((a.ready.empty() || key < *a.ready.begin()) && a.inflight < a.cwnd && paced(a, now))) {
    transmit(t, s, now);
  } else {
    s.queued = true;
    a.ready.insert(key);
  }
}

void Engine::transmit(TensorW& t, SlotW& s, double now) {
  AggregatorPath& a = aggs_[s.agg];
  if (s.queued) a.ready.erase({t.id, s.g});  // the lowest slot leaves the queue early
  s.queued = false;
  // After an idle spell longer than a retransmission timeout the window no longer reflects
  // the path (the gap between two reductions): restart from the initial window, keeping the
  // threshold, as TCP does after idle (RFC 2861), instead of bursting the old window.
  if (a.inflight == 0 && a.last_send > 0 && now - a.last_send > rto_for(a) &&
      a.cwnd > kInitialWindow) {
    a.ssthresh = std::max(a.ssthresh, 0.75 * a.cwnd);
    a.cwnd = kInitialWindow;
  }
  a.last_send = now;
  s.inflight = true;
  a.inflight++;
  if (a.cwnd > kPaceAbove && a.srtt > 0)  // a window spread over a round time, 1.25x faster
    a.next_send = std::max(a.next_send, now - 1e-3) + a.srtt / (1.25 * a.cwnd);
  s.rto = rto_for(a);
  send_slot(t, s, now);
}

bool Engine::paced(const AggregatorPath& a, double now) const {
  return a.cwnd <= kPaceAbove || a.srtt == 0 || now >= a.next_send;
}

// Sends what waits for aggregator k's window, lowest key first, as far as window and pace allow.
void Engine::pump(size_t k, double now) {
  AggregatorPath& a = aggs_[k];
  while (!a.ready.empty() && a.inflight < a.cwnd && paced(a, now)) {
    auto [id, g] = *a.ready.begin();
    a.ready.erase(a.ready.begin());
    auto it = by_id_.find(id);
    if (it == by_id_.end() || !it->second->slots[g].queued) continue;  // gone, or sent
    transmit(*it->second, it->second->slots[g], now);
  }
}

// The longest a timer waits: kMaxRto, or the floor where that is set above it.
double Engine::rto_cap() const { return std::max(kMaxRto, o_.rto); }

double Engine::rto_for(const AggregatorPath& a) const {
  const double base =
      a.srtt == 0 ? o_.rto : std::clamp(a.srtt + 4 * a.rttvar, o_.rto, rto_cap());
  return std::min(base * a.backoff, rto_cap());
}

// The window's response to one answered round: RTT estimate, then AIMD growth.
void Engine::on_answer(AggregatorPath& a, SlotW& s, double now) {
  a.answered = now;
  s.inflight = false;
  a.inflight--;
  a.answered_sent_at = std::max(a.answered_sent_at, s.sent_at);
  if (!s.resent) {  // Karn: a retransmitted round's time is ambiguous
    a.backoff = 1;
    double sample = now - s.sent_at;
    if (a.srtt == 0) {
      a.srtt = sample;
      a.rttvar = sample / 2;
    } else {
      a.rttvar = 0.75 * a.rttvar + 0.25 * std::abs(a.srtt - sample);
      a.srtt = 0.875 * a.srtt + 0.125 * sample;
    }
  }
  a.cwnd = std::min(kMaxWindow, a.cwnd + (a.cwnd < a.ssthresh ? 1.0 : 1.0 / a.cwnd));
}

// A second RESULT of an answered round: the aggregator had the round's DATA twice, so the
// timer resent a round that was not lost, only slower than the timer (behind a queue on a slow
// link: a 9 KB frame takes 7 ms at 10 Mbit/s). The path's later rounds start from a doubled
// timer (once per timer period, however many duplicates come) until one is answered without
// a retransmission: with Karn's rule alone a path whose rounds all outlast the timer never
// gets a sample, and resends every round at the same short timer. A real loss brings one
// RESULT, so it keeps the timer as it was (DSACK-based detection, RFC 3708, in TCP).
void Engine::spurious(AggregatorPath& a, double now) {
  c_.spurious++;
  if (now - a.backed_off < rto_for(a)) return;
  a.backoff = std::min(a.backoff * 2, 64.0);
  a.backed_off = now;
}

// A retransmission timer fired for a round sent at `sent`. Only when a round sent later was
// answered meanwhile is that loss on the path (RACK's rule); otherwise the round may be
// waiting for a peer that has not sent it yet (a straggler submits late), which says
// nothing about congestion and must not shrink the window.
void Engine::on_timeout(AggregatorPath& a, double sent, double now) {
  if (a.answered_sent_at <= sent) return;
  if (now - a.last_cut < std::max(a.srtt, 1e-3)) return;  // one cut per round trip
  a.ssthresh = std::max(a.cwnd / 2, kMinWindow);
  a.cwnd = a.ssthresh;
  a.last_cut = now;
  a.cuts++;
}

// HELD: the aggregator had this round's DATA when the timer resent it, and the round waits for
// worker h.worker, whom a timeout of the slot then names. Timers and window stay as they are:
// on hosts short of CPU, neither undoing the window's cut (as TCP undoes cuts that DSACKs
// show spurious) nor backing the timer off made the switch faster, and backing off made its
// 1% calls take 2.2-3.9 s against 0.56-0.80 s (docs/notes/benchmarks-history.md, "HELD").
void Engine::on_held(SlotW& s, const Header& h) {
  if (s.done || !s.inflight || h.round != s.round) {
    c_.stale++;
    return;
  }
  c_.held++;
  s.waits_for = h.worker;
}

void Engine::release_window(TensorW& t) {
  for (auto& s : t.slots)
    if (s.inflight) {
      s.inflight = false;
      aggs_[s.agg].inflight--;
    }
  for (auto& a : aggs_)  // its waiting slots: a later tensor of the same id is another one
    a.ready.erase(a.ready.lower_bound({t.id, 0}), a.ready.upper_bound({t.id, UINT32_MAX}));
}

// DATA for the slot's current round: the blocks this rank holds at the lanes' positions and,
// per lane, its next non-zero position beyond.
void Engine::build_data(TensorW& t, SlotW& s) {
  uint64_t bitmap = 0;
  uint32_t present = 0;
  for (uint32_t l = 0; l < t.lanes; ++l) {
    uint32_t j = s.g * t.lanes + l;
    if (s.cur[l] != kInf && s.cursor[l] < t.start[j + 1] && t.pos[s.cursor[l]] == s.cur[l]) {
      bitmap |= uint64_t(1) << l;
      ++present;
    }
  }
  s.pkt.resize(data_bytes(t.lanes, present, t.bs, t.wire) + trailer());
  uint8_t* p = s.pkt.data();
  Header h = make_header(kData, o_.token, o_.epoch, o_.worker, o_.nworkers);
  h.dtype = t.wire;
  h.slot = s.g;
  h.tensor = t.id;
  h.round = s.round;
  h.flags = uint8_t((s.round & 1 ? kFlagShadow : 0) | auth_flag());
  h.lanes = uint16_t(t.lanes);
  h.block_size = uint16_t(t.bs);
  h.nblocks = t.nblocks;
  h.nslots = t.nslots;
  h.meta = t.meta;
  h.present = present;
  store_header(p, h);
  st64(p + kHeaderBytes, bitmap);
  uint8_t* lane = p + kHeaderBytes + kBitmapBytes;
  uint8_t* v = lane + size_t(t.lanes) * kLaneBytes;
  const size_t vb = size_t(t.bs) * t.wsize;
  for (uint32_t l = 0; l < t.lanes; ++l) {
    uint32_t j = s.g * t.lanes + l;
    if (bitmap >> l & 1) {
      uint64_t b = stream_block(s.g, l, s.cur[l], t.nslots, t.lanes);
      size_t n = size_t(std::min<int64_t>(t.bs, t.numel - int64_t(b) * t.bs));
      const uint64_t at = t.by_rows ? t.src[s.cursor[l]] : b;  // rows: packed one after another
      const uint8_t* in = t.in + at * t.bs * t.esize;
      if (t.fixed) quantize(v, in, n, t.dtype, t.exponent);
      else std::memcpy(v, in, n * t.esize);
      if (n * t.wsize < vb) std::memset(v + n * t.wsize, 0, vb - n * t.wsize);  // tail block
      v += vb;
      s.cursor[l]++;
    }
    uint32_t nxt = s.cursor[l] < t.start[j + 1] ? t.pos[s.cursor[l]] : kInf;
    st32(lane + l * kLaneBytes, s.cur[l]);
    st32(lane + l * kLaneBytes + 4, nxt);
  }
}

void Engine::send_slot(TensorW& t, SlotW& s, double now) {
  s.sent_at = now;
  t.packets++;
  t.bytes_sent += s.pkt.size();
  send_raw(s.agg, s.pkt.data(), s.pkt.size());
}

// The sequence numbers of every packet this process signs: one counter, so that two engines
// of one worker (streams) never sign two packets with one nonce.
std::atomic<uint64_t> g_seq{first_sequence_number()};

void Engine::send_raw(int agg, uint8_t* p, size_t n) {
  c_.tx_packets++;
  c_.tx_bytes += n;
  // Signed at each send: a retransmission is a new packet to the receiver's replay window.
  if (mac_) mac_->sign(p, n - kAuthBytes, o_.worker, ++g_seq);
  // A full socket buffer loses the datagram; the slot's timer resends it.
  const Datagram d{p, n, aggs_[agg].addr};
  io_.send(&d, 1);
}

void Engine::send_control(int agg, uint8_t type, uint64_t tensor, uint32_t slot) {
  Header h = make_header(type, o_.token, o_.epoch, o_.worker, o_.nworkers);
  h.flags = auth_flag();
  h.tensor = tensor;
  h.slot = slot;
  uint8_t p[kHeaderBytes + kAuthBytes];
  store_header(p, h);
  send_raw(agg, p, kHeaderBytes + trailer());
}

// Writes one block of the result, times scale. Blocks no worker sends are never written: the
// output must be zero there (the input itself in place, else fresh zeros). Rows: appended.
void Engine::write_block(TensorW& t, uint64_t b, const uint8_t* v) {
  const size_t n = size_t(std::min<int64_t>(t.bs, t.numel - int64_t(b) * t.bs));
  uint8_t* o;
  if (t.by_rows) {
    t.out_rows.push_back(int64_t(b));
    const size_t at = t.out_vals.size();
    t.out_vals.resize(at + n * t.esize);
    o = t.out_vals.data() + at;
  } else {
    o = t.out + b * size_t(t.bs) * t.esize;
  }
  if (t.fixed) dequantize(o, v, n, t.dtype, t.exponent, t.scale);
  else if (t.scale == 1.0) std::memcpy(o, v, n * t.esize);
  else scale_values(o, v, n, t.dtype, t.scale);
}

void Engine::on_result(TensorW& t, SlotW& s, const Header& h, const uint8_t* p, double now) {
  // The header matches the tensor (on_packet), so this is the slot's lane table at its lanes'
  // positions, checked as every receiver checks one.
  if (!lanes_valid(h, p, s.cur.data())) {
    c_.malformed++;
    return;
  }
  const uint8_t* lane = p + kHeaderBytes + kBitmapBytes;
  const uint64_t bitmap = ld64(p + kHeaderBytes);
  const uint8_t* v = lane + size_t(t.lanes) * kLaneBytes;
  const size_t vb = size_t(t.bs) * t.wsize;
  // OWN: a lane our DATA of this round carried that the bitmap leaves out was ours alone
  const bool own = h.flags & kFlagOwn;
  uint64_t mine = 0;
  const uint8_t* ours = nullptr;
  if (own) {
    if (s.pkt.size() < data_bytes(t.lanes, 0, t.bs, t.wire)) {  // no DATA sent: not ours
      c_.malformed++;
      return;
    }
    mine = ld64(s.pkt.data() + kHeaderBytes);
    ours = s.pkt.data() + kHeaderBytes + kBitmapBytes + size_t(t.lanes) * kLaneBytes;
    own_sum_.resize(t.bs);
    own_block_.resize(vb);
  }
  bool last = true;
  for (uint32_t l = 0; l < t.lanes; ++l) {
    uint32_t off = s.cur[l], nxt = ld32(lane + l * kLaneBytes + 4);
    if (off == kInf) continue;
    const uint64_t b = stream_block(s.g, l, off, t.nslots, t.lanes);
    if (bitmap >> l & 1) {
      write_block(t, b, v);
      v += vb;
      t.union_blocks++;
    } else if (mine >> l & 1) {  // the aggregator's sum of our block alone: 0 + x in float64
      std::fill(own_sum_.begin(), own_sum_.end(), 0.0);
      add_values(own_sum_.data(), ours, t.bs, t.wire);
      store_values(own_block_.data(), own_sum_.data(), t.bs, t.wire);
      write_block(t, b, own_block_.data());
      t.union_blocks++;
    }
    if (mine >> l & 1) ours += vb;
    s.cur[l] = nxt;
    last = last && nxt == kInf;
  }
  t.rounds++;
  t.bytes_received += h.present * vb;
  on_answer(aggs_[s.agg], s, now);
  s.round++;
  s.progress_at = now;
  s.resent = false;
  s.waits_for = -1;
  if (last) {
    s.done = true;
    if (groups_) send_control(int(s.agg), kRelease, t.id, s.g);  // frees the switch's group
    if (--t.remaining == 0) return complete(t);
    uint32_t& lo = t.lowest[s.agg];  // the next lowest may be waiting: it goes now
    while (lo < t.nslots && t.slots[lo].done) lo += uint32_t(aggs_.size());
    if (lo < t.nslots && t.slots[lo].queued) transmit(t, t.slots[lo], now);
    return;
  }
  build_data(t, s);
  offer(t, s, now);
}

void Engine::complete(TensorW& t) {
  std::vector<uint8_t> used(aggs_.size(), 0);
  for (auto& s : t.slots) used[s.agg] = 1;
  for (size_t k = 0; k < aggs_.size(); ++k)
    if (used[k]) send_control(int(k), kRelease, t.id);
  finish(t);
}

// The caller's buffers stay held (t.hold): the caller releases them (see binding.cpp).
void Engine::finish(TensorW& t) {
  t.finished = true;
  by_id_.erase(t.id);
  finished_();
}

void Engine::fail_only(TensorW& t, const std::string& why) {
  if (t.finished) return;
  t.error = "omnireduce: tensor '" + t.name + "': " + why;
  t.finished = true;
  finished_();
}

void Engine::fail(TensorW& t, const std::string& why) {
  release_window(t);
  fail_only(t, why);
  by_id_.erase(t.id);
}

void Engine::abandon(TensorW& t, const std::string& why) {
  if (!t.finished) fail(t, why);
}

void Engine::on_packet(const uint8_t* p, size_t len, const Endpoint& from, double now) {
  c_.rx_packets++;
  c_.rx_bytes += len;
  if (len < kHeaderBytes) {  // no header to read: a read of one ran past the datagram
    c_.malformed++;
    return;
  }
  Header h = load_header(p);
  const bool mac = h.flags & kFlagAuth;  // the structure is that of the packet less its trailer
  if (mac) len = len >= kHeaderBytes + kAuthBytes ? len - kAuthBytes : 0;
  if (check_structure(h, len) || h.token != o_.token) {
    c_.malformed++;
    return;
  }
  if (mac != bool(mac_)) {  // authenticated jobs take only tags, others none (no key to check)
    (mac ? c_.bad_mac : c_.unauthenticated)++;
    return;
  }
  if (mac_) {  // from one of our aggregators, under its sender id, and never seen before
    size_t k = 0;
    while (k < aggs_.size() && !(from == aggs_[k].addr)) ++k;
    uint64_t seq = 0;
    if (k == aggs_.size()) {
      c_.foreign++;
      return;
    }
    if (!mac_->verify(p, len + kAuthBytes, kAggregatorSender + uint32_t(k), seq)) {
      c_.bad_mac++;
      return;
    }
    if (!windows_[k].accept(seq)) {
      c_.replayed++;
      return;
    }
  }
  if (h.epoch != o_.epoch) {  // another membership's (an address reused since): not ours
    c_.stale_epoch++;
    return;
  }
  // Registration replies: REGACK, or an ERROR refusing the job (never a tensor's error).
  if (h.type == kRegAck || (h.type == kError && h.round == kErrJob) ||
      (h.type == kError && registering_ && (h.round == kErrCapacity || h.round == kErrUnsupported)))
    return on_registration(h, from, now);
  auto it = by_id_.find(h.tensor);
  // None: a late duplicate of a finished tensor.
  if (it == by_id_.end()) {
    c_.stale++;
    return;
  }
  TensorW& t = *it->second;
  if (h.slot >= t.nslots) {
    c_.malformed++;
    return;
  }
  SlotW& s = t.slots[h.slot];
  if (!(from == aggs_[s.agg].addr)) {  // results and errors come from the slot's aggregator only
    c_.foreign++;
    return;
  }
  if (h.type == kError)
    return fail(t, error_text(h.round) + " (reported by aggregator " + aggs_[s.agg].name + ")");
  if (h.type == kHeld) return on_held(s, h);
  if (h.type != kResult) {
    c_.malformed++;
    return;
  }
  if (h.dtype != t.wire || h.lanes != t.lanes || h.block_size != t.bs || h.nblocks != t.nblocks ||
      h.nslots != t.nslots) {
    c_.malformed++;
    return;
  }
  // A duplicate or a retransmitted result.
  if (s.done || h.round != s.round) {
    c_.stale++;
    if (h.round < s.round) spurious(aggs_[s.agg], now);
    return;
  }
  on_result(t, s, h, p, now);
}

// A REGACK or a refusal from the aggregator at `from`.
void Engine::on_registration(const Header& h, const Endpoint& from, double now) {
  for (size_t k = 0; k < aggs_.size() && k < acked_.size(); ++k) {
    if (!(from == aggs_[k].addr)) continue;
    if (h.type == kRegAck) {
      acked_[k] = 1;
      aggs_[k].heard = now;
      on_regack(load_regack(h));
      continue;
    }
    reg_error_ =
        "omnireduce: aggregator " + aggs_[k].name + " refused the job: " +
        (h.round == kErrJob ? "the worker count differs from its --workers, or the job is not "
                              "installed"
         : h.round == kErrCapacity ? "it serves as many jobs as it can hold"
                                   : "more workers than it can count (a switch counts " +
                                         std::to_string(kSwitchMaxWorkers) + ")");
  }
}

// A switch's REGACK: a tensor lays out no more slots than the job's groups there, and no packet
// carries more values than one of its slots holds (the smallest, over several switches).
void Engine::on_regack(const RegAck& a) {
  if (a.groups) groups_ = groups_ ? std::min(groups_, a.groups) : a.groups;
  const uint64_t bytes = a.slot_bytes();
  if (bytes == 0 || (geometry_.slot_bytes() && geometry_.slot_bytes() <= bytes)) return;
  geometry_ = {0, a.values_per_pass, a.cells_per_slot};
  payload_ = std::min<int64_t>(o_.payload, int64_t(bytes));
}

std::string Engine::error_text(uint32_t code) const {
  switch (code) {
    case kErrMismatch:
      return "tensor mismatch across ranks: the ranks disagree on its shape, dtype or size";
    case kErrOverflow:
      return "fixed-point overflow: a sum left the int32 range (the ranks disagree on the "
             "tensor's scale)";
    case kErrUnsupported: {
      const uint64_t bytes =
          geometry_.slot_bytes()
              ? geometry_.slot_bytes()
              : RegAck{0, kSwitchValuesPerPass, kSwitchCellsPerSlot}.slot_bytes();
      return "the switch cannot aggregate it (it sums only fixed point, and at most " +
             (bytes % 1024 ? std::to_string(bytes) + " bytes"
                           : std::to_string(bytes / 1024) + " KiB") +
             " of values per packet)";
    }
    default:
      return "the aggregator's capacity is reached (its memory, or this job's share: "
             "--max-job-bytes, --max-tensors)";
  }
}

void Engine::check_timers(double now) {
  std::vector<std::pair<TensorW*, std::string>> failed;
  for (auto& [id, t] : by_id_) {
    for (auto& s : t->slots) {
      if (s.done) continue;
      if (now - s.progress_at > o_.timeout) {
        const AggregatorPath& a = aggs_[s.agg];
        // What tells a dead aggregator from a late peer: whether it answered anything lately.
        char heard[64] = "never";
        if (a.answered > 0) std::snprintf(heard, sizeof heard, "%.1f s ago", now - a.answered);
        const uint32_t done = t->nslots - t->remaining;
        failed.emplace_back(t, "no result from aggregator " + a.name + " for " +
                                   std::to_string(int(o_.timeout)) + " s (slot " +
                                   std::to_string(s.g) + ", round " + std::to_string(s.round) +
                                   (s.inflight ? ", sent"
                                    : s.queued ? ", waiting for the "
                                                 "window"
                                               : ", not sent") +
                                   ", " + std::to_string(a.inflight) + " in flight of a " +
                                   "window of " + std::to_string(int(a.cwnd)) +
                                   "; it last answered a round " + heard + ", " +
                                   std::to_string(done) + " of " + std::to_string(t->nslots) +
                                   " slots of this tensor done): " +
                                   (s.waits_for >= 0
                                        ? "it holds this rank's DATA of the round and waits for "
                                          "rank " + std::to_string(s.waits_for) +
                                              "'s: that rank has not submitted this tensor, or "
                                              "is stalled"
                                        : "the aggregator is down or a peer rank has not "
                                          "submitted this tensor"));
        break;
      }
      if (s.inflight && now - s.sent_at > s.rto) {
        s.resent = true;
        t->retransmits++;
        c_.retransmits++;
        on_timeout(aggs_[s.agg], s.sent_at, now);
        // Backoff, jittered so that slots lost together are not resent together.
        s.rto = std::min(s.rto * (2 + 0.5 * unif_(rng_)), rto_cap());
        send_slot(*t, s, now);
      }
    }
  }
  for (auto& [t, why] : failed) {
    t->timed_out = true;
    fail(*t, why);
  }
}

void Engine::tick(double now) {
  if (now - last_timers_ > 1e-3) {
    check_timers(now);
    last_timers_ = now;
  }
  for (size_t k = 0; k < aggs_.size(); ++k) pump(k, now);
  if (last_keepalive_ == 0) last_keepalive_ = now;
  if (now - last_keepalive_ > kKeepalive) {  // aggregators forget jobs idle for long
    for (size_t k = 0; k < aggs_.size(); ++k) send_control(int(k), kRegister, 0, uint32_t(k));
    last_keepalive_ = now;
  }
}

bool Engine::pacing() const {
  for (auto& a : aggs_)
    if (!a.ready.empty()) return true;
  return false;
}

void Engine::begin_registration() {
  acked_.assign(aggs_.size(), 0);
  reg_error_.clear();
  registering_ = true;
}

bool Engine::register_step() {
  if (!reg_error_.empty()) throw std::runtime_error(reg_error_);
  bool all = true;
  for (size_t k = 0; k < aggs_.size(); ++k) {
    if (acked_[k]) continue;
    all = false;
    send_control(int(k), kRegister, 0, uint32_t(k));  // its index: the aggregator's sender id
  }
  return all;
}

std::string Engine::unregistered() const {
  std::string missing;
  for (size_t k = 0; k < aggs_.size(); ++k)
    if (k >= acked_.size() || !acked_[k]) missing += (missing.empty() ? "" : ", ") + aggs_[k].name;
  return missing;
}

void Engine::close() {
  for (size_t k = 0; k < aggs_.size(); ++k) send_control(int(k), kBye, 0);
  for (auto& [id, t] : by_id_) fail_only(*t, "the worker was closed");
  by_id_.clear();
}

std::vector<std::pair<const char*, uint64_t>> Engine::counters() const {
  std::vector<std::pair<const char*, uint64_t>> v;
#define HS_PAIR(n) v.emplace_back(#n, c_.n);
  HS_WORKER_COUNTERS(HS_PAIR)
#undef HS_PAIR
  return v;
}

}  // namespace hvd_sparse::omni

// The worker side of the aggregation protocol (docs/PROTOCOL.md) as a state machine, without
// threads, locks or torch: tensors are split into slots and streamed round by round, RESULTs
// are written into the output, windows and timers decide what goes when. worker.h runs it on a
// thread with a transport; binding.cpp is its Python face (hvd_sparse._C.OmniWorker).
//
// For each tensor it streams, slot by slot, only the blocks this rank holds non-zero, writes
// each round's RESULT straight into the output and announces its next non-zero position, so a
// slot advances past blocks that are zero on every worker without anyone sending them. Each
// outstanding packet has a retransmission timer from the measured round times (srtt + 4
// rttvar, doubling while unanswered, and for the path's next rounds too once a resend proves
// spurious, until a round comes back without a retransmission); a slot that makes no progress
// for `timeout` seconds fails its tensor with an error naming the aggregator. Tensors are
// keyed by an id every rank derives from the name, so ranks may submit them in any order and
// any number may be in flight.
//
// Congestion control, per aggregator: a window of DATA packets in flight, AIMD on loss (TCP Reno's
// rule: +1 packet per window answered, halved at most once per round trip when a retransmission
// timer fires while a later round was answered), paced over the round time once the window is
// large, restarted at the initial window after idle. Loss, not delay, is the signal: a round's time
// includes waiting for the slowest worker, which on a loaded host is mostly CPU scheduling, so
// delay says little about the path. The window admits slots, not rounds: a slot's first round waits
// for it, in (tensor id, slot) order, and its later rounds go as soon as the previous one is
// answered (a slot has one round in flight at a time, so the window still bounds the packets in
// flight). Every rank thus starts slots in the same order and keeps each started slot going, so the
// slots a rank has started are started at every rank with a window at least as large, and the
// smallest window's slots always complete. (Gating every round, in arrival order, let ranks whose
// windows differed fill them with rounds their peers had queued behind their own: each waited on
// another, only the lowest slot moved, and at 8 workers rounds went unanswered for the whole
// timeout.) The lowest unfinished slot of each tensor on each aggregator always goes, which keeps
// every tensor moving whatever the windows and submission orders of the other ranks (that slot is
// the same on every rank and never waits on a later one).
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "../auth.h"
#include "../protocol.h"
#include "../transport/transport.h"

namespace hvd_sparse::omni {

// An aggregator did not answer within the timeout (a tensor's slot, or registration): the one
// failure after which the schemes treat aggregation as down (hvd_sparse._C.AggregatorTimeout).
struct AggregatorTimeout : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// One aggregator as this worker sees it: its address and the congestion state of the path.
struct AggregatorPath {
  Endpoint addr;
  std::string name;
  double srtt = 0, rttvar = 0;       // round time and its deviation, from unretransmitted rounds
  double cwnd = 8, ssthresh = 4096;  // the initial window, and slow start up to the maximum
  int64_t inflight = 0;              // DATA packets sent and not yet answered
  double last_cut = 0;               // when the window was last halved
  double backoff = 1;                // the timer's multiplier since the last clean sample
  double backed_off = 0;             // when it last doubled
  double answered_sent_at = 0;       // latest send time of an answered round
  double next_send = 0;              // pacing: earliest time of the next send
  double last_send = 0;              // when its latest DATA went out (idle restart)
  double answered = 0;               // when it last answered a round (0: never)
  uint64_t cuts = 0;
  double heard = 0;  // when its latest REGACK came (keep-alives: it is up); 0: never
  std::set<std::pair<uint64_t, uint32_t>> ready;  // (tensor, slot) waiting for the window
};

struct SlotW {
  uint32_t g = 0;
  int agg = 0;
  uint32_t round = 0;
  std::vector<uint32_t> cur;     // per lane: position of the round in flight
  std::vector<uint32_t> cursor;  // per lane: index into the stream's non-zero positions
  std::vector<uint8_t> pkt;      // the DATA packet in flight (resent on timeout)
  double sent_at = 0, rto = 0, progress_at = 0;
  int32_t waits_for = -1;  // the worker a HELD said the round in flight waits for (-1: none)
  bool done = false, resent = false;
  bool inflight = false, queued = false;  // its DATA is out / waits for the window
};

// One tensor's reduction. The caller fills the first group; the engine the rest.
struct TensorW {
  uint64_t id = 0;
  std::string name;
  std::shared_ptr<void> hold;  // keeps the caller's buffers alive; released by the caller
  const uint8_t* in = nullptr;
  uint8_t* out = nullptr;  // the input itself, or zeros: only blocks some worker sends are written
  uint8_t dtype = 0;       // the tensor's own dtype (input and output)
  int64_t numel = 0;
  uint32_t bs = 0, meta = 0;
  double scale = 1.0;
  // Fixed point (docs/PROTOCOL.md): values travel as int32 q = round(x * 2^exponent), results
  // come back as q * 2^-exponent; the exponent must be the same on every rank.
  bool fixed = false;
  int exponent = 0;

  // Rows (a row is a block; the protocol is unchanged): `in` holds only the blocks listed in
  // `rows` (ascending, distinct), one after another, and results are appended to
  // out_rows/out_vals instead of written at their place in `out`: nothing table-sized on the
  // worker, neither to scan nor to zero.
  uint32_t max_slots = 0;  // at most this many slots (0: slots per aggregator x aggregators)
  bool by_rows = false;
  const int64_t* rows = nullptr;  // null when nrows is 0
  int64_t nrows = 0;
  std::vector<int64_t> out_rows;
  std::vector<uint8_t> out_vals;

  uint8_t wire = 0;          // the dtype of DATA and RESULT: `dtype`, or kFixed32
  int esize = 4, wsize = 4;  // bytes per element of the tensor, and on the wire
  uint32_t nblocks = 0, nslots = 0, lanes = 0;
  std::vector<uint32_t> start, pos;  // CSR: non-zero positions of each stream
  std::vector<uint32_t> src;         // rows: each position's index into `rows` (pos's order)
  std::vector<SlotW> slots;
  std::vector<uint32_t> lowest;  // per aggregator: its lowest unfinished slot (always sent)
  uint32_t remaining = 0;
  bool finished = false;
  std::string error;
  bool timed_out = false;  // the error is an aggregator's silence (AggregatorTimeout)
  uint64_t packets = 0, bytes_sent = 0, bytes_received = 0, retransmits = 0, rounds = 0,
           union_blocks = 0, nnz_local = 0;
};

// Defaults: hvd_sparse/config.py's Config (payload_bytes, slots, rto); the binding's are these.
struct EngineOptions {
  uint64_t token = 0;
  uint32_t epoch = 1;  // the job's membership this worker belongs to (docs/PROTOCOL.md)
  uint16_t worker = 0, nworkers = 1;
  int64_t payload = 64512;     // bytes of block values per packet (63 float32 blocks of 256)
  int64_t slots_per_agg = 64;  // packets each tensor keeps in flight per aggregator
  double rto = 0.05;           // floor of the retransmission timeout
  double timeout = 30.0;       // no progress for this long fails a tensor
  uint64_t seed = 0;
  // The job's key (auth.h, kKeyBytes): every packet either way is authenticated under it, and
  // what fails (no tag, a bad tag, a replay) is dropped and counted. Empty: no authentication
  // (a switch; an isolated fabric).
  std::string key;
};

// clang-format off
#define HS_WORKER_COUNTERS(X) X(tx_packets) X(tx_bytes) X(rx_packets) X(rx_bytes) \
  X(retransmits) X(spurious) X(held) X(malformed) X(stale) X(foreign) X(unauthenticated) \
  X(bad_mac) X(replayed) X(stale_epoch)
// clang-format on

class Engine {
 public:
  // `finished` is called whenever a tensor finishes or fails.
  Engine(std::vector<AggregatorPath> aggs, const EngineOptions& o, Transport& io,
         std::function<void()> finished);

  // Derives the tensor's geometry and indexes its non-zero blocks (`t.rows`, else `mask`: one
  // byte per block, else a scan of the input). Throws std::runtime_error on a block size or
  // tensor size the protocol cannot carry, or rows out of order or range.
  void prepare(TensorW& t, const uint8_t* mask) const;
  // Opens every slot of a prepared tensor and sends what the windows allow. Throws
  // std::runtime_error when a tensor of that id is already in flight.
  void start(TensorW& t, double now);
  // Fails a tensor not finished yet (abandoned by its caller); idempotent.
  void abandon(TensorW& t, const std::string& why);

  void on_packet(const uint8_t* p, size_t len, const Endpoint& from, double now);
  // Timers (retransmissions, no-progress failures), paced sends, keepalives.
  void tick(double now);
  // Whether paced sends wait: the caller should tick again within the millisecond.
  bool pacing() const;

  // Registration: REGISTER to every aggregator not acknowledged yet; true once all have, or
  // throws std::runtime_error with an aggregator's refusal.
  bool register_step();
  void begin_registration();
  void end_registration() { registering_ = false; }
  std::string unregistered() const;  // names of the aggregators that have not acknowledged

  // BYE to every aggregator and every tensor failed: the worker is closing.
  void close();

  size_t inflight() const { return by_id_.size(); }
  // Bytes of block values per packet: the configured payload, capped at what one slot of a
  // switch holds once its REGACK said so.
  int64_t payload() const { return payload_; }
  // Slots a tensor may lay out per aggregator: the configured number, times the factor a
  // switch's REGACK cut each packet by (the same bytes in flight in smaller packets), at most
  // the job's groups there.
  uint64_t slots_per_agg() const {
    const uint64_t cut = uint64_t(std::max<int64_t>(1, o_.payload / payload_));
    const uint64_t n = uint64_t(o_.slots_per_agg) * cut;
    return groups_ ? std::min<uint64_t>(groups_, n) : uint64_t(o_.slots_per_agg);
  }
  // The slot geometry a switch's REGACK gave (groups left 0), or zeros: no per-slot cap.
  RegAck slot_geometry() const { return geometry_; }
  const std::vector<AggregatorPath>& aggregators() const { return aggs_; }
  double rto_for(const AggregatorPath& a) const;
  double rto_cap() const;
  std::vector<std::pair<const char*, uint64_t>> counters() const;

 private:
  void offer(TensorW& t, SlotW& s, double now);
  void transmit(TensorW& t, SlotW& s, double now);
  bool paced(const AggregatorPath& a, double now) const;
  void pump(size_t k, double now);
  void on_answer(AggregatorPath& a, SlotW& s, double now);
  void on_timeout(AggregatorPath& a, double sent, double now);
  void spurious(AggregatorPath& a, double now);
  void on_held(SlotW& s, const Header& h);
  void release_window(TensorW& t);
  void build_data(TensorW& t, SlotW& s);
  void send_slot(TensorW& t, SlotW& s, double now);
  // Sends `n` bytes, the trailer's room included when authenticated (trailer() bytes at the
  // end, which it fills).
  void send_raw(int agg, uint8_t* p, size_t n);
  size_t trailer() const { return mac_ ? kAuthBytes : 0; }
  uint8_t auth_flag() const { return mac_ ? kFlagAuth : 0; }
  void send_control(int agg, uint8_t type, uint64_t tensor, uint32_t slot = 0);
  void write_block(TensorW& t, uint64_t b, const uint8_t* v);
  void on_result(TensorW& t, SlotW& s, const Header& h, const uint8_t* p, double now);
  void on_registration(const Header& h, const Endpoint& from, double now);
  void on_regack(const RegAck& a);
  std::string error_text(uint32_t code) const;
  void complete(TensorW& t);
  void finish(TensorW& t);
  void fail_only(TensorW& t, const std::string& why);
  void fail(TensorW& t, const std::string& why);
  void check_timers(double now);

  const EngineOptions o_;
  Transport& io_;
  std::function<void()> finished_;
  std::unique_ptr<Mac> mac_;
  std::vector<ReplayWindow> windows_;  // per aggregator
  std::mt19937_64 rng_;
  std::uniform_real_distribution<double> unif_{0.0, 1.0};
  std::vector<AggregatorPath> aggs_;
  std::unordered_map<uint64_t, TensorW*> by_id_;
  std::vector<uint8_t> acked_;
  std::string reg_error_;
  bool registering_ = false;
  // A switch's REGACK carries how many slot groups the job owns (0 from software aggregators):
  // a tensor never uses more slots than that, and releases each slot as it completes. It
  // carries the slot geometry too, which caps the payload.
  uint32_t groups_ = 0;
  RegAck geometry_;
  int64_t payload_;
  double last_timers_ = 0, last_keepalive_ = 0;
  // on_result's scratch for a lane flagged OWN: our block summed as the aggregator sums it
  std::vector<double> own_sum_;
  std::vector<uint8_t> own_block_;
  struct {
#define HS_DECL(n) uint64_t n = 0;
    HS_WORKER_COUNTERS(HS_DECL)
#undef HS_DECL
  } c_;
};

}  // namespace hvd_sparse::omni

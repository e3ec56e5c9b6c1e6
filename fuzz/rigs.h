// How each packet-decoder target builds the component it feeds from its configuration bytes:
// one definition for the targets (fuzz/*.cpp) and for the seed generator (fuzz/seeds.cpp),
// which runs the same components against each other to record real exchanges as seeds.
#pragma once
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "harness.h"
#include "omni/aggregator/core.h"
#include "omni/halfconv.h"
#include "omni/worker/engine.h"
#include "switch/pipeline.h"

namespace fuzz {

inline std::vector<uint8_t> control_packet(uint8_t type, uint64_t token, uint16_t worker,
                                           uint16_t nworkers, uint32_t slot = 0,
                                           uint64_t tensor = 0) {
  Header h = make_header(type, token, kEpoch, worker, nworkers);
  h.slot = slot;
  h.tensor = tensor;
  std::vector<uint8_t> b(kHeaderBytes);
  store_header(b.data(), h);
  return b;
}

// The aggregator core (aggregator_core.cpp). Configuration byte: bits 0-1 the job's workers
// less one; bit 2 authenticated (a secret: every datagram must carry a MAC); bit 3 the job is
// not registered first (the fuzzer's own REGISTERs make it); bit 4 the aggregator takes only
// jobs of that many workers (--workers). Memory and tensor caps are small, so that the fuzzer
// reaches them (and a run's memory stays bounded).
struct AggregatorConfig {
  unsigned n;
  bool auth, preregister;
  CoreOptions o;
  explicit AggregatorConfig(uint8_t cfg)
      : n(1 + (cfg & 3)), auth(cfg & 4), preregister(!(cfg & 8)) {
    o.workers = cfg & 16 ? int(n) : 0;
    o.max_slot_bytes = size_t(48) << 20;
    o.max_job_bytes = size_t(32) << 20;
    o.max_tensors = 8;
    o.max_jobs = 4;
    if (auth) o.secret = kSecret;
  }
};

// The switch's pipeline (switch_pipeline.cpp). Configuration byte: bits 0-1 the job's workers
// less one; bits 2-3 the register geometry (values per pass, cells per slot); bit 4 the job is
// installed with its workers' hosts (bound); bit 5 automatic installs (the job is then not
// installed first: its REGISTERs install it); bit 6 the job is not registered first; bit 7 a
// job of 2 slot groups instead of 6 (groups are shared, bound and reclaimed more).
struct SwitchConfig {
  unsigned n;
  bool bound, automatic, preregister;
  uint32_t groups;
  PipelineOptions o;
  explicit SwitchConfig(uint8_t cfg)
      : n(1 + (cfg & 3)), bound(cfg & 16), automatic(cfg & 32), preregister(!(cfg & 64)),
        groups(cfg & 128 ? 2 : 6) {
    static constexpr uint32_t kGeometry[4][2] = {{64, 1}, {4, 2}, {16, 4}, {1, 3}};
    o.values_per_pass = kGeometry[cfg >> 2 & 3][0];
    o.cells_per_slot = kGeometry[cfg >> 2 & 3][1];
    o.cells = 16 * o.cells_per_slot;  // 16 groups: a job of 6 and the fuzzer's own installs
    o.max_workers = 8;
    o.auto_groups = automatic ? groups : 0;
  }
  void install(Pipeline& sw, double now) const {
    if (automatic) return;
    std::vector<uint32_t> ips;
    if (bound)
      for (unsigned k = 0; k < n; ++k) ips.push_back(peer(k).ip4());
    sw.install(kToken, uint16_t(n), groups, now, ips);
  }
};

// A transport that keeps what the engine sends, for the caller to check and route.
struct Outbox : Transport {
  struct Sent {
    Endpoint to;
    std::vector<uint8_t> bytes;
  };
  std::vector<Sent> sent;
  size_t recv(std::vector<Datagram>& in, size_t) override {
    in.clear();
    return 0;
  }
  void send(const Datagram* d, size_t n) override {
    for (size_t i = 0; i < n; ++i) sent.push_back({d[i].peer, {d[i].data, d[i].data + d[i].len}});
  }
  void wait(int, int) override {}
  Endpoint local() const override { return {}; }
  TransportCounters counters() const override { return {}; }
};

// The worker engine (worker_engine.cpp) with two tensors in flight: one scanned from its
// input, one submitted by rows. Its aggregators are peers 0 and 1. Configuration bytes:
//   first:  bits 0-1 the dtype (float32, float64, float16, bfloat16); bit 2 fixed point; bit 3
//           authenticated (the job's key); bit 4 two aggregators; bits 5-6 the job's workers
//           less one (this engine is the last of them); bit 7 registration still open while
//           the tensors run (its ERRORs then refuse the job rather than fail a tensor);
//   second: bits 0-1 the block size (4, 8, 16, 5); bits 2-3 the lanes a packet holds (1, 2,
//           4, 64); bits 4-5 slots per aggregator (1, 2, 4, 64); bit 6 every block non-zero;
//           bit 7 a fixed-point exponent so large that values clamp and sums overflow.
struct EngineRig {
  static constexpr uint64_t kTensor = 77, kRowsTensor = 78;
  static constexpr uint32_t kBlocks = 13;  // and a partial tail block
  unsigned naggs, nworkers, worker;
  bool auth, fixed, registering;
  std::string key;
  EngineOptions o;
  Outbox io;
  std::unique_ptr<Engine> engine;
  std::vector<uint8_t> in, out, rows_in;
  std::vector<int64_t> rows;
  TensorW t, r;

  EngineRig(uint8_t c0, uint8_t c1, int worker_id = -1)
      : naggs(c0 & 16 ? 2 : 1), nworkers(1 + (c0 >> 5 & 3)),
        worker(worker_id < 0 ? nworkers - 1 : unsigned(worker_id)), auth(c0 & 8), fixed(c0 & 4),
        registering(c0 & 128) {
    static constexpr uint32_t kBs[4] = {4, 8, 16, 5}, kLanes[4] = {1, 2, 4, 64},
                              kSlots[4] = {1, 2, 4, 64};
    const uint8_t dtype = c0 & 3;  // blocks.h: kF32, kF64, kF16, kBF16
    const uint32_t bs = kBs[c1 & 3];
    const int wsize = fixed ? 4 : dtype_size(dtype);
    o.token = kToken;
    o.worker = uint16_t(worker);
    o.nworkers = uint16_t(nworkers);
    o.payload = int64_t(kLanes[c1 >> 2 & 3]) * bs * wsize;
    o.slots_per_agg = kSlots[c1 >> 4 & 3];
    o.rto = 0.05;
    o.timeout = 30;
    o.seed = 1;
    if (auth) o.key = key = derive_job_key(kSecret, kToken);
    std::vector<AggregatorPath> aggs(naggs);
    for (unsigned k = 0; k < naggs; ++k) {
      aggs[k].addr = peer(k);
      aggs[k].name = "peer" + std::to_string(k);
    }
    engine = std::make_unique<Engine>(std::move(aggs), o, io, [] {});
    // Blocks non-zero in a pattern that differs by worker, values small enough for the
    // fixed-point exponent below.
    const bool all = c1 & 64;
    const int esize = dtype_size(dtype);
    const int64_t numel = int64_t(kBlocks) * bs + bs / 2 + 1;
    in.assign(size_t(numel) * esize, 0);
    out.assign(in.size(), 0);
    auto held = [&](uint64_t b) { return all || (b * 7 + worker * 3) % 5 < 2; };
    auto put = [&](uint8_t* p, int64_t i, double v) {
      if (dtype == kF32) { const float f = float(v); std::memcpy(p + 4 * i, &f, 4); }
      else if (dtype == kF64) std::memcpy(p + 8 * i, &v, 8);
      else {  // float16, bfloat16
        const uint16_t h = dtype == kBF16 ? float_to_bf16(float(v)) : float_to_f16(float(v));
        std::memcpy(p + 2 * i, &h, 2);
      }
    };
    for (int64_t i = 0; i < numel; ++i)
      if (held(uint64_t(i) / bs)) put(in.data(), i, double((i % 13) + 1 + worker));
    for (uint64_t b = 0; b <= kBlocks; ++b)
      if (held(b) && b % 2 == worker % 2) rows.push_back(int64_t(b));
    rows_in.assign(rows.size() * bs * esize, 0);
    for (size_t k = 0; k < rows.size() * bs; ++k) put(rows_in.data(), int64_t(k), double(k % 7 + 1));
    for (TensorW* x : {&t, &r}) {
      x->dtype = dtype;
      x->bs = bs;
      x->meta = 9;
      x->fixed = fixed;
      x->exponent = c1 & 128 ? 28 : 8;
      x->scale = 1.0 / nworkers;
    }
    t.id = kTensor;
    t.name = "scanned";
    t.in = in.data();
    t.out = out.data();
    t.numel = numel;
    r.id = kRowsTensor;
    r.name = "rows";
    r.by_rows = true;
    r.in = rows_in.data();
    r.rows = rows.empty() ? nullptr : rows.data();
    r.nrows = int64_t(rows.size());
    r.numel = numel;
  }

  // Registration (REGISTER to every aggregator), then both tensors start at `now`.
  void start(double now) {
    engine->begin_registration();
    engine->register_step();
    if (!registering) engine->end_registration();
    engine->prepare(t, nullptr);
    engine->start(t, now);
    engine->prepare(r, nullptr);
    engine->start(r, now);
  }

  // The timers, and registration's REGISTERs while it is open (a refusal throws, as
  // register_step does for its caller).
  void tick(double now) {
    engine->tick(now);
    if (registering) {
      try {
        engine->register_step();
      } catch (const std::runtime_error&) {
      }
    }
  }

  bool finished() const { return t.finished && r.finished; }
};

}  // namespace fuzz

// Seeds for the packet-decoder targets, recorded from real exchanges (fuzz/seeds.py builds
// and runs this): worker engines built as the worker target builds its own (rigs.h,
// EngineRig) reduce their two tensors through aggregator cores or a switch pipeline built as
// those targets build theirs, and every datagram is written, in harness.h's script format, as
// what its receiver got:
//   aggregator_core/, switch_pipeline/: what aggregator 0 (or the switch) received;
//   worker_engine/: what the last worker received (the worker target's engine is that one);
//   dissector/: every datagram both ways (fuzz/dissector.py's format: control bit 0 set for
//     datagrams to the aggregator, bits 1-2 the worker).
// Datagrams are recorded as sent, trailers and all, and flagged "seal" in authenticated jobs:
// the targets sign them again, with the sequence numbers they carry. The time between steps
// is recorded too (harness.h, kAdvance), so that timers and HELD replay as they happened.
//
//   seeds OUTDIR
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>

#include "rigs.h"

using namespace fuzz;

namespace {

struct Recording {
  std::vector<uint8_t> bytes;
  size_t limit = SIZE_MAX;  // steps beyond it are not recorded (seeds stay a few KB)
  double clock = 0;         // the time a target replaying the steps has reached

  void config(uint8_t c) { bytes.push_back(c); }
  // A step received `t` seconds into the exchange: its advance is the largest of kAdvance
  // that keeps the replay's clock at or behind the exchange's.
  void step(uint8_t ctl, const uint8_t* p, size_t n, double t) {
    if (bytes.size() + 3 + n > limit) {
      limit = 0;
      return;
    }
    unsigned adv = 0;
    for (unsigned i = 1; i < 8; ++i)
      if (clock + kAdvance[i] <= t) adv = i;
    clock += kAdvance[adv];
    bytes.push_back(uint8_t((ctl & ~0x38) | adv << 3));
    bytes.push_back(uint8_t(n));
    bytes.push_back(uint8_t(n >> 8));
    bytes.insert(bytes.end(), p, p + n);
  }
  void write(const std::string& path) const {
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                                std::streamsize(bytes.size()));
  }
};

struct Exchange {
  uint8_t c0, c1, component;  // the engines' configuration bytes, the component's
  bool to_switch;
  std::string name;
  bool fails = false;  // its tensors fail (an overflow)
  double lossy = 0;    // seconds for which worker 0's DATA are lost (its peers get HELD)
};

// Runs one exchange to its end (both tensors reduced or failed, BYEs sent), for at most a few
// simulated seconds; returns whether it ended as expected.
bool run(const Exchange& x, const std::string& out) {
  const unsigned n = 1 + (x.c0 >> 5 & 3);
  std::vector<std::unique_ptr<EngineRig>> rigs;
  for (unsigned w = 0; w < n; ++w) rigs.push_back(std::make_unique<EngineRig>(x.c0, x.c1, int(w)));
  const unsigned naggs = rigs[0]->naggs;
  std::vector<std::unique_ptr<Aggregation>> comps;
  double now = 1000;
  const double start = now;
  for (unsigned k = 0; k < naggs; ++k) {
    if (x.to_switch) {
      const SwitchConfig cfg(x.component);
      auto sw = std::make_unique<Pipeline>(cfg.o);
      cfg.install(*sw, now);
      comps.push_back(std::move(sw));
    } else {
      comps.push_back(std::make_unique<AggregatorCore>(AggregatorConfig(x.component).o));
    }
  }
  const bool auth = rigs[0]->auth;
  Recording comp, worker, dissect;
  dissect.limit = 2048;
  comp.limit = worker.limit = 8192;
  comp.config(x.component);
  worker.config(x.c0);
  worker.config(x.c1);
  for (auto& r : rigs) r->start(now);
  auto route = [&](unsigned w) {
    std::vector<Outbox::Sent> sent;
    sent.swap(rigs[w]->io.sent);
    const double t = now - start;
    for (const Outbox::Sent& s : sent) {
      const int k = peer_index(s.to, naggs);
      if (k < 0 || (w == 0 && t < x.lossy && s.bytes[5] == kData)) continue;
      if (k == 0) comp.step(control(w, auth), s.bytes.data(), s.bytes.size(), t);
      dissect.step(uint8_t(1 | w << 1), s.bytes.data(), s.bytes.size(), t);
      std::vector<Out> out;
      comps[size_t(k)]->handle(s.bytes.data(), s.bytes.size(), peer(w), now, out);
      for (const Out& o : out) {
        const int to = peer_index(o.to, n);
        if (to < 0) continue;
        const uint8_t* r = o.bytes->data();
        if (unsigned(to) == n - 1) worker.step(control(unsigned(k), auth), r, o.bytes->size(), t);
        dissect.step(uint8_t(to << 1), r, o.bytes->size(), t);
        rigs[size_t(to)]->engine->on_packet(r, o.bytes->size(), peer(unsigned(k)), now);
      }
    }
  };
  bool done = false;
  for (int i = 0; i < 5000 && !done; ++i) {
    for (unsigned w = 0; w < n; ++w) route(w);
    done = true;
    for (auto& r : rigs) done = done && r->finished() && r->io.sent.empty();
    now += 1e-3;
    for (auto& r : rigs) r->tick(now);
  }
  bool ok = true;
  for (auto& r : rigs) ok = ok && r->finished() && r->t.error.empty() == !x.fails;
  for (auto& r : rigs) r->engine->close();
  for (unsigned w = 0; w < n; ++w) route(w);
  const std::string comp_dir = x.to_switch ? "/switch_pipeline/" : "/aggregator_core/";
  comp.write(out + comp_dir + x.name);
  worker.write(out + "/worker_engine/" + x.name);
  dissect.write(out + "/dissector/" + x.name);
  std::printf("%-22s %s: %zu + %zu + %zu bytes%s\n", x.name.c_str(),
              x.to_switch ? "switch" : "aggregator", comp.bytes.size(), worker.bytes.size(),
              dissect.bytes.size(), ok ? "" : "  (did not end as expected)");
  return ok;
}

// Engine configuration bytes (rigs.h EngineRig): c0 = dtype | fixed << 2 | auth << 3 |
// two aggregators << 4 | (workers - 1) << 5; c1 = block size | lanes << 2 | slots << 4 |
// all blocks << 6 | overflowing exponent << 7.
constexpr uint8_t engine0(unsigned dtype, bool fixed, bool auth, bool two, unsigned n) {
  return uint8_t(dtype | (fixed ? 4 : 0) | (auth ? 8 : 0) | (two ? 16 : 0) | (n - 1) << 5);
}
constexpr uint8_t engine1(unsigned bs, unsigned lanes, unsigned slots, bool all = false,
                          bool overflow = false) {
  return uint8_t(bs | lanes << 2 | slots << 4 | (all ? 64 : 0) | (overflow ? 128 : 0));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: seeds OUTDIR\n");
    return 2;
  }
  const std::string out = argv[1];
  // Aggregator byte (rigs.h AggregatorConfig): workers - 1 | auth << 2; switch byte
  // (SwitchConfig): workers - 1 | geometry << 2 | bound << 4, the geometry holding the packets
  // (16 values x 1 lane in 64 x 1, 16 x 4 lanes in 16 x 4, 8 x 1 lane in 4 x 2).
  const Exchange all[] = {
      {engine0(0, false, false, false, 2), engine1(0, 1, 1), 0x01, false, "f32-2w"},
      {engine0(0, false, true, false, 2), engine1(1, 2, 1), 0x05, false, "f32-2w-auth"},
      {engine0(1, false, false, false, 3), engine1(3, 1, 0), 0x02, false, "f64-3w"},
      {engine0(2, false, true, true, 2), engine1(0, 1, 1), 0x05, false, "f16-2w-2aggs-auth"},
      {engine0(3, false, false, false, 1), engine1(2, 0, 2, true), 0x00, false, "bf16-1w"},
      {engine0(0, true, false, false, 2), engine1(1, 3, 0), 0x01, false, "fixed32-2w"},
      {engine0(0, false, false, false, 4), engine1(0, 2, 2), 0x03, false, "f32-4w"},
      {engine0(0, true, false, false, 2), engine1(2, 0, 1), 0x11, true, "switch-64x1-2w"},
      {engine0(0, true, false, false, 3), engine1(2, 2, 0), 0x1A, true, "switch-16x4-3w"},
      {engine0(1, true, false, false, 2), engine1(1, 0, 1), 0x05, true, "switch-4x2-2w"},
      // sums beyond int32: ERROR OVERFLOW
      {engine0(0, true, false, false, 2), engine1(1, 3, 0, true, true), 0x01, false,
       "fixed32-overflow-2w", true},
      {engine0(0, true, false, false, 2), engine1(2, 0, 1, true, true), 0x11, true,
       "switch-overflow-2w", true},
      // worker 0's DATA lost for 1.2 s: the others' resends are answered HELD
      {engine0(0, false, true, false, 3), engine1(0, 1, 1), 0x06, false, "f32-3w-held-auth",
       false, 1.2},
      {engine0(0, true, false, false, 3), engine1(2, 0, 1), 0x12, true, "switch-held-3w", false,
       1.2},
  };
  bool ok = true;
  for (const Exchange& x : all) ok = run(x, out) && ok;
  return ok ? 0 : 1;
}

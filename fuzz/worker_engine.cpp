// Fuzz target: the worker engine's packet decoder, Engine::on_packet
// (csrc/omni/worker/engine.cpp), fed a script of datagrams (fuzz/harness.h) from its
// aggregators (peers 0 and 1) and from strangers while two tensors are in flight (fuzz/rigs.h:
// one scanned from its input, one by rows), so that REGACK, RESULT, HELD and ERROR are parsed
// against real slots, rounds and lane positions and RESULT blocks are written into the output.
// Timers run on the steps flagged "tick". Every datagram the engine sends must be well formed,
// go to one of its aggregators, and in an authenticated job carry a valid tag.
#include <stdexcept>

#include "rigs.h"

using namespace fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Script in(data, size);
  const uint8_t c0 = in.config(), c1 = in.config();
  EngineRig rig(c0, c1);
  std::unique_ptr<Mac> mac = rig.auth ? std::make_unique<Mac>(rig.key) : nullptr;
  auto check = [&] {
    for (const Outbox::Sent& o : rig.io.sent) {
      if (peer_index(o.to, rig.naggs) < 0)
        die("sent a datagram to no aggregator", o.bytes.data(), o.bytes.size());
      check_sent(o.bytes.data(), o.bytes.size(), rig.auth, mac.get(), rig.worker);
    }
    rig.io.sent.clear();
  };
  double now = 1000;
  uint64_t seq = 0;
  try {
    rig.start(now);
  } catch (const std::runtime_error&) {  // a geometry the protocol cannot carry: not a finding
    return 0;
  }
  check();
  Step s;
  while (in.next(s)) {
    now += advance(s.ctl);
    const Endpoint from = sender(s.ctl, rig.naggs);
    if (rig.auth && sealed(s.ctl)) {
      const int k = peer_index(from, rig.naggs);
      seal(s.bytes, *mac, kAggregatorSender + uint32_t(k < 0 ? 0 : k), seq);
    }
    rig.engine->on_packet(s.bytes.data(), s.bytes.size(), from, now);
    if (ticks(s.ctl)) rig.tick(now);
    check();
  }
  rig.engine->close();
  check();
  return 0;
}

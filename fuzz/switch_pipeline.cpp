// Fuzz target: the emulated switch's data plane, Pipeline::handle (csrc/switch/pipeline.cpp),
// fed a script of datagrams (fuzz/harness.h). The job is installed and its workers registered
// first (as the configuration says, fuzz/rigs.h), so that the fuzzer's DATA binds slot
// groups, sums, completes and recirculates rather than stopping at the unknown-job reject. A
// step flagged "seal" (the switch has no authentication) is a control-plane command instead:
// its first byte chooses install (of the token and sizes in the next bytes) or remove, as the
// control socket would run them between datagrams. Every datagram the switch sends must be
// well formed, and go to a worker's pinned address.
#include <stdexcept>

#include "rigs.h"

using namespace fuzz;

namespace {

void command(Pipeline& sw, const std::vector<uint8_t>& b, double now) {
  if (b.size() < 9) return;
  const uint64_t token = b[1] & 1 ? kToken : ld64(b.data() + 1);
  if (b[0] & 1) {
    sw.remove(token);
    return;
  }
  const uint16_t nworkers = b.size() > 9 ? b[9] : 1;
  const uint32_t groups = b.size() > 10 ? b[10] : 1;
  try {
    sw.install(token, nworkers, groups, now);
  } catch (const std::runtime_error&) {  // over a limit: refused, as documented
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Script in(data, size);
  const SwitchConfig cfg(in.config());
  Pipeline sw(cfg.o);
  double now = 1000;
  std::vector<Out> out;
  auto deliver = [&](const std::vector<uint8_t>& b, const Endpoint& from) {
    out.clear();
    sw.handle(b.data(), b.size(), from, now, out);
    for (const Out& o : out) {
      check_sent(o.bytes->data(), o.bytes->size(), false);
      if (!o.to.port) die("sent a datagram to no address", o.bytes->data(), o.bytes->size());
    }
  };
  cfg.install(sw, now);
  if (cfg.preregister)
    for (unsigned w = 0; w < cfg.n; ++w)
      deliver(control_packet(kRegister, kToken, uint16_t(w), uint16_t(cfg.n)), peer(w));
  Step s;
  while (in.next(s)) {
    now += advance(s.ctl);
    if (sealed(s.ctl)) command(sw, s.bytes, now);
    else deliver(s.bytes, sender(s.ctl, cfg.n));
    if (ticks(s.ctl)) sw.expire(now);
    if (sw.occupied() > cfg.o.cells / cfg.o.cells_per_slot) die("more groups bound than exist", data, 0);
  }
  return 0;
}

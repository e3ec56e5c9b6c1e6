// Fuzz target: the aggregator's packet decoder and state machine, AggregatorCore::handle
// (csrc/omni/aggregator/core.cpp), fed a script of datagrams (fuzz/harness.h) from the job's
// workers and from strangers. The job's workers are registered first (unless the
// configuration says otherwise, fuzz/rigs.h), so that the fuzzer's DATA reaches slots, rounds,
// sums and RESULTs rather than only the unknown-job reject. Besides the sanitizers' findings,
// every datagram the core sends must be well formed and, in an authenticated job, carry a
// valid tag.
#include "rigs.h"

using namespace fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Script in(data, size);
  const AggregatorConfig cfg(in.config());
  AggregatorCore core(cfg.o);
  Keys keys(kSecret);
  double now = 1000;
  uint64_t seq = 0;
  std::vector<Out> out;
  // The aggregator's sender id in each job, as its REGACKs tell (the index every REGISTER
  // carries in `slot`; a REGACK means the job's index is the REGISTER's)
  std::map<uint64_t, uint32_t> sender_in;
  auto deliver = [&](const std::vector<uint8_t>& b, const Endpoint& from) {
    out.clear();
    core.handle(b.data(), b.size(), from, now, out);
    const bool reg = b.size() >= kHeaderBytes && b[5] == kRegister;
    for (const Out& o : out) {
      const std::vector<uint8_t>& p = *o.bytes;
      if (p.size() < kHeaderBytes) die("sent a datagram shorter than the header", p.data(), 0);
      const uint64_t token = ld64(p.data() + 8);
      uint32_t id = kAggregatorSender;
      if (reg) {  // the answer to a REGISTER is signed as the aggregator it names
        id += ld32(b.data() + 20);
        if (p[5] == kRegAck) sender_in[token] = id;
      } else if (sender_in.count(token)) {
        id = sender_in[token];
      } else if (cfg.auth) {
        die("answered a job it never acknowledged", p.data(), p.size());
      }
      // what a worker checks: the job's key, the aggregator's sender id
      check_sent(p.data(), p.size(), cfg.auth, cfg.auth ? &keys.job(token) : nullptr, id);
    }
  };
  if (cfg.preregister)
    for (unsigned w = 0; w < cfg.n; ++w) {
      std::vector<uint8_t> b = control_packet(kRegister, kToken, uint16_t(w), uint16_t(cfg.n));
      if (cfg.auth) seal(b, keys.job(kToken), w, seq);
      deliver(b, peer(w));
    }
  Step s;
  while (in.next(s)) {
    now += advance(s.ctl);
    if (cfg.auth && sealed(s.ctl) && s.bytes.size() >= kHeaderBytes)
      seal(s.bytes, keys.job(ld64(s.bytes.data() + 8)), ld16(s.bytes.data() + 16), seq);
    deliver(s.bytes, sender(s.ctl, cfg.n));
    if (ticks(s.ctl)) core.expire(now);
  }
  return 0;
}

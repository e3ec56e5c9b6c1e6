// What sums the workers' packets, whatever does it: the software aggregator's core
// (aggregator/core.h, AggregatorCore) or the emulated switch's data plane
// (csrc/switch/pipeline.h, Pipeline). Both speak docs/PROTOCOL.md with no I/O: a datagram
// goes in, the datagrams to send come out. Their processes (aggregator/main.cpp,
// csrc/switch/main.cpp) and their Python bindings (hvd_sparse._C.Aggregation, the base of
// AggregatorCore and SwitchPipeline) drive them through this face.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "transport/transport.h"  // Endpoint

namespace hvd_sparse::omni {

// A datagram to send: shared, since one RESULT goes to every worker of the job.
struct Out {
  Endpoint to;
  std::shared_ptr<const std::vector<uint8_t>> bytes;
};

class Aggregation {
 public:
  virtual ~Aggregation() = default;

  // Handles one datagram from `from` received at time `now` (seconds, any monotonic clock);
  // appends what must be sent to `out`.
  virtual void handle(const uint8_t* p, size_t len, const Endpoint& from, double now,
                      std::vector<Out>& out) = 0;
  // Forgets what has been idle too long (workers died, or their RELEASE or BYE was lost).
  virtual void expire(double now) = 0;
  // (name, value) of every counter.
  virtual std::vector<std::pair<const char*, uint64_t>> counters() const = 0;
};

}  // namespace hvd_sparse::omni

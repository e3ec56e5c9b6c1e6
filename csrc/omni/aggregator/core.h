// The aggregator's protocol logic (docs/PROTOCOL.md), without I/O: a packet goes in, the packets
// to send come out. Jobs, tensors, slots with their shadow copies, validation and the float64
// sums live here; sockets, DPDK, threads and main() do not (main.cpp, ../transport/). Tests
// drive it directly, with no socket (hvd_sparse._C.AggregatorCore).
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../aggregation.h"

namespace hvd_sparse::omni {

struct CoreOptions {
  int workers = 0;    // 0: jobs of any size; else only jobs of exactly this many workers
  double idle = 120;  // seconds after which an idle tensor or job is forgotten
  size_t max_slot_bytes = size_t(2) << 30;  // cap on the accumulators' memory, all jobs
  size_t max_jobs = 256;
  // One job's share, so that no job starves the others: accumulator memory, and tensors in
  // flight. A tensor over either fails with ERROR CAPACITY; other jobs go on.
  size_t max_job_bytes = size_t(1) << 30;
  size_t max_tensors = 4096;
  // The deployment's secret (--secret-file): when set, every packet must carry a valid MAC
  // under its job's key (auth.h) and unauthenticated ones are dropped; when empty, none may.
  std::string secret;
};

// What the core counted; printed by the aggregator with its transports' counters. stale_epoch:
// packets of a job's earlier membership, dropped; memberships: jobs whose state a newer
// membership's REGISTER replaced.
// clang-format off
#define HS_CORE_COUNTERS(X) X(rounds) X(retransmits) X(duplicates) X(stale) X(malformed) \
  X(unknown_job) X(mismatch) X(overflow) X(jobs) X(tensors) X(released) X(expired) X(foreign) \
  X(unauthenticated) X(bad_mac) X(replayed) X(own_results) X(stale_epoch) X(memberships)
// clang-format on

class AggregatorCore final : public Aggregation {
 public:
  explicit AggregatorCore(const CoreOptions& o);
  ~AggregatorCore() override;

  // Thread-safe (one lock).
  void handle(const uint8_t* p, size_t len, const Endpoint& from, double now,
              std::vector<Out>& out) override;
  // Forgets tensors and jobs idle for longer than `idle`.
  void expire(double now) override;
  std::vector<std::pair<const char*, uint64_t>> counters() const override;
  size_t active_jobs();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace hvd_sparse::omni

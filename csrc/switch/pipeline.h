// The aggregation program's data plane (hvd_sparse/tools/switch/program.py declares it as a P4-like
// pipeline and checks it against the switch's limits): what the emulated switch does with a
// datagram addressed to its aggregation endpoint. Same protocol as the software aggregator
// (docs/PROTOCOL.md), within a switch's means:
//
// - integer arithmetic only: values are FIXED32, summed with saturating adds; a saturated sum
//   sets the round's overflow register and the round answers ERROR OVERFLOW, never a wrapped
//   sum;
// - a fixed register pool: `cells` cells of `values_per_pass` int32 (one pass of the pipe
//   each), every cell with two register sets (the round in progress and its shadow, the
//   previous round's result, which answers retransmissions); a protocol slot takes a group of
//   `cells_per_slot` cells, and a job owns a range of groups (installed by the control plane
//   or, with `auto_groups`, at its first REGISTER);
// - a packet of n values takes ceil(n / values_per_pass) passes (at least one per lane: a pass
//   runs one lane's look-ahead minimum); every pass after the first is a recirculation;
// - at most `max_workers` workers per job: the seen-bitmap is one 32-bit register;
// - a group is bound to a (tensor, slot) by a tag register when round 0 arrives at a free
//   group (the group index is a hash of the tensor id plus the slot within the job's range):
//   another tensor's round 0 finding it bound is dropped ("busy") and resent by its worker's
//   timer. Workers free a group with a per-slot RELEASE after its last RESULT; a completed
//   group whose RELEASEs were lost is reclaimed after `hold` seconds, and a group left
//   mid-round (its workers dead or gone elsewhere: nothing touched it for `abandon` seconds)
//   by the next round 0 that needs it;
// - each worker of an installed job is bound to the address the control plane gave for it:
//   a REGISTER in its name from another address is dropped (the switch's ports check that the
//   address arrives from its host's port and MAC, ports.h);
// - a REGACK tells each worker the job's groups and the slot geometry (values per pass, cells
//   per slot), so that it sends no packet larger than a slot holds.
//
// No I/O and no clock here: packets in, packets out (csrc/switch/main.cpp frames them),
// time passed in. hvd_sparse._C.SwitchPipeline drives it from tests.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../omni/aggregation.h"
#include "../omni/protocol.h"

namespace hvd_sparse::omni {

// Defaults: the switch geometry of protocol.h.
struct PipelineOptions {
  uint32_t cells = kSwitchCells;                    // pool cells (program.py: aggregation slots)
  uint32_t values_per_pass = kSwitchValuesPerPass;  // int32 values one pass sums
  uint32_t cells_per_slot = kSwitchCellsPerSlot;    // a slot's cells: its largest packet, in passes
  uint32_t max_workers = kSwitchMaxWorkers;         // at most the seen-bitmap's bits
  uint32_t auto_groups = 0;  // groups for a job that REGISTERs uninstalled (0: refuse it)
  double hold = 2.0;         // seconds before a completed, unreleased group is reclaimed
  double abandon = 10.0;     // seconds before a group untouched mid-round is reclaimed
  double idle = 120.0;       // an auto-installed job idle this long is removed
};

// clang-format off
#define HS_PIPELINE_COUNTERS(X) X(packets) X(passes) X(recirculations) X(results)          \
  X(retransmits) X(duplicates) X(stale) X(busy) X(malformed) X(unknown_job) X(mismatch)   \
  X(overflow) X(unsupported) X(reclaimed) X(abandoned) X(released) X(jobs) X(refused)     \
  X(foreign) X(occupied_us) X(round_wait_us) X(own_results) X(stale_epoch) X(memberships)
// clang-format on
// occupied_us: the integral over time of the groups bound to a slot (slot-microseconds; its
// increase over an interval / the interval: the mean slots in flight, SwitchML's pool in use).
// round_wait_us: summed over completed rounds, the time from a round's first DATA to its last
// (the wait for the slowest worker; its increase / results: the mean).
// own_results: RESULT copies sent as the header alone (flag OWN) to a round's only holder.
// stale_epoch: packets of a job's earlier membership, dropped; memberships: jobs a later
// membership replaced (installed again, or re-installed by its REGISTER when automatic).

struct SwitchJob {
  uint64_t token = 0;
  uint32_t epoch = 1;  // the membership installed (docs/PROTOCOL.md "Memberships")
  uint16_t nworkers = 0;
  uint32_t first = 0, groups = 0;  // its range of slot groups
  bool automatic = false;          // installed by its first REGISTER, removed by its BYEs
  std::vector<Endpoint> addr;      // the multicast group: worker -> where its results go
  std::vector<uint32_t> ips;       // installed: worker -> its host's IPv4 (empty: automatic)
  uint32_t bye = 0;
  double touched = 0;
};

class Pipeline final : public Aggregation {
 public:
  explicit Pipeline(const PipelineOptions& o);
  ~Pipeline() override;

  // Control plane. install() takes a range of `groups` slot groups (first fit) for the job and
  // returns its first group; it throws std::runtime_error naming the limit it would exceed.
  // `ips` (network order, one per worker, or empty) binds each worker to its host's address.
  // A job installed at an earlier `epoch` is replaced (a new membership of the same job).
  uint32_t install(uint64_t token, uint16_t nworkers, uint32_t groups, double now,
                   const std::vector<uint32_t>& ips = {}, uint32_t epoch = 1);
  // Removes the job when installed at `epoch` or earlier (a late close of an old membership
  // leaves a newer one alone).
  bool remove(uint64_t token, uint32_t epoch = UINT32_MAX);
  std::vector<SwitchJob> jobs() const;
  void expire(double now) override;  // removes idle auto-installed jobs

  // Data plane: one datagram from `from` at time `now`; appends the datagrams to send.
  void handle(const uint8_t* p, size_t len, const Endpoint& from, double now,
              std::vector<Out>& out) override;
  std::vector<std::pair<const char*, uint64_t>> counters() const override;

  const PipelineOptions& options() const;
  uint32_t occupied() const;  // groups bound to a slot now

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace hvd_sparse::omni

// The worker engine at work: a background thread that owns the transport (kernel UDP) and
// runs the protocol's state machine (engine.h) under one lock, while callers submit tensors
// and wait on tickets. Torch-free; binding.cpp is its Python face.
#pragma once
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../transport/transport.h"
#include "engine.h"

namespace hvd_sparse::omni {

struct WorkerOptions : EngineOptions {
  double drop_rate = 0, dup_rate = 0;  // test hooks: lose received datagrams, send some twice
  int port_lo = 0, port_hi = 0;        // the socket's port range (HVD_SPARSE_PORTS); 0: any
};

class Worker {
 public:
  // Resolves the aggregators ("host", port), opens the transport and starts the thread.
  Worker(const std::vector<std::pair<std::string, int>>& aggs, const WorkerOptions& o);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Joins the job on every aggregator; blocks until each has acknowledged, or throws naming
  // the ones that did not within `timeout` seconds (or the one that refused).
  void register_all(double timeout);
  // Starts reducing a tensor (its first fields filled; `mask`: one byte per block or nullptr,
  // read before returning). Returns its ticket.
  int64_t submit(std::unique_ptr<TensorW> t, const uint8_t* mask);
  bool poll(int64_t ticket);
  // Blocks until the ticket finishes or `timeout` passes; returns whether it finished.
  bool wait(int64_t ticket, double timeout);
  // Forgets a ticket (failing it first if the caller gave up on it) and hands its tensor back:
  // its error, counters and the caller's buffers (t->hold), for the caller to release.
  std::unique_ptr<TensorW> take(int64_t ticket);

  struct Stats {
    std::vector<std::pair<const char*, uint64_t>> counters;
    std::vector<AggregatorPath> paths;  // the congestion state toward each aggregator
    std::vector<double> rto;
  };
  Stats stats();
  // The engine's payload(), slot_geometry() and slots_per_agg(): what registration learnt
  // from a switch.
  int64_t payload();
  RegAck slot_geometry();
  uint64_t slots_per_agg();
  // The UDP port of the worker's socket (host order).
  int local_port() const { return ntohs(io_->local().port); }
  // BYE to the aggregators; fails what is in flight; joins the thread. Idempotent.
  void close();

 private:
  void loop();
  void wake();

  std::unique_ptr<Transport> io_;  // UDP, wrapped in Lossy when the test hooks are on
  std::unique_ptr<Engine> engine_;
  int wake_ = -1;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  int64_t next_ticket_ = 0;
  std::unordered_map<int64_t, std::unique_ptr<TensorW>> tickets_;
};

}  // namespace hvd_sparse::omni

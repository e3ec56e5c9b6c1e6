// A transport that loses, duplicates and reorders datagrams on purpose, around any other: the
// loss-recovery tests run the real aggregator and workers through it, on any transport.
#pragma once
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "transport.h"

namespace hvd_sparse::omni {

struct LossRates {
  double drop_in = 0, drop_out = 0;  // probability a received / sent datagram vanishes
  double dup_in = 0, dup_out = 0;    // ... is delivered / sent twice
  double reorder = 0;                // ... of a received batch swaps with a random other
  bool any() const {
    return drop_in > 0 || drop_out > 0 || dup_in > 0 || dup_out > 0 || reorder > 0;
  }
};

class Lossy : public Transport {
 public:
  Lossy(std::unique_ptr<Transport> inner, const LossRates& r, uint64_t seed)
      : inner_(std::move(inner)), r_(r), rng_(seed) {}

  size_t recv(std::vector<Datagram>& in, size_t max) override {
    inner_->recv(got_, max);
    in.clear();
    for (const Datagram& d : got_) {
      if (hit(r_.drop_in)) {
        AtomicCounters::add(c_.injected_drops, 1);
        continue;
      }
      in.push_back(d);
      if (hit(r_.dup_in)) {
        AtomicCounters::add(c_.injected_dups, 1);
        in.push_back(d);
      }
    }
    if (r_.reorder > 0)
      for (size_t i = 0; i < in.size(); ++i)
        if (hit(r_.reorder)) std::swap(in[i], in[rng_() % in.size()]);
    return in.size();
  }

  void send(const Datagram* out, size_t n) override {
    out_.clear();
    for (size_t i = 0; i < n; ++i) {
      if (hit(r_.drop_out)) {
        AtomicCounters::add(c_.injected_drops, 1);
        continue;
      }
      out_.push_back(out[i]);
      if (hit(r_.dup_out)) {
        AtomicCounters::add(c_.injected_dups, 1);
        out_.push_back(out[i]);
      }
    }
    inner_->send(out_.data(), out_.size());
  }

  void wait(int timeout_ms, int wake_fd = -1) override { inner_->wait(timeout_ms, wake_fd); }
  Endpoint local() const override { return inner_->local(); }
  double now() const override { return inner_->now(); }
  TransportCounters counters() const override {
    TransportCounters c = inner_->counters();
    c += c_.load();
    return c;
  }

 private:
  bool hit(double p) { return p > 0 && u_(rng_) < p; }
  std::unique_ptr<Transport> inner_;
  LossRates r_;
  std::mt19937_64 rng_;
  std::uniform_real_distribution<double> u_{0.0, 1.0};
  std::vector<Datagram> got_, out_;
  AtomicCounters c_;
};

}  // namespace hvd_sparse::omni

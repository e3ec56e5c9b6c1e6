#include "worker.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <stdexcept>

#include "../transport/lossy.h"
#include "../transport/udp/transport.h"

namespace hvd_sparse::omni {
namespace {

AggregatorPath resolve(const std::string& host, int port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || !res)
    throw std::runtime_error("omnireduce: cannot resolve aggregator " + host + ": " +
                             gai_strerror(rc));
  AggregatorPath a;
  a.addr = {reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr.s_addr, htons(uint16_t(port))};
  a.name = host + ":" + std::to_string(port);
  freeaddrinfo(res);
  return a;
}

}  // namespace

Worker::Worker(const std::vector<std::pair<std::string, int>>& aggs, const WorkerOptions& o) {
  std::vector<AggregatorPath> paths;
  for (auto& [host, port] : aggs) paths.push_back(resolve(host, port));
  try {
    if (o.port_lo > 0)
      io_ = UdpTransport::in_range(0, o.port_lo, o.port_hi, false);
    else
      io_ = std::make_unique<UdpTransport>(Endpoint{}, false);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("omnireduce: ") + e.what());
  }
  LossRates loss;
  loss.drop_in = o.drop_rate;
  loss.dup_out = o.dup_rate;
  if (loss.any()) io_ = std::make_unique<Lossy>(std::move(io_), loss, o.seed ^ 0x9E3779B97F4A7C15);
  engine_ = std::make_unique<Engine>(std::move(paths), o, *io_, [this] { cv_.notify_all(); });
  wake_ = eventfd(0, EFD_NONBLOCK);
  thread_ = std::thread([this] { loop(); });
}

Worker::~Worker() { close(); }

void Worker::wake() {
  uint64_t one = 1;
  (void)!write(wake_, &one, sizeof one);
}

void Worker::register_all(double timeout) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    engine_->begin_registration();
  }
  struct Done {
    Worker* w;
    ~Done() {
      std::lock_guard<std::mutex> lock(w->mu_);
      w->engine_->end_registration();
    }
  } done{this};
  const double deadline = monotonic_s() + timeout;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (engine_->register_step()) return;
      if (monotonic_s() > deadline)
        throw AggregatorTimeout("omnireduce: aggregator(s) " + engine_->unregistered() +
                                 " did not answer registration within " + std::to_string(timeout) +
                                 " s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

int64_t Worker::submit(std::unique_ptr<TensorW> t, const uint8_t* mask) {
  engine_->prepare(*t, mask);  // reads only the tensor and the engine's constants
  std::lock_guard<std::mutex> lock(mu_);
  engine_->start(*t, monotonic_s());
  const int64_t ticket = ++next_ticket_;
  tickets_[ticket] = std::move(t);
  wake();
  return ticket;
}

bool Worker::poll(int64_t ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) throw std::runtime_error("omnireduce: unknown ticket");
  return it->second->finished;
}

bool Worker::wait(int64_t ticket, double timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) throw std::runtime_error("omnireduce: unknown ticket");
  TensorW* t = it->second.get();
  cv_.wait_for(lock, std::chrono::duration<double>(timeout), [t] { return t->finished; });
  return t->finished;
}

std::unique_ptr<TensorW> Worker::take(int64_t ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) throw std::runtime_error("omnireduce: unknown ticket");
  engine_->abandon(*it->second, "abandoned by the caller");  // no-op once finished
  std::unique_ptr<TensorW> t = std::move(it->second);
  tickets_.erase(it);
  return t;
}

Worker::Stats Worker::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  Stats s;
  s.counters = engine_->counters();
  s.counters.emplace_back("injected_drops", io_->counters().injected_drops);
  s.counters.emplace_back("inflight", engine_->inflight());
  s.paths = engine_->aggregators();
  for (auto& a : s.paths) s.rto.push_back(engine_->rto_for(a));
  return s;
}

int64_t Worker::payload() {
  std::lock_guard<std::mutex> lock(mu_);
  return engine_->payload();
}

RegAck Worker::slot_geometry() {
  std::lock_guard<std::mutex> lock(mu_);
  return engine_->slot_geometry();
}

uint64_t Worker::slots_per_agg() {
  std::lock_guard<std::mutex> lock(mu_);
  return engine_->slots_per_agg();
}

void Worker::close() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    engine_->close();
    stop_ = true;
  }
  wake();
  thread_.join();
  ::close(wake_);
  cv_.notify_all();
}

void Worker::loop() {
  std::vector<Datagram> in;
  while (true) {
    bool pacing;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pacing = engine_->pacing();  // paced sends due within the millisecond
    }
    io_->wait(pacing ? 1 : 2, wake_);
    uint64_t v;
    (void)!read(wake_, &v, sizeof v);  // non-blocking: clears a wake-up, if any
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    const double now = monotonic_s();
    io_->recv(in, 64);
    for (const Datagram& d : in) engine_->on_packet(d.data, d.len, d.peer, now);
    engine_->tick(now);
  }
}

}  // namespace hvd_sparse::omni

#include "worker.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <stdexcept>

#include "../transport/lossy.h"
#include "../transport/udp/transport.h"

namespace hvd_sparse::omni {
namespace {

// A name or literal to one address: the first IPv4 address it resolves to, else its first
// IPv6 one (so a name with both records is reached over IPv4, as before IPv6 was supported;
// hvd_sparse/session.py's probes resolve the same way, to notice a name that moved).
AggregatorPath resolve(std::string host, int port) {
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  const std::string name = (host.find(':') != std::string::npos ? "[" + host + "]" : host) +
                           ":" + std::to_string(port);
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || !res)
    throw std::runtime_error("omnireduce: cannot resolve aggregator " + name + ": " +
                             gai_strerror(rc));
  const addrinfo* pick = nullptr;
  for (const addrinfo* r = res; r && !pick; r = r->ai_next)
    if (r->ai_family == AF_INET) pick = r;
  for (const addrinfo* r = res; r && !pick; r = r->ai_next)
    if (r->ai_family == AF_INET6) pick = r;
  AggregatorPath a;
  if (pick) {
    sockaddr_storage s{};
    std::memcpy(&s, pick->ai_addr, pick->ai_addrlen);
    a.addr = Endpoint::from_sockaddr(s);
    a.addr.port = htons(uint16_t(port));
  }
  freeaddrinfo(res);
  if (!pick)
    throw std::runtime_error("omnireduce: aggregator " + name + " has no IPv4 or IPv6 address");
  if (!a.addr.is_v4() && a.addr.addr[0] == 0xfe && (a.addr.addr[1] & 0xc0) == 0x80)
    throw std::runtime_error("omnireduce: aggregator " + name +
                             " is a link-local IPv6 address (fe80::/10), which needs an "
                             "interface: give it a global or unique-local (fd00::/8) address");
  a.name = name;
  return a;
}

}  // namespace

Worker::Worker(const std::vector<std::pair<std::string, int>>& aggs, const WorkerOptions& o) {
  std::vector<AggregatorPath> paths;
  for (auto& [host, port] : aggs) paths.push_back(resolve(host, port));
  // An IPv4 socket while every aggregator is IPv4 (hosts without IPv6 keep working), else a
  // dual-stack IPv6 one, which reaches both
  bool v6 = false;
  for (const AggregatorPath& p : paths) v6 = v6 || !p.addr.is_v4();
  const Endpoint any = v6 ? Endpoint{} : Endpoint::v4(0, 0);
  try {
    if (o.port_lo > 0)
      io_ = UdpTransport::in_range(any, o.port_lo, o.port_hi, false);
    else
      io_ = std::make_unique<UdpTransport>(any, false);
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

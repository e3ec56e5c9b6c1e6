// The worker side of the aggregation protocol (docs/PROTOCOL.md), inside hvd_sparse._C.
//
// A background thread owns one UDP socket. For each submitted tensor it streams, slot by slot,
// only the blocks this rank holds non-zero, writes each round's RESULT straight into the output
// tensor and announces its next non-zero position, so a slot advances past blocks that are zero
// on every worker without anyone sending them. Each outstanding packet has a retransmission
// timer from the measured round times (srtt + 4 rttvar, doubling while unanswered); a slot that
// makes no progress for `timeout` seconds fails its tensor with an error naming the aggregator.
// Tensors are keyed by an id every rank derives from the name, so ranks may submit them in any
// order and any number may be in flight.
//
// Congestion control, per aggregator: a window of DATA packets in flight, AIMD on loss (TCP
// Reno's rule: +1 packet per window answered, halved at most once per round trip when a
// retransmission timer fires while a later round was answered), paced over the round time
// once the window is large. Loss, not delay, is the signal: a round's time includes waiting
// for the slowest worker, which on a loaded host is mostly CPU scheduling, so delay says little
// about the path. Slots beyond the window wait in a FIFO; the lowest unfinished slot of each
// tensor on each aggregator always goes, which keeps every tensor moving whatever the windows
// and submission orders of the other ranks (that slot is the same on every rank and never
// waits on a later one).
#include <torch/extension.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "../blocks.h"
#include "../torch_dtype.h"
#include "protocol.h"
#include "transport/lossy.h"
#include "transport/udp/transport.h"

namespace hvd_sparse::omni {
namespace {

using Clock = std::chrono::steady_clock;
double now_s() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

constexpr double kInitialWindow = 8, kMinWindow = 2, kMaxWindow = 4096;
constexpr double kPaceAbove = 16;  // packets: smaller windows go out at once
constexpr double kMaxRto = 1.0;

struct Aggregator {
  Endpoint addr;
  std::string name;
  double srtt = 0, rttvar = 0;  // round time and its deviation, from unretransmitted rounds
  double cwnd = kInitialWindow, ssthresh = kMaxWindow;
  int64_t inflight = 0;         // DATA packets sent and not yet answered
  double last_cut = 0;          // when the window was last halved
  double answered_sent_at = 0;  // latest send time of an answered round
  double next_send = 0;         // pacing: earliest time of the next send
  uint64_t cuts = 0;
  std::deque<std::pair<uint64_t, uint32_t>> ready;  // (tensor, slot) waiting for the window
};

struct SlotW {
  uint32_t g = 0;
  int agg = 0;
  uint32_t round = 0;
  std::vector<uint32_t> cur;     // per lane: position of the round in flight
  std::vector<uint32_t> cursor;  // per lane: index into the stream's non-zero positions
  std::vector<uint8_t> pkt;      // the DATA packet in flight (resent on timeout)
  double sent_at = 0, rto = 0, progress_at = 0;
  bool done = false, resent = false;
  bool inflight = false, queued = false;  // its DATA is out / waits for the window
};

struct TensorW {
  int64_t ticket = 0;
  uint64_t id = 0;
  std::string name;
  at::Tensor input, output;  // held until finish(): released there, with the GIL
  const uint8_t* in = nullptr;
  uint8_t* out = nullptr;
  uint8_t dtype = 0;
  int esize = 4;
  int64_t numel = 0;
  uint32_t bs = 0, nblocks = 0, nslots = 0, lanes = 0, meta = 0;
  double scale = 1.0;
  std::vector<uint32_t> start, pos;  // CSR: non-zero positions of each stream
  std::vector<SlotW> slots;
  std::vector<uint32_t> lowest;  // per aggregator: its lowest unfinished slot (always sent)
  uint32_t remaining = 0;
  bool finished = false;
  std::string error;
  uint64_t packets = 0, bytes_sent = 0, bytes_received = 0, retransmits = 0, rounds = 0,
           union_blocks = 0, nnz_local = 0;
};

constexpr double kKeepalive = 10.0;  // seconds; the aggregator's --idle default is 120

class Worker {
 public:
  Worker(const std::vector<std::pair<std::string, int>>& aggs, uint64_t token, int worker,
         int nworkers, int payload_bytes, int slots_per_agg, double rto, double timeout,
         double drop_rate, double dup_rate, uint64_t seed)
      : token_(token), worker_(uint16_t(worker)), nworkers_(uint16_t(nworkers)),
        payload_(payload_bytes), slots_per_agg_(slots_per_agg), rto_(rto), timeout_(timeout),
        rng_(seed) {
    TORCH_CHECK(!aggs.empty(), "omnireduce: no aggregators");
    TORCH_CHECK(nworkers >= 1 && nworkers <= kMaxWorkers && worker >= 0 && worker < nworkers,
                "omnireduce: bad worker id ", worker, " of ", nworkers);
    for (auto& [host, port] : aggs) aggs_.push_back(resolve(host, port));
    try {
      io_ = std::make_unique<UdpTransport>(Endpoint{}, false);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "omnireduce: ", e.what());
    }
    LossRates loss;  // test hooks: lose received datagrams, send some twice
    loss.drop_in = drop_rate;
    loss.dup_out = dup_rate;
    if (loss.any()) io_ = std::make_unique<Lossy>(std::move(io_), loss, seed ^ 0x9E3779B97F4A7C15);
    wake_ = eventfd(0, EFD_NONBLOCK);
    thread_ = std::thread([this] { loop(); });
  }

  ~Worker() { close(); }

  // Joins the job on every aggregator; blocks until each has acknowledged.
  void register_all(double timeout) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      acked_.assign(aggs_.size(), 0);
      reg_error_.clear();
      registering_ = true;
    }
    struct Done {
      Worker* w;
      ~Done() { std::lock_guard<std::mutex> lock(w->mu_); w->registering_ = false; }
    } done{this};
    double deadline = now_s() + timeout;
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!reg_error_.empty()) throw std::runtime_error(reg_error_);
        bool all = true;
        for (size_t k = 0; k < aggs_.size(); ++k) {
          if (acked_[k]) continue;
          all = false;
          send_control(int(k), kRegister, 0);
        }
        if (all) return;
      }
      if (now_s() > deadline) {
        std::string missing;
        for (size_t k = 0; k < aggs_.size(); ++k)
          if (!acked_[k]) missing += (missing.empty() ? "" : ", ") + aggs_[k].name;
        throw std::runtime_error("omnireduce: aggregator(s) " + missing + " did not answer " +
                                 "registration within " + std::to_string(timeout) + " s");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  // output: the input itself, or zeros; only blocks some worker sends are written (write_block).
  int64_t submit(uint64_t id, at::Tensor input, at::Tensor output, int64_t bs, int64_t meta,
                 std::optional<at::Tensor> mask, const std::string& name, double scale) {
    TORCH_CHECK(input.is_contiguous() && output.is_contiguous() && input.device().is_cpu() &&
                output.device().is_cpu(), "omnireduce: tensors must be contiguous CPU tensors");
    TORCH_CHECK(input.scalar_type() == output.scalar_type() && input.numel() == output.numel(),
                "omnireduce: output must match the input");
    auto t = std::make_unique<TensorW>();
    t->id = id;
    t->name = name;
    t->input = input;
    t->output = output;
    t->in = static_cast<const uint8_t*>(input.data_ptr());
    t->out = static_cast<uint8_t*>(output.data_ptr());
    t->dtype = dtype_code(input.scalar_type());
    t->esize = dtype_size(t->dtype);
    t->numel = input.numel();
    TORCH_CHECK(bs >= 1 && bs <= 65535 && size_t(bs) * t->esize + kHeaderBytes + kBitmapBytes +
                kLaneBytes <= size_t(kMaxDatagram),
                "omnireduce: block_size ", bs, " does not fit in one datagram");
    const int64_t nb = num_blocks(t->numel, bs);
    TORCH_CHECK(nb >= 1 && nb < int64_t(kInf), "omnireduce: tensor size out of range");
    t->bs = uint32_t(bs);
    t->nblocks = uint32_t(nb);
    t->meta = uint32_t(meta);
    const Layout geo = layout(uint64_t(nb), t->bs, uint32_t(t->esize), uint64_t(payload_),
                              uint64_t(aggs_.size()) * uint64_t(slots_per_agg_));
    t->lanes = geo.lanes;
    t->nslots = geo.nslots;
    t->scale = scale;
    index(*t, mask);
    {
      std::lock_guard<std::mutex> lock(mu_);
      t->ticket = ++next_ticket_;
      TORCH_CHECK(!by_id_.count(id), "omnireduce: tensor '", name, "' is already in flight");
      const int64_t ticket = t->ticket;
      start(*t);
      by_id_[id] = t.get();
      tickets_[ticket] = std::move(t);
      uint64_t one = 1;
      (void)!write(wake_, &one, sizeof one);
      return ticket;
    }
  }

  bool poll_ticket(int64_t ticket) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = tickets_.find(ticket);
    TORCH_CHECK(it != tickets_.end(), "omnireduce: unknown ticket");
    return it->second->finished;
  }

  // Blocks until the ticket finishes or `timeout` passes (returns its state).
  bool wait(int64_t ticket, double timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = tickets_.find(ticket);
    TORCH_CHECK(it != tickets_.end(), "omnireduce: unknown ticket");
    TensorW* t = it->second.get();
    cv_.wait_for(lock, std::chrono::duration<double>(timeout), [t] { return t->finished; });
    return t->finished;
  }

  // Forgets a finished ticket; returns its counters or raises its error. Called with the GIL:
  // it is released while waiting for the mutex (the background thread may hold it for a
  // while), and the tensors are released only after the mutex, with the GIL back: dropping
  // the last reference to a tensor whose Python object Python has already let go of runs
  // Python code, so it needs the GIL.
  py::dict finish(int64_t ticket) {
    std::unique_ptr<TensorW> t;
    {
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mu_);
      auto it = tickets_.find(ticket);
      TORCH_CHECK(it != tickets_.end(), "omnireduce: unknown ticket");
      if (!it->second->finished) {  // abandoned (the caller timed out): fail it first
        fail(*it->second, "abandoned by the caller");
      }
      t = std::move(it->second);
      tickets_.erase(it);
    }
    if (!t->error.empty()) throw std::runtime_error(t->error);
    py::dict d;
    d["packets"] = t->packets;
    d["bytes_sent"] = t->bytes_sent;
    d["bytes_received"] = t->bytes_received;
    d["retransmits"] = t->retransmits;
    d["rounds"] = t->rounds;
    d["union"] = t->union_blocks;
    d["nnz_local"] = t->nnz_local;
    d["lanes"] = t->lanes;
    d["nslots"] = t->nslots;
    return d;
  }

  py::dict stats() {
    std::vector<std::pair<const char*, uint64_t>> c;
    struct Window { std::string name; double cwnd, ssthresh, srtt, rto, cuts; };
    std::vector<Window> windows;
    {
      py::gil_scoped_release nogil;  // never wait for the mutex holding the GIL
      std::lock_guard<std::mutex> lock(mu_);
      c = {{"tx_packets", tx_packets_}, {"tx_bytes", tx_bytes_}, {"rx_packets", rx_packets_},
           {"rx_bytes", rx_bytes_}, {"retransmits", retransmits_}, {"malformed", malformed_},
           {"stale", stale_}, {"injected_drops", io_->counters().injected_drops}, {"inflight", by_id_.size()}};
      for (auto& a : aggs_)
        windows.push_back({a.name, a.cwnd, a.ssthresh, a.srtt, rto_for(a), double(a.cuts)});
    }
    py::dict d;
    for (auto& [k, v] : c) d[k] = v;
    py::list aggs;  // the congestion state of each aggregator's path
    for (auto& w : windows)
      aggs.append(py::dict(py::arg("name") = w.name, py::arg("window") = w.cwnd,
                           py::arg("ssthresh") = w.ssthresh, py::arg("srtt") = w.srtt,
                           py::arg("rto") = w.rto, py::arg("window_cuts") = w.cuts));
    d["aggregators"] = aggs;
    return d;
  }

  void close() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t k = 0; k < aggs_.size(); ++k) send_control(int(k), kBye, 0);
      for (auto& [id, t] : by_id_) fail_locked(*t, "the worker was closed");
      by_id_.clear();
      stop_ = true;
    }
    uint64_t one = 1;
    (void)!write(wake_, &one, sizeof one);
    thread_.join();
    io_.reset();
    ::close(wake_);
    cv_.notify_all();
  }

 private:
  static Aggregator resolve(const std::string& host, int port) {
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_DGRAM;
    int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
    TORCH_CHECK(rc == 0 && res, "omnireduce: cannot resolve aggregator ", host, ": ",
                gai_strerror(rc));
    Aggregator a;
    a.addr = {reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr.s_addr,
              htons(uint16_t(port))};
    a.name = host + ":" + std::to_string(port);
    freeaddrinfo(res);
    return a;
  }

  // CSR of the tensor's non-zero blocks by stream (counting sort: positions stay ascending).
  void index(TensorW& t, const std::optional<at::Tensor>& mask) {
    const uint32_t L = t.nslots * t.lanes;
    std::vector<uint8_t> own;
    const uint8_t* m;
    if (mask) {
      TORCH_CHECK(mask->scalar_type() == at::kByte && mask->numel() == t.nblocks &&
                  mask->is_contiguous(), "omnireduce: mask must be uint8 with one entry per block");
      m = mask->data_ptr<uint8_t>();
    } else {
      own.resize(t.nblocks);
      for (uint32_t b = 0; b < t.nblocks; ++b) {
        int64_t n = std::min<int64_t>(t.bs, t.numel - int64_t(b) * t.bs);
        own[b] = (block_bits(t.in + size_t(b) * t.bs * t.esize, n, t.esize) &
                  magnitude_bits(t.esize)) != 0;
      }
      m = own.data();
    }
    t.start.assign(L + 1, 0);
    for (uint32_t b = 0; b < t.nblocks; ++b)
      if (m[b]) { t.start[b % L + 1]++; t.nnz_local++; }
    for (uint32_t j = 0; j < L; ++j) t.start[j + 1] += t.start[j];
    t.pos.resize(t.nnz_local);
    std::vector<uint32_t> fill(t.start.begin(), t.start.end() - 1);
    for (uint32_t b = 0; b < t.nblocks; ++b)
      if (m[b]) t.pos[fill[b % L]++] = b / L;
  }

  // Opens every slot of a new tensor at round 0 (position 0 of every non-empty lane).
  void start(TensorW& t) {
    double now = now_s();
    t.slots.resize(t.nslots);
    t.remaining = t.nslots;
    for (uint32_t k = 0; k < aggs_.size(); ++k) t.lowest.push_back(k);  // slot g is on g % K
    for (uint32_t g = 0; g < t.nslots; ++g) {
      SlotW& s = t.slots[g];
      s.g = g;
      s.agg = int(g % aggs_.size());
      s.cur.resize(t.lanes);
      s.cursor.resize(t.lanes);
      for (uint32_t l = 0; l < t.lanes; ++l) {
        s.cur[l] = stream_length(g, l, t.nblocks, t.nslots, t.lanes) ? 0 : kInf;
        s.cursor[l] = t.start[g * t.lanes + l];
      }
      s.progress_at = now;
      build_data(t, s);
      offer(t, s, now);
    }
  }

  // A slot whose next DATA is built: out now if the window allows (or it is its tensor's
  // lowest unfinished slot there, which always goes), else in the aggregator's FIFO.
  void offer(TensorW& t, SlotW& s, double now) {
    Aggregator& a = aggs_[s.agg];
    if (t.lowest[s.agg] == s.g || (a.ready.empty() && a.inflight < a.cwnd && paced(a, now))) {
      transmit(t, s, now);
    } else {
      s.queued = true;
      a.ready.emplace_back(t.id, s.g);
    }
  }

  void transmit(TensorW& t, SlotW& s, double now) {
    Aggregator& a = aggs_[s.agg];
    s.queued = false;
    s.inflight = true;
    a.inflight++;
    if (a.cwnd > kPaceAbove && a.srtt > 0)  // a window spread over a round time, 1.25x faster
      a.next_send = std::max(a.next_send, now - 1e-3) + a.srtt / (1.25 * a.cwnd);
    s.rto = rto_for(a);
    send_slot(t, s, now);
  }

  bool paced(const Aggregator& a, double now) const {
    return a.cwnd <= kPaceAbove || a.srtt == 0 || now >= a.next_send;
  }

  // Sends what waits for aggregator k's window, in FIFO order, as far as window and pace allow.
  void pump(size_t k, double now) {
    Aggregator& a = aggs_[k];
    while (!a.ready.empty() && a.inflight < a.cwnd && paced(a, now)) {
      auto [id, g] = a.ready.front();
      a.ready.pop_front();
      auto it = by_id_.find(id);
      if (it == by_id_.end() || !it->second->slots[g].queued) continue;  // gone, or sent
      transmit(*it->second, it->second->slots[g], now);
    }
  }

  double rto_for(const Aggregator& a) const {
    return a.srtt == 0 ? rto_ : std::clamp(a.srtt + 4 * a.rttvar, rto_, kMaxRto);
  }

  // The window's response to one answered round: RTT estimate, then AIMD growth.
  void on_answer(Aggregator& a, SlotW& s, double now) {
    s.inflight = false;
    a.inflight--;
    a.answered_sent_at = std::max(a.answered_sent_at, s.sent_at);
    if (!s.resent) {  // Karn: a retransmitted round's time is ambiguous
      double sample = now - s.sent_at;
      if (a.srtt == 0) {
        a.srtt = sample;
        a.rttvar = sample / 2;
      } else {
        a.rttvar = 0.75 * a.rttvar + 0.25 * std::abs(a.srtt - sample);
        a.srtt = 0.875 * a.srtt + 0.125 * sample;
      }
    }
    a.cwnd = std::min(kMaxWindow, a.cwnd + (a.cwnd < a.ssthresh ? 1.0 : 1.0 / a.cwnd));
  }

  // A retransmission timer fired for a round sent at `sent`. Only when a round sent later was
  // answered meanwhile is that loss on the path (RACK's rule); otherwise the round may be
  // waiting for a peer that has not sent it yet (a straggler submits late), which says
  // nothing about congestion and must not shrink the window.
  void on_timeout(Aggregator& a, double sent, double now) {
    if (a.answered_sent_at <= sent) return;
    if (now - a.last_cut < std::max(a.srtt, 1e-3)) return;  // one cut per round trip
    a.ssthresh = std::max(a.cwnd / 2, kMinWindow);
    a.cwnd = a.ssthresh;
    a.last_cut = now;
    a.cuts++;
  }

  void release_window(TensorW& t) {
    for (auto& s : t.slots)
      if (s.inflight) {
        s.inflight = false;
        aggs_[s.agg].inflight--;
      }
  }

  // DATA for the slot's current round: the blocks this rank holds at the lanes' positions and,
  // per lane, its next non-zero position beyond.
  void build_data(TensorW& t, SlotW& s) {
    uint64_t bitmap = 0;
    uint32_t present = 0;
    for (uint32_t l = 0; l < t.lanes; ++l) {
      uint32_t j = s.g * t.lanes + l;
      if (s.cur[l] != kInf && s.cursor[l] < t.start[j + 1] && t.pos[s.cursor[l]] == s.cur[l]) {
        bitmap |= uint64_t(1) << l;
        ++present;
      }
    }
    s.pkt.resize(data_bytes(t.lanes, present, t.bs, t.dtype));
    uint8_t* p = s.pkt.data();
    Header h = make_header(kData, token_, worker_, nworkers_);
    h.dtype = t.dtype; h.slot = s.g; h.tensor = t.id; h.round = s.round;
    h.flags = s.round & 1 ? kFlagShadow : 0;
    h.lanes = uint16_t(t.lanes); h.block_size = uint16_t(t.bs); h.nblocks = t.nblocks;
    h.nslots = t.nslots; h.meta = t.meta; h.present = present;
    store_header(p, h);
    st64(p + kHeaderBytes, bitmap);
    uint8_t* lane = p + kHeaderBytes + kBitmapBytes;
    uint8_t* v = lane + size_t(t.lanes) * kLaneBytes;
    const size_t vb = size_t(t.bs) * t.esize;
    for (uint32_t l = 0; l < t.lanes; ++l) {
      uint32_t j = s.g * t.lanes + l;
      if (bitmap >> l & 1) {
        uint64_t b = stream_block(s.g, l, s.cur[l], t.nslots, t.lanes);
        size_t valid = size_t(std::min<int64_t>(t.bs, t.numel - int64_t(b) * t.bs)) * t.esize;
        std::memcpy(v, t.in + b * vb, valid);
        if (valid < vb) std::memset(v + valid, 0, vb - valid);  // tail block
        v += vb;
        s.cursor[l]++;
      }
      uint32_t nxt = s.cursor[l] < t.start[j + 1] ? t.pos[s.cursor[l]] : kInf;
      st32(lane + l * kLaneBytes, s.cur[l]);
      st32(lane + l * kLaneBytes + 4, nxt);
    }
  }

  void send_slot(TensorW& t, SlotW& s, double now) {
    s.sent_at = now;
    t.packets++;
    t.bytes_sent += s.pkt.size();
    send_raw(s.agg, s.pkt.data(), s.pkt.size());
  }

  void send_raw(int agg, const uint8_t* p, size_t n) {
    tx_packets_++;
    tx_bytes_ += n;
    // A full socket buffer loses the datagram; the slot's timer resends it.
    const Datagram d{p, n, aggs_[agg].addr};
    io_->send(&d, 1);
  }

  void send_control(int agg, uint8_t type, uint64_t tensor) {
    Header h = make_header(type, token_, worker_, nworkers_);
    h.tensor = tensor;
    uint8_t p[kHeaderBytes];
    store_header(p, h);
    send_raw(agg, p, kHeaderBytes);
  }

  // Writes one block of the result, times scale: float32 and 16-bit values multiply in float32
  // (as torch's x.mul_(scale) does), float64 in float64. Blocks no worker sends are never
  // written: the output must be zero there (the input itself in place, else fresh zeros).
  void write_block(TensorW& t, uint64_t b, const uint8_t* v) {
    const size_t n = size_t(std::min<int64_t>(t.bs, t.numel - int64_t(b) * t.bs));
    uint8_t* o = t.out + b * size_t(t.bs) * t.esize;
    if (t.scale == 1.0) {
      std::memcpy(o, v, n * t.esize);
    } else if (t.dtype == kF64) {
      scale_block<double>(o, v, n, t.scale);
    } else if (t.dtype == kF32) {
      scale_block<float>(o, v, n, t.scale);
    } else if (t.dtype == kF16) {
      scale_block<c10::Half>(o, v, n, t.scale);
    } else {
      scale_block<c10::BFloat16>(o, v, n, t.scale);
    }
  }

  template <typename V>
  static void scale_block(uint8_t* o, const uint8_t* v, size_t n, double scale) {
    using A = acc_t<V>;
    const A s = A(scale);
    for (size_t i = 0; i < n; ++i) {
      V x;
      std::memcpy(&x, v + sizeof(V) * i, sizeof(V));
      x = V(A(x) * s);
      std::memcpy(o + sizeof(V) * i, &x, sizeof(V));
    }
  }

  void on_result(TensorW& t, SlotW& s, const Header& h, const uint8_t* p, double now) {
    const uint8_t* lane = p + kHeaderBytes + kBitmapBytes;
    const uint64_t bitmap = ld64(p + kHeaderBytes);
    if ((t.lanes < 64 && (bitmap >> t.lanes)) ||
        uint32_t(__builtin_popcountll(bitmap)) != h.present) { malformed_++; return; }
    for (uint32_t l = 0; l < t.lanes; ++l) {
      uint32_t off = ld32(lane + l * kLaneBytes), nxt = ld32(lane + l * kLaneBytes + 4);
      uint32_t len = stream_length(s.g, l, t.nblocks, t.nslots, t.lanes);
      if (off != s.cur[l] || (off == kInf && ((bitmap >> l & 1) || nxt != kInf)) ||
          (nxt != kInf && (nxt <= off || nxt >= len))) { malformed_++; return; }
    }
    const uint8_t* v = lane + size_t(t.lanes) * kLaneBytes;
    const size_t vb = size_t(t.bs) * t.esize;
    bool last = true;
    for (uint32_t l = 0; l < t.lanes; ++l) {
      uint32_t off = s.cur[l], nxt = ld32(lane + l * kLaneBytes + 4);
      if (off == kInf) continue;
      if (bitmap >> l & 1) {
        write_block(t, stream_block(s.g, l, off, t.nslots, t.lanes), v);
        v += vb;
        t.union_blocks++;
      }
      s.cur[l] = nxt;
      last = last && nxt == kInf;
    }
    t.rounds++;
    t.bytes_received += h.present * vb;
    on_answer(aggs_[s.agg], s, now);
    s.round++;
    s.progress_at = now;
    s.resent = false;
    if (last) {
      s.done = true;
      if (--t.remaining == 0) return complete(t);
      uint32_t& lo = t.lowest[s.agg];  // the next lowest may wait in the FIFO: it goes now
      while (lo < t.nslots && t.slots[lo].done) lo += uint32_t(aggs_.size());
      if (lo < t.nslots && t.slots[lo].queued) transmit(t, t.slots[lo], now);
      return;
    }
    build_data(t, s);
    offer(t, s, now);
  }

  void complete(TensorW& t) {
    std::vector<uint8_t> used(aggs_.size(), 0);
    for (auto& s : t.slots) used[s.agg] = 1;
    for (size_t k = 0; k < aggs_.size(); ++k)
      if (used[k]) send_control(int(k), kRelease, t.id);
    finish_locked(t);
  }

  // Neither touches t.input/t.output: this thread never releases a tensor (see finish).
  void finish_locked(TensorW& t) {
    t.finished = true;
    by_id_.erase(t.id);
    cv_.notify_all();
  }

  void fail_locked(TensorW& t, const std::string& why) {
    if (t.finished) return;
    t.error = "omnireduce: tensor '" + t.name + "': " + why;
    t.finished = true;
    cv_.notify_all();
  }

  void fail(TensorW& t, const std::string& why) {
    release_window(t);
    fail_locked(t, why);
    by_id_.erase(t.id);
  }

  void on_packet(const uint8_t* p, size_t len, double now) {
    rx_packets_++;
    rx_bytes_ += len;
    Header h = load_header(p);
    if (check_structure(h, len) || h.token != token_) { malformed_++; return; }
    // Registration replies: REGACK, or an ERROR refusing the job (never a tensor's error).
    if (h.type == kRegAck || (h.type == kError && h.round == kErrJob) ||
        (h.type == kError && h.round == kErrCapacity && registering_)) {
      for (size_t k = 0; k < aggs_.size(); ++k) {
        if (acked_.size() <= k) break;
        if (!(from_ == aggs_[k].addr)) continue;
        if (h.type == kRegAck) acked_[k] = 1;
        else
          reg_error_ = "omnireduce: aggregator " + aggs_[k].name + " refused the job (error " +
                       std::to_string(h.round) + ": worker count differs from its --workers, "
                       "or it is full)";
      }
      return;
    }
    auto it = by_id_.find(h.tensor);
    if (it == by_id_.end()) { stale_++; return; }  // a late duplicate of a finished tensor
    TensorW& t = *it->second;
    if (h.slot >= t.nslots) { malformed_++; return; }
    SlotW& s = t.slots[h.slot];
    if (h.type == kError) {
      std::string why = h.round == kErrMismatch
          ? "tensor mismatch across ranks: the ranks disagree on its shape, dtype or size"
          : "aggregator out of memory";
      return fail(t, why + " (reported by aggregator " + aggs_[s.agg].name + ")");
    }
    if (h.type != kResult) { malformed_++; return; }
    if (h.dtype != t.dtype || h.lanes != t.lanes || h.block_size != t.bs ||
        h.nblocks != t.nblocks || h.nslots != t.nslots) { malformed_++; return; }
    if (s.done || h.round != s.round) { stale_++; return; }  // duplicate or retransmitted result
    on_result(t, s, h, p, now);
  }

  void check_timers(double now) {
    std::vector<std::pair<TensorW*, std::string>> failed;
    for (auto& [id, t] : by_id_) {
      for (auto& s : t->slots) {
        if (s.done) continue;
        if (now - s.progress_at > timeout_) {
          failed.emplace_back(t, "no result from aggregator " + aggs_[s.agg].name + " for " +
              std::to_string(int(timeout_)) + " s (slot " + std::to_string(s.g) + ", round " +
              std::to_string(s.round) + "): the aggregator is down or a peer rank has not "
              "submitted this tensor");
          break;
        }
        if (s.inflight && now - s.sent_at > s.rto) {
          s.resent = true;
          t->retransmits++;
          retransmits_++;
          on_timeout(aggs_[s.agg], s.sent_at, now);
          // Backoff, jittered so that slots lost together are not resent together.
          s.rto = std::min(s.rto * (2 + 0.5 * unif_(rng_)), kMaxRto);
          send_slot(*t, s, now);
        }
      }
    }
    for (auto& [t, why] : failed) fail(*t, why);
  }

  void loop() {
    std::vector<Datagram> in;
    double last_timers = 0, last_keepalive = now_s();
    while (true) {
      bool waiting = false;  // paced sends due within the millisecond
      for (auto& a : aggs_) waiting = waiting || !a.ready.empty();
      io_->wait(waiting ? 1 : 2, wake_);
      uint64_t v;
      (void)!read(wake_, &v, sizeof v);  // non-blocking: clears a wake-up, if any
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      double now = now_s();
      io_->recv(in, 64);
      for (const Datagram& d : in) {
        from_ = d.peer;
        on_packet(d.data, d.len, now);
      }
      if (now - last_timers > 1e-3) {
        check_timers(now);
        last_timers = now;
      }
      for (size_t k = 0; k < aggs_.size(); ++k) pump(k, now);
      if (now - last_keepalive > kKeepalive) {  // aggregators forget jobs idle for long
        for (size_t k = 0; k < aggs_.size(); ++k) send_control(int(k), kRegister, 0);
        last_keepalive = now;
      }
    }
  }

  const uint64_t token_;
  const uint16_t worker_, nworkers_;
  const int64_t payload_, slots_per_agg_;
  const double rto_, timeout_;
  std::mt19937_64 rng_;
  std::uniform_real_distribution<double> unif_{0.0, 1.0};
  std::vector<Aggregator> aggs_;
  std::unique_ptr<Transport> io_;  // UDP, wrapped in Lossy when the test hooks are on
  int wake_ = -1;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  int64_t next_ticket_ = 0;
  std::unordered_map<uint64_t, TensorW*> by_id_;
  std::unordered_map<int64_t, std::unique_ptr<TensorW>> tickets_;
  std::vector<uint8_t> acked_;
  std::string reg_error_;
  bool registering_ = false;
  Endpoint from_;  // source of the packet being handled
  uint64_t tx_packets_ = 0, tx_bytes_ = 0, rx_packets_ = 0, rx_bytes_ = 0, retransmits_ = 0,
           malformed_ = 0, stale_ = 0;
};

}  // namespace

void register_omni(py::module_& m) {
  using nogil = py::call_guard<py::gil_scoped_release>;
  py::class_<Worker>(m, "OmniWorker")
      .def(py::init<const std::vector<std::pair<std::string, int>>&, uint64_t, int, int, int, int,
                    double, double, double, double, uint64_t>(),
           py::arg("aggregators"), py::arg("token"), py::arg("worker"), py::arg("nworkers"),
           py::arg("payload_bytes") = 16384, py::arg("slots_per_aggregator") = 64,
           py::arg("rto") = 0.02, py::arg("timeout") = 30.0, py::arg("drop_rate") = 0.0,
           py::arg("dup_rate") = 0.0, py::arg("seed") = 0)
      .def("register", &Worker::register_all, py::arg("timeout"), nogil())
      .def("submit", &Worker::submit, py::arg("tensor_id"), py::arg("input"), py::arg("output"),
           py::arg("block_size"), py::arg("meta"), py::arg("mask") = py::none(),
           py::arg("name") = "", py::arg("scale") = 1.0, nogil())
      .def("poll", &Worker::poll_ticket, nogil())
      .def("wait", &Worker::wait, py::arg("ticket"), py::arg("timeout"), nogil())
      .def("finish", &Worker::finish)
      .def("stats", &Worker::stats)
      .def("close", &Worker::close, nogil());
}

}  // namespace hvd_sparse::omni

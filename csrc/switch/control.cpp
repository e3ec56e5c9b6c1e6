// The emulated switch's control plane socket: see control.h.
#include "control.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace hvd_sparse::switch_emu {
namespace {

std::string limits_json(const omni::PipelineOptions& o) {
  return "{\"cells\": " + std::to_string(o.cells) +
         ", \"values_per_pass\": " + std::to_string(o.values_per_pass) +
         ", \"cells_per_slot\": " + std::to_string(o.cells_per_slot) +
         ", \"groups\": " + std::to_string(o.cells / o.cells_per_slot) +
         ", \"max_workers\": " + std::to_string(o.max_workers) +
         ", \"auto_groups\": " + std::to_string(o.auto_groups) + "}";
}

std::string jobs_json(const omni::Pipeline& p) {
  std::string s = "{\"jobs\": [";
  for (const omni::SwitchJob& j : p.jobs()) {
    int registered = 0;
    for (const omni::Endpoint& e : j.addr) registered += e.port != 0;
    s += std::string(s.back() == '[' ? "" : ", ") + "{\"token\": " + std::to_string(j.token) +
         ", \"workers\": " + std::to_string(j.nworkers) +
         ", \"registered\": " + std::to_string(registered) +
         ", \"first\": " + std::to_string(j.first) + ", \"groups\": " + std::to_string(j.groups) +
         ", \"automatic\": " + (j.automatic ? "true" : "false") + "}";
  }
  return s + "]}";
}

std::string set_loss(Switch& sw, std::istringstream& in) {
  std::string port, what = "all";
  double rate = -1;
  if (!(in >> port >> rate) || rate < 0 || rate > 1 ||
      ((in >> what) && what != "udp" && what != "all"))
    return R"({"error": "usage: loss PORT|* RATE [udp|all]"})";
  sw.set_loss(port, rate, what == "udp");
  return R"({"loss": true})";
}

std::string install_job(Switch& sw, omni::Pipeline& p, std::istringstream& in) {
  uint64_t token = 0;
  unsigned workers = 0, groups = 0;
  if (!(in >> token >> workers >> groups) || workers > 65535)
    return R"({"error": "usage: install TOKEN WORKERS GROUPS"})";
  try {
    return "{\"first\": " + std::to_string(p.install(token, uint16_t(workers), groups, sw.now())) +
           "}";
  } catch (const std::exception& e) {
    return std::string("{\"error\": \"") + e.what() + "\"}";
  }
}

std::string remove_job(omni::Pipeline& p, std::istringstream& in) {
  uint64_t token = 0;
  if (!(in >> token)) return R"({"error": "usage: remove TOKEN"})";
  return std::string("{\"removed\": ") + (p.remove(token) ? "true" : "false") + "}";
}

}  // namespace

Control::Control(std::string path) : path_(std::move(path)) {
  fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (fd_ < 0 || path_.size() >= sizeof a.sun_path) fail("control socket: bad path " + path_);
  std::memcpy(a.sun_path, path_.c_str(), path_.size() + 1);
  unlink(path_.c_str());
  if (bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
    fail("control socket: cannot bind " + path_ + ": " + std::strerror(errno));
}

Control::~Control() {
  close(fd_);
  unlink(path_.c_str());
}

void Control::poll(Switch& sw) {
  char buf[256];
  sockaddr_un from{};
  socklen_t len = sizeof from;
  for (ssize_t n;
       (n = recvfrom(fd_, buf, sizeof buf - 1, 0, reinterpret_cast<sockaddr*>(&from), &len)) >= 0;
       len = sizeof from) {
    buf[n] = 0;
    const std::string r = run(sw, buf) + "\n";
    sendto(fd_, r.data(), r.size(), 0, reinterpret_cast<sockaddr*>(&from), len);
  }
}

std::string Control::run(Switch& sw, const std::string& line) {
  omni::Pipeline* p = sw.pipeline();
  std::istringstream in(line);
  std::string cmd;
  in >> cmd;
  if (cmd == "stats") return sw.stats_json();
  if (cmd == "loss") return set_loss(sw, in);
  if (!p) return R"({"error": "no aggregation program: start the switch with --aggregate"})";
  if (cmd == "limits") return limits_json(p->options());
  if (cmd == "jobs") return jobs_json(*p);
  if (cmd == "install") return install_job(sw, *p, in);
  if (cmd == "remove") return remove_job(*p, in);
  return R"({"error": "unknown command: limits | jobs | stats | install | remove | loss"})";
}

}  // namespace hvd_sparse::switch_emu

// The emulated switch's control plane socket: see control.h.
#include "control.h"

#include <arpa/inet.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
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

// Every job, or the one of TOKEN; without tokens.
std::string jobs_json(const omni::Pipeline& p, std::istringstream& in) {
  uint64_t token = 0;
  const bool one = bool(in >> token);
  std::string s = "{\"jobs\": [";
  for (const omni::SwitchJob& j : p.jobs()) {
    if (one && j.token != token) continue;
    int registered = 0;
    for (const omni::Endpoint& e : j.addr) registered += e.port != 0;
    s += std::string(s.back() == '[' ? "" : ", ") + "{\"workers\": " + std::to_string(j.nworkers) +
         ", \"registered\": " + std::to_string(registered) +
         ", \"epoch\": " + std::to_string(j.epoch) +
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

std::string bind_host(Switch& sw, std::istringstream& in) {
  std::string port, mac, ip;
  if (!(in >> port >> mac >> ip)) return R"({"error": "usage: host PORT MAC IP"})";
  const std::string why = sw.bind(port, mac, ip);
  return why.empty() ? R"({"bound": true})" : "{\"error\": \"" + why + "\"}";
}

// install TOKEN WORKERS GROUPS [IP,IP,..] [epoch=E]: with addresses (one per worker, each a
// bound host), every worker of the job is bound to its host; a job installed at an earlier
// epoch (membership, 1 by default) is replaced.
std::string install_job(Switch& sw, omni::Pipeline& p, std::istringstream& in) {
  static const char* usage =
      R"({"error": "usage: install TOKEN WORKERS GROUPS [IP,IP,..] [epoch=E]"})";
  uint64_t token = 0;
  unsigned workers = 0, groups = 0;
  unsigned long epoch = 1;
  std::string list, word;
  if (!(in >> token >> workers >> groups) || workers > 65535) return usage;
  while (in >> word) {
    if (word.rfind("epoch=", 0) == 0) {
      char* end = nullptr;
      epoch = std::strtoul(word.c_str() + 6, &end, 10);
      if (*end || word.size() == 6 || epoch > UINT32_MAX) return usage;
    } else if (list.empty()) list = word;
    else return usage;
  }
  std::vector<uint32_t> ips;
  std::stringstream addrs(list);
  for (std::string a; std::getline(addrs, a, ',');) {
    uint32_t ip = 0;
    if (a.find(':') != std::string::npos)
      return "{\"error\": \"worker " + std::to_string(ips.size()) + "'s address " + a +
             " is IPv6: the emulated switch is IPv4 only\"}";
    if (inet_pton(AF_INET, a.c_str(), &ip) != 1 || !sw.bound(ip))
      return "{\"error\": \"worker " + std::to_string(ips.size()) + "'s address " + a +
             " is no bound host (host PORT MAC IP first)\"}";
    ips.push_back(ip);
  }
  try {
    return "{\"first\": " +
           std::to_string(p.install(token, uint16_t(workers), groups, sw.now(), ips,
                                    uint32_t(epoch))) + "}";
  } catch (const std::exception& e) {
    return std::string("{\"error\": \"") + e.what() + "\"}";
  }
}

// remove TOKEN [EPOCH]: with an epoch, only a job installed at it or earlier (a late close of an
// old membership leaves its successor alone).
std::string remove_job(omni::Pipeline& p, std::istringstream& in) {
  uint64_t token = 0;
  uint32_t epoch = UINT32_MAX;
  if (!(in >> token)) return R"({"error": "usage: remove TOKEN [EPOCH]"})";
  if (!(in >> epoch)) epoch = UINT32_MAX;
  return std::string("{\"removed\": ") + (p.remove(token, epoch) ? "true" : "false") + "}";
}

// Removes the job whose slot groups start at FIRST (an operator who does not hold its token).
std::string drop_job(omni::Pipeline& p, std::istringstream& in) {
  uint32_t first = 0;
  if (!(in >> first)) return R"({"error": "usage: drop FIRST"})";
  for (const omni::SwitchJob& j : p.jobs())
    if (j.first == first)
      return std::string("{\"removed\": ") + (p.remove(j.token) ? "true" : "false") + "}";
  return R"({"removed": false})";
}

}  // namespace

Control::Control(std::string path) : path_(std::move(path)) {
  fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (fd_ < 0 || path_.size() >= sizeof a.sun_path) fail("control socket: bad path " + path_);
  std::memcpy(a.sun_path, path_.c_str(), path_.size() + 1);
  // A stale socket is replaced; anything else at the path is left alone.
  struct stat st {};
  if (lstat(path_.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) fail("control socket: " + path_ + " exists and is not a socket");
    unlink(path_.c_str());
  }
  const mode_t old = umask(077);  // created 0600: the owner's (and root's) alone
  const int rc = bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
  umask(old);
  if (rc != 0 || chmod(path_.c_str(), 0600) != 0)
    fail("control socket: cannot bind " + path_ + ": " + std::strerror(errno));
  const int on = 1;
  if (setsockopt(fd_, SOL_SOCKET, SO_PASSCRED, &on, sizeof on) != 0)
    fail("control socket: SO_PASSCRED: " + std::string(std::strerror(errno)));
}

Control::~Control() {
  close(fd_);
  unlink(path_.c_str());
}

void Control::poll(Switch& sw) {
  for (;;) {
    char buf[4096];  // an install names up to 32 workers' addresses
    sockaddr_un from{};
    iovec iov{buf, sizeof buf - 1};
    alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(ucred))];
    msghdr m{};
    m.msg_name = &from;
    m.msg_namelen = sizeof from;
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = ctl;
    m.msg_controllen = sizeof ctl;
    const ssize_t n = recvmsg(fd_, &m, 0);
    if (n < 0) return;
    buf[n] = 0;
    const cmsghdr* c = CMSG_FIRSTHDR(&m);
    ucred who{};
    const bool known = c && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS;
    if (known) std::memcpy(&who, CMSG_DATA(c), sizeof who);
    const std::string r =
        (known && (who.uid == 0 || who.uid == geteuid())
             ? run(sw, buf)
             : R"({"error": "permission denied: root or the switch's user only"})") +
        "\n";
    sendto(fd_, r.data(), r.size(), 0, reinterpret_cast<sockaddr*>(&from), m.msg_namelen);
  }
}

std::string Control::run(Switch& sw, const std::string& line) {
  omni::Pipeline* p = sw.pipeline();
  std::istringstream in(line);
  std::string cmd;
  in >> cmd;
  if (cmd == "stats") return sw.stats_json();
  if (cmd == "loss") return set_loss(sw, in);
  if (cmd == "host") return bind_host(sw, in);
  if (!p) return R"({"error": "no aggregation program: start the switch with --aggregate"})";
  if (cmd == "limits") return limits_json(p->options());
  if (cmd == "jobs") return jobs_json(*p, in);
  if (cmd == "install") return install_job(sw, *p, in);
  if (cmd == "remove") return remove_job(*p, in);
  if (cmd == "drop") return drop_job(*p, in);
  return R"({"error": "unknown command: limits | jobs | stats | host | install | remove | drop | loss"})";
}

}  // namespace hvd_sparse::switch_emu

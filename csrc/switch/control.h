// The emulated switch's control plane socket (hvd-sparse-switch --control PATH): a local
// datagram socket, one text command per datagram, one JSON reply to its sender
// (hvd_sparse/tools/switch/control.py speaks it). Commands: limits | jobs [TOKEN] | stats |
// host PORT MAC IP | install TOKEN WORKERS GROUPS [IP,IP,..] | remove TOKEN | drop FIRST |
// loss PORT|* RATE [udp|all].
// A job's token is its credential on the wire: it is never printed (jobs are named by their
// first slot group). The socket is the owner's alone (mode 0600) and every command's sender is
// checked (SCM_CREDENTIALS): root or the switch's own user.
#pragma once
#include <string>

#include "ports.h"

namespace hvd_sparse::switch_emu {

class Control {
 public:
  explicit Control(std::string path);  // binds the socket; exits when it cannot
  ~Control();

  // Answers every command waiting on the socket (never blocks).
  void poll(Switch& sw);

 private:
  static std::string run(Switch& sw, const std::string& line);

  std::string path_;
  int fd_ = -1;
};

}  // namespace hvd_sparse::switch_emu

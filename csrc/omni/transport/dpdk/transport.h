// DPDK: the aggregator on a poll-mode driver, with no kernel network stack in the path. This
// transport parses and builds Ethernet/IPv4/UDP itself, answers ARP for its address and learns
// its peers' MAC addresses from what they send. It runs without hugepages or PCI devices
// (--no-huge --no-pci, vdevs such as net_af_packet, net_tap, net_memif), and interoperates with
// workers on kernel sockets: to them it is just a UDP endpoint.
//
// Frames are never fragmented: a datagram must fit one frame (the workers size theirs to the
// path MTU, docs/PROTOCOL.md); IP fragments received are ignored and counted.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "../transport.h"

namespace hvd_sparse::omni {

struct DpdkOptions {
  std::string eal_args;  // e.g. "--no-huge --no-pci -m 256 --vdev=net_af_packet0,iface=eth0"
  Endpoint bind;         // the address and port it owns on the port's link
  int queues = 1;        // receive/transmit queue pairs: one Transport each
};

// Initializes the EAL and the first port it finds, and returns one Transport per queue.
// Throws std::runtime_error saying what failed (EAL arguments, no port, queue setup).
std::vector<std::unique_ptr<Transport>> open_dpdk(const DpdkOptions& o);

}  // namespace hvd_sparse::omni

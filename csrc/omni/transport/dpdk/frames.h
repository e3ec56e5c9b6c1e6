// Ethernet, ARP, IPv4 and UDP as the DPDK transport and the emulated switch read and write
// them: no fragmentation, no IP options written, checksums as a NIC without offloads needs
// (written on send, verified on receive).
#pragma once
#include <rte_arp.h>
#include <rte_ether.h>
#include <rte_ip.h>
#include <rte_mbuf.h>
#include <rte_udp.h>

#include <cstdint>
#include <cstring>

#include "../transport.h"

namespace hvd_sparse::omni::frames {

constexpr size_t kHeaders = sizeof(rte_ether_hdr) + sizeof(rte_ipv4_hdr) + sizeof(rte_udp_hdr);

// The ARP header of a frame carrying Ethernet/IPv4 ARP, else nullptr.
inline rte_arp_hdr* arp_of(rte_mbuf* m) {
  if (m->nb_segs != 1 || m->data_len < sizeof(rte_ether_hdr) + sizeof(rte_arp_hdr)) return nullptr;
  auto* eth = rte_pktmbuf_mtod(m, rte_ether_hdr*);
  if (eth->ether_type != rte_cpu_to_be_16(RTE_ETHER_TYPE_ARP)) return nullptr;
  auto* arp = reinterpret_cast<rte_arp_hdr*>(eth + 1);
  if (rte_be_to_cpu_16(arp->arp_hardware) != RTE_ARP_HRD_ETHER ||
      rte_be_to_cpu_16(arp->arp_protocol) != RTE_ETHER_TYPE_IPV4)
    return nullptr;
  return arp;
}

// An ARP frame from (mac, ip) to `to_mac` about (target, target_ip), or nullptr.
inline rte_mbuf* arp_frame(rte_mempool* pool, uint16_t op, const rte_ether_addr& mac, uint32_t ip,
                           const rte_ether_addr& to_mac, const rte_ether_addr& target,
                           uint32_t target_ip) {
  rte_mbuf* r = rte_pktmbuf_alloc(pool);
  if (!r) return nullptr;
  const uint16_t len = sizeof(rte_ether_hdr) + sizeof(rte_arp_hdr);
  auto* eth = reinterpret_cast<rte_ether_hdr*>(rte_pktmbuf_append(r, len));
  eth->dst_addr = to_mac;
  eth->src_addr = mac;
  eth->ether_type = rte_cpu_to_be_16(RTE_ETHER_TYPE_ARP);
  auto* arp = reinterpret_cast<rte_arp_hdr*>(eth + 1);
  arp->arp_hardware = rte_cpu_to_be_16(RTE_ARP_HRD_ETHER);
  arp->arp_protocol = rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4);
  arp->arp_hlen = RTE_ETHER_ADDR_LEN;
  arp->arp_plen = 4;
  arp->arp_opcode = rte_cpu_to_be_16(op);
  arp->arp_data.arp_sha = mac;
  arp->arp_data.arp_sip = ip;
  arp->arp_data.arp_tha = target;
  arp->arp_data.arp_tip = target_ip;
  return r;
}

// A received IPv4/UDP datagram: where it came from and went to, and its payload.
struct Udp {
  Endpoint from, to;
  const uint8_t* data;
  size_t len;
  bool fragment;     // an IP fragment: never reassembled (the payload is not the datagram's)
  bool checksum_ok;  // the UDP checksum holds, or there is none (0: allowed over IPv4)
};

// The UDP checksum of a datagram whose payload's one's-complement sum (rte_raw_cksum) is
// `payload_sum`: callers that send one payload to many sum it once. The pseudo-header's
// length is the UDP length (RFC 768), not what the IP total leaves after the IP header, as
// rte_ipv4_phdr_cksum takes it: the two differ when the IP payload holds padding, and
// such a datagram's valid checksum failed (fuzz/corpus/dpdk_frames/regress-*).
inline uint16_t udp_checksum(const rte_ipv4_hdr* ip, const rte_udp_hdr* udp, uint32_t payload_sum) {
  rte_udp_hdr h = *udp;
  h.dgram_cksum = 0;
  struct {
    uint32_t src, dst;
    uint8_t zero, proto;
    uint16_t len;
  } pseudo{ip->src_addr, ip->dst_addr, 0, IPPROTO_UDP, udp->dgram_len};
  uint32_t sum = payload_sum + rte_raw_cksum(&h, sizeof h) + rte_raw_cksum(&pseudo, sizeof pseudo);
  while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
  const uint16_t c = uint16_t(~sum);
  return c == 0 ? 0xffff : c;  // 0 would mean "no checksum"
}

// Parses an IPv4/UDP frame with a valid IP header checksum; false for anything else. The UDP
// checksum is checked (checksum_ok): a sender's NIC or kernel computes it, so a frame whose
// bytes changed on the way fails it. (Hosts on virtual links must not leave it to an offload
// that veths never do: the testbed turns those offloads off where a DPDK process reads.)
inline bool parse_udp(rte_mbuf* m, Udp* u) {
  if (m->nb_segs != 1 || m->data_len < kHeaders) return false;
  auto* eth = rte_pktmbuf_mtod(m, rte_ether_hdr*);
  if (eth->ether_type != rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4)) return false;
  auto* ip = reinterpret_cast<rte_ipv4_hdr*>(eth + 1);
  const size_t ihl = size_t(ip->version_ihl & 0x0f) * 4;
  const size_t total = rte_be_to_cpu_16(ip->total_length);
  if ((ip->version_ihl >> 4) != 4 || ihl < sizeof(rte_ipv4_hdr) ||
      total < ihl + sizeof(rte_udp_hdr) || sizeof(rte_ether_hdr) + total > m->data_len ||
      ip->next_proto_id != IPPROTO_UDP)
    return false;
  if (rte_ipv4_cksum(ip) != 0xFFFF && rte_raw_cksum(ip, ihl) != 0xFFFF) return false;
  auto* udp = reinterpret_cast<rte_udp_hdr*>(reinterpret_cast<uint8_t*>(ip) + ihl);
  const size_t ulen = rte_be_to_cpu_16(udp->dgram_len);
  if (ulen < sizeof(rte_udp_hdr) || ulen > total - ihl) return false;
  u->from = Endpoint::v4(ip->src_addr, udp->src_port);
  u->to = Endpoint::v4(ip->dst_addr, udp->dst_port);
  u->data = reinterpret_cast<const uint8_t*>(udp + 1);
  u->len = ulen - sizeof(rte_udp_hdr);
  u->fragment = (rte_be_to_cpu_16(ip->fragment_offset) &
                 (RTE_IPV4_HDR_MF_FLAG | RTE_IPV4_HDR_OFFSET_MASK)) != 0;
  // Over the UDP length (the IP total may hold padding); a fragment's checksum covers bytes
  // not here (fragments are dropped anyway).
  u->checksum_ok =
      udp->dgram_cksum == 0 || u->fragment ||
      udp_checksum(ip, udp, rte_raw_cksum(u->data, u->len)) == udp->dgram_cksum;
  return true;
}

// Appends Ethernet, IPv4 (DF, header checksum) and UDP headers and the payload to an empty
// mbuf; the UDP checksum is left 0 ("none", valid over IPv4) for the caller to fill
// (udp_checksum).
inline rte_udp_hdr* write_udp(rte_mbuf* m, const rte_ether_addr& src_mac,
                              const rte_ether_addr& dst_mac, const Endpoint& from,
                              const Endpoint& to, const uint8_t* data, size_t len, uint16_t ip_id) {
  auto* eth = reinterpret_cast<rte_ether_hdr*>(rte_pktmbuf_append(m, uint16_t(kHeaders + len)));
  eth->dst_addr = dst_mac;
  eth->src_addr = src_mac;
  eth->ether_type = rte_cpu_to_be_16(RTE_ETHER_TYPE_IPV4);
  auto* ip = reinterpret_cast<rte_ipv4_hdr*>(eth + 1);
  ip->version_ihl = RTE_IPV4_VHL_DEF;
  ip->type_of_service = 0;
  ip->total_length = rte_cpu_to_be_16(uint16_t(sizeof(rte_ipv4_hdr) + sizeof(rte_udp_hdr) + len));
  ip->packet_id = rte_cpu_to_be_16(ip_id);
  ip->fragment_offset = rte_cpu_to_be_16(RTE_IPV4_HDR_DF_FLAG);
  ip->time_to_live = 64;
  ip->next_proto_id = IPPROTO_UDP;
  ip->src_addr = from.ip4();  // IPv4 endpoints only (the DPDK paths refuse IPv6 ones)
  ip->dst_addr = to.ip4();
  ip->hdr_checksum = 0;
  auto* udp = reinterpret_cast<rte_udp_hdr*>(ip + 1);
  udp->src_port = from.port;
  udp->dst_port = to.port;
  udp->dgram_len = rte_cpu_to_be_16(uint16_t(sizeof(rte_udp_hdr) + len));
  udp->dgram_cksum = 0;
  std::memcpy(udp + 1, data, len);
  ip->hdr_checksum = rte_ipv4_cksum(ip);
  return udp;
}

}  // namespace hvd_sparse::omni::frames

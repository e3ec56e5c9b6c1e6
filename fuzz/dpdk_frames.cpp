// Fuzz target: the Ethernet/ARP/IPv4/UDP parsing that the DPDK transport and the emulated
// switch's ports apply to every frame a NIC hands them (csrc/omni/transport/dpdk/frames.h:
// parse_udp, arp_of), one frame per input in a single-segment mbuf of its exact size. What
// parse_udp accepts lies within the frame, and its checksum verdict agrees with a checksum
// computed here over the same bytes.
#include <cstring>
#include <vector>

#include "omni/transport/dpdk/frames.h"

namespace {

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "fuzz: %s\n", what);
  std::abort();
}

// RFC 768's checksum over the pseudo-header and the datagram, independently of frames.h.
uint16_t reference_checksum(const uint8_t* ip, const uint8_t* udp, size_t ulen) {
  uint64_t sum = 0;
  auto add = [&](const uint8_t* p, size_t n) {
    for (size_t i = 0; i + 1 < n; i += 2) sum += uint32_t(p[i]) << 8 | p[i + 1];
    if (n & 1) sum += uint32_t(p[n - 1]) << 8;
  };
  add(ip + 12, 8);  // source and destination addresses
  sum += IPPROTO_UDP + ulen;
  uint8_t head[8];
  std::memcpy(head, udp, 8);
  head[6] = head[7] = 0;
  add(head, 8);
  add(udp + 8, ulen - 8);
  while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
  const uint16_t c = uint16_t(~sum);
  return c == 0 ? 0xffff : c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 16384) return 0;  // the largest frame (the mbuf size)
  std::vector<uint8_t> frame(data, data + size);
  alignas(RTE_CACHE_LINE_SIZE) rte_mbuf m;
  std::memset(&m, 0, sizeof m);
  m.buf_addr = frame.data();
  m.data_off = 0;
  m.data_len = uint16_t(size);
  m.pkt_len = uint32_t(size);
  m.nb_segs = 1;
  hvd_sparse::omni::frames::Udp u{};
  if (hvd_sparse::omni::frames::parse_udp(&m, &u)) {
    const uint8_t* end = frame.data() + size;
    if (u.data < frame.data() || u.data > end || u.len > size_t(end - u.data))
      die("parse_udp: the payload lies outside the frame");
    const uint8_t* ip = frame.data() + sizeof(rte_ether_hdr);
    const uint8_t* udp = u.data - sizeof(rte_udp_hdr);
    const uint16_t sent = uint16_t(udp[6] << 8 | udp[7]);
    if (!u.fragment && sent != 0 &&
        u.checksum_ok != (reference_checksum(ip, udp, u.len + 8) == sent))
      die("parse_udp: checksum verdict differs from RFC 768's");
  }
  if (const rte_arp_hdr* arp = hvd_sparse::omni::frames::arp_of(&m)) {
    if (reinterpret_cast<const uint8_t*>(arp + 1) > frame.data() + size)
      die("arp_of: the ARP header lies outside the frame");
  }
  return 0;
}

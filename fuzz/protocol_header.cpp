// Fuzz target: protocol.h's own parsing, alone (the decoders' targets reach it only behind
// their state): one datagram per input. A header loads and stores back to the same bytes;
// what check_structure accepts has exactly the length data_bytes says; lanes_valid reads
// nothing past it; and the stream geometry of an accepted DATA/RESULT covers its tensor's
// blocks exactly once (stream_length, stream_block, layout).
#include <cstring>

#include "harness.h"

using namespace fuzz;

namespace {

void geometry(const Header& h, const uint8_t* p, size_t n) {
  const uint64_t streams = uint64_t(h.nslots) * h.lanes;
  if (streams > 4096) return;  // checked over every stream: keep it cheap
  uint64_t covered = 0;
  for (uint32_t s = 0; s < h.nslots; ++s)
    for (uint32_t l = 0; l < h.lanes; ++l) {
      const uint32_t len = stream_length(s, l, h.nblocks, h.nslots, h.lanes);
      covered += len;
      for (uint32_t pos : {0u, len / 2, len ? len - 1 : 0u}) {
        if (!len) break;
        const uint64_t b = stream_block(s, l, pos, h.nslots, h.lanes);
        if (b >= h.nblocks || b % streams != uint64_t(s) * h.lanes + l || b / streams != pos)
          die("stream_block and stream_length disagree", p, n);
      }
    }
  if (covered != h.nblocks) die("the streams do not cover the tensor exactly once", p, n);
  const Layout g = layout(h.nblocks, h.block_size, uint32_t(wire_size(h.dtype)), h.meta, h.nslots);
  if (g.lanes < 1 || g.lanes > kMaxLanes || g.nslots < 1 || g.nslots > h.nslots)
    die("layout out of range", p, n);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<uint8_t> b(data, data + size);  // its own allocation: reads past it are caught
  if (size < kHeaderBytes) return 0;
  const Header h = load_header(b.data());
  uint8_t again[kHeaderBytes];
  store_header(again, h);
  if (std::memcmp(again, b.data(), kHeaderBytes) != 0) die("store(load(header)) differs", data, size);
  const bool mac = h.flags & kFlagAuth;
  const size_t len = mac ? (size >= kHeaderBytes + kAuthBytes ? size - kAuthBytes : 0) : size;
  if (check_structure(h, len)) return 0;
  if (h.type != kData && h.type != kResult) return 0;
  if (len != data_bytes(h.lanes, h.present, h.block_size, h.dtype)) die("length", data, size);
  std::vector<uint8_t> exact(b.begin(), b.begin() + long(len));  // less any trailer
  // Every lane at its own offset: the check's other rules (bitmap, nexts) decide alone.
  uint32_t cur[kMaxLanes];
  for (uint32_t l = 0; l < h.lanes; ++l) cur[l] = ld32(exact.data() + kHeaderBytes + 8 + 8 * l);
  const bool round0 = lanes_valid(h, exact.data(), nullptr);
  if (round0 && !lanes_valid(h, exact.data(), cur))
    die("a valid round 0 fails at its own offsets", data, size);
  geometry(h, data, size);
  return 0;
}

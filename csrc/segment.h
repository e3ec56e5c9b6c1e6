// The segment: the self-describing unit the allgather and Zen schemes put on the wire
// (docs/PROTOCOL.md, "Collective segments"). Every rank validates every segment it receives
// against its own view of the tensor, which is how shape/dtype mismatches across ranks are
// caught on all ranks at once.
#pragma once
#include <cstdint>

namespace hvd_sparse {

constexpr uint32_t kSegMagic = 0x53505348u;  // "HSPS" little-endian
constexpr uint8_t kSegVersion = 1;
enum SegKind : uint8_t { kIndexList = 0, kPartitionBitmap = 1 };

#pragma pack(push, 1)
struct SegHeader {
  uint32_t magic;
  uint8_t version;
  uint8_t dtype;  // DType code of the values
  uint8_t kind;   // SegKind
  uint8_t reserved;
  uint32_t block_size;
  uint32_t count;      // blocks carried
  uint32_t part;       // partition this segment covers (Zen), else 0
  uint32_t nparts;     // number of partitions (Zen), else 1
  uint64_t numel;      // elements of the whole tensor
  uint64_t meta;       // hash of shape and dtype, from the Python side
  uint64_t nbytes;     // whole segment, header included
  uint64_t nnz_local;  // non-zero blocks the sender had before any reduction (for the cost model)
};
#pragma pack(pop)
static_assert(sizeof(SegHeader) == 56, "segment header is 56 bytes");

inline uint64_t align8(uint64_t n) { return (n + 7) & ~uint64_t(7); }

}  // namespace hvd_sparse

// The OmniReduce-style aggregation protocol: the one definition shared by the C++ aggregator,
// the worker engine in hvd_sparse._C and (through _C.omni_protocol()) every Python tool that
// reads or writes packets. docs/PROTOCOL.md is the prose spec of this file.
//
// Header fields are big-endian (network order); block values travel little-endian in the
// tensor's own element format. No torch here: the aggregator binary links without it.
#pragma once
#include <cstdint>
#include <cstring>

namespace hvd_sparse::omni {

constexpr uint32_t kMagic = 0x4853504F;  // "HSPO"
constexpr uint8_t kVersion = 1;

enum Type : uint8_t {
  kData = 1,      // worker -> aggregator: one round of one slot
  kResult = 2,    // aggregator -> worker: the round's sum
  kRegister = 3,  // worker -> aggregator: join job `token` as `worker` of `nworkers`
  kRegAck = 4,    // aggregator -> worker
  kRelease = 5,   // worker -> aggregator: this worker has every result of `tensor`
  kBye = 6,       // worker -> aggregator: this worker leaves the job
  kError = 7,     // aggregator -> worker: `round` carries an ErrorCode; the slot is dead
};

enum ErrorCode : uint32_t {
  kErrMismatch = 1,   // workers disagree on the tensor (dtype, block count, shape, layout)
  kErrJob = 2,        // REGISTER disagrees with the job (worker count) or too many jobs
  kErrCapacity = 3,   // the aggregator is out of slot memory
};

enum Flags : uint8_t {
  kFlagShadow = 1,  // round & 1: which of the slot's two sets this packet belongs to
  kFlagLast = 2,    // RESULT: every lane has finished; the slot is complete
};

constexpr uint32_t kInf = 0xFFFFFFFFu;  // lane position "none": no further non-zero block
constexpr int kMaxLanes = 64;            // lanes per packet (fusion), bounded by the bitmap
constexpr int kMaxWorkers = 1024;
constexpr int kMaxDatagram = 65507;      // UDP over IPv4

// Fixed header, 56 bytes. Offsets are part of the spec (docs/PROTOCOL.md).
struct Header {
  uint32_t magic;       // 0
  uint8_t version;      // 4
  uint8_t type;         // 5
  uint8_t dtype;        // 6: 0 float32, 1 float64, 2 float16, 3 bfloat16 (as csrc/blocks.h)
  uint8_t flags;        // 7
  uint64_t token;       // 8: job token (random, shared by the job's ranks)
  uint16_t worker;      // 16
  uint16_t nworkers;    // 18
  uint32_t slot;        // 20: slot of the tensor, 0 .. nslots-1
  uint64_t tensor;      // 24: tensor id (hash of the name and its call count)
  uint32_t round;       // 32: round of the slot (kError: the ErrorCode)
  uint16_t lanes;       // 36: lanes per slot (block fusion), 1 .. kMaxLanes
  uint16_t block_size;  // 38: elements per block
  uint32_t nblocks;     // 40: blocks of the tensor
  uint32_t nslots;      // 44: slots of the tensor over all aggregators
  uint32_t meta;        // 48: hash of the tensor's shape and dtype
  uint32_t present;     // 52: DATA/RESULT: number of blocks carried (popcount of the bitmap)
};
constexpr size_t kHeaderBytes = 56;
// DATA and RESULT follow the header with: a uint64 bitmap of the lanes that carry a block,
// `lanes` entries {uint32 offset, uint32 next}, then `present` blocks of `block_size` values.
constexpr size_t kBitmapBytes = 8;
constexpr size_t kLaneBytes = 8;

inline int elem_size(uint8_t dtype) { return dtype == 1 ? 8 : dtype == 0 ? 4 : 2; }

inline size_t data_bytes(uint32_t lanes, uint32_t present, uint32_t bs, uint8_t dtype) {
  return kHeaderBytes + kBitmapBytes + size_t(lanes) * kLaneBytes +
         size_t(present) * bs * elem_size(dtype);
}

// Streams: block b of a tensor with nslots slots of `lanes` lanes belongs to stream
// j = b mod (nslots * lanes), at position b div (nslots * lanes). Stream j is lane j mod lanes
// of slot j div lanes; slot s lives on aggregator s mod K. Adjacent blocks thus share a packet
// and adjacent packets go to different aggregators.
inline uint64_t stream_block(uint32_t slot, uint32_t lane, uint32_t pos, uint32_t nslots,
                             uint32_t lanes) {
  return (uint64_t(pos) * nslots + slot) * lanes + lane;
}
inline uint32_t stream_length(uint32_t slot, uint32_t lane, uint32_t nblocks, uint32_t nslots,
                              uint32_t lanes) {
  uint64_t j = uint64_t(slot) * lanes + lane, L = uint64_t(nslots) * lanes;
  return j >= nblocks ? 0 : uint32_t((nblocks - j + L - 1) / L);
}

// Big-endian field access; compiles to bswap on x86.
inline uint16_t ld16(const uint8_t* p) { return uint16_t(p[0] << 8 | p[1]); }
inline uint32_t ld32(const uint8_t* p) {
  return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3];
}
inline uint64_t ld64(const uint8_t* p) { return uint64_t(ld32(p)) << 32 | ld32(p + 4); }
inline void st16(uint8_t* p, uint16_t v) { p[0] = uint8_t(v >> 8); p[1] = uint8_t(v); }
inline void st32(uint8_t* p, uint32_t v) {
  p[0] = uint8_t(v >> 24); p[1] = uint8_t(v >> 16); p[2] = uint8_t(v >> 8); p[3] = uint8_t(v);
}
inline void st64(uint8_t* p, uint64_t v) { st32(p, uint32_t(v >> 32)); st32(p + 4, uint32_t(v)); }

inline Header load_header(const uint8_t* p) {
  Header h;
  h.magic = ld32(p); h.version = p[4]; h.type = p[5]; h.dtype = p[6]; h.flags = p[7];
  h.token = ld64(p + 8); h.worker = ld16(p + 16); h.nworkers = ld16(p + 18);
  h.slot = ld32(p + 20); h.tensor = ld64(p + 24); h.round = ld32(p + 32);
  h.lanes = ld16(p + 36); h.block_size = ld16(p + 38); h.nblocks = ld32(p + 40);
  h.nslots = ld32(p + 44); h.meta = ld32(p + 48); h.present = ld32(p + 52);
  return h;
}

inline void store_header(uint8_t* p, const Header& h) {
  st32(p, h.magic); p[4] = h.version; p[5] = h.type; p[6] = h.dtype; p[7] = h.flags;
  st64(p + 8, h.token); st16(p + 16, h.worker); st16(p + 18, h.nworkers);
  st32(p + 20, h.slot); st64(p + 24, h.tensor); st32(p + 32, h.round);
  st16(p + 36, h.lanes); st16(p + 38, h.block_size); st32(p + 40, h.nblocks);
  st32(p + 44, h.nslots); st32(p + 48, h.meta); st32(p + 52, h.present);
}

inline Header make_header(uint8_t type, uint64_t token, uint16_t worker, uint16_t nworkers) {
  Header h{};
  h.magic = kMagic; h.version = kVersion; h.type = type;
  h.token = token; h.worker = worker; h.nworkers = nworkers;
  return h;
}

// Structural checks every receiver applies before looking at state: a packet that fails them
// is malformed and dropped. Returns nullptr when valid, else the reason.
inline const char* check_structure(const Header& h, size_t len) {
  if (len < kHeaderBytes) return "truncated";
  if (h.magic != kMagic) return "magic";
  if (h.version != kVersion) return "version";
  if (h.type < kData || h.type > kError) return "type";
  if (h.nworkers == 0 || h.nworkers > kMaxWorkers || h.worker >= h.nworkers) return "worker";
  if (h.type != kData && h.type != kResult) return len == kHeaderBytes ? nullptr : "size";
  if (h.dtype > 3) return "dtype";
  if (h.lanes == 0 || h.lanes > kMaxLanes || h.block_size == 0) return "layout";
  if (h.nslots == 0 || h.nblocks == 0 || h.slot >= h.nslots) return "slot";
  if (h.present > h.lanes) return "count";
  if (len != data_bytes(h.lanes, h.present, h.block_size, h.dtype)) return "size";
  return nullptr;
}

}  // namespace hvd_sparse::omni

// The OmniReduce-style aggregation protocol: the one definition shared by the C++ aggregator,
// the worker engine in hvd_sparse._C and (through hvd_sparse._protocol) every Python tool that
// reads or writes packets. docs/PROTOCOL.md is the prose spec of this file.
//
// Header fields are big-endian (network order); block values travel little-endian in the
// tensor's own element format. No torch here: the aggregator binary links without it.
#pragma once
#include <cstdint>
#include <cstring>

#include "../blocks.h"  // dtype codes (DType) and sizes, shared with the codec

namespace hvd_sparse::omni {

constexpr uint32_t kMagic = 0x4853504F;  // "HSPO"
// 2: the header grew the membership epoch (docs/PROTOCOL.md "Memberships"); a version-1 peer's
// packets are dropped as malformed, never misread.
constexpr uint8_t kVersion = 2;

enum Type : uint8_t {
  kData = 1,      // worker -> aggregator: one round of one slot
  kResult = 2,    // aggregator -> worker: the round's sum
  kRegister = 3,  // worker -> aggregator: join job `token` as `worker` of `nworkers`
  kRegAck = 4,    // aggregator -> worker
  kRelease = 5,   // worker -> aggregator: this worker has every result of `tensor`
  kBye = 6,       // worker -> aggregator: this worker leaves the job
  kError = 7,     // aggregator -> worker: `round` carries an ErrorCode; the slot is dead
  // aggregator -> worker, the answer to a resent DATA of a round in progress for kHeldAfter:
  // that DATA is held and the round waits for worker `worker` (the lowest one not heard), whom
  // the worker's timeout then names.
  kHeld = 8,
};
// Seconds a round waits before a resend into it is answered HELD: a wait of this length is a
// missing or stalled peer, whom a timeout should name; a busy peer's rounds get no extra
// packets (docs/PROTOCOL.md "Loss recovery").
constexpr double kHeldAfter = 0.5;

enum ErrorCode : uint32_t {
  kErrMismatch = 1,     // workers disagree on the tensor (dtype, block count, shape, layout)
  kErrJob = 2,          // REGISTER disagrees with the job (worker count) or too many jobs
  kErrCapacity = 3,     // the aggregator is out of slot memory
  kErrOverflow = 4,     // a FIXED32 sum left the int32 range: the tensor falls back, never wraps
  kErrUnsupported = 5,  // a switch cannot aggregate this job or tensor (dtype, workers, size)
};

// Wire dtypes: the tensor dtypes of blocks.h, plus int32 fixed point, what a switch can sum
// (no floating point there). A FIXED32 value q stands for q * 2^-e, e one power of two per
// tensor that the workers agree on before streaming it (docs/PROTOCOL.md, "Fixed point").
constexpr uint8_t kFixed32 = 4;
constexpr int kNumWireDTypes = 5;
inline int wire_size(uint8_t d) { return d == kFixed32 ? 4 : dtype_size(d); }
inline const char* wire_dtype_name(uint8_t d) { return d == kFixed32 ? "fixed32" : dtype_name(d); }

enum Flags : uint8_t {
  kFlagShadow = 1,  // round & 1: which of the slot's two sets this packet belongs to
  kFlagLast = 2,    // RESULT: every lane has finished; the slot is complete
  kFlagAuth = 4,    // the packet ends with an authentication trailer (below)
  // RESULT to one worker: a lane its DATA of the round carried that the bitmap leaves out
  // was its alone, and its sum is that block (the bytes a worker receives are the blocks the
  // others hold, not the union)
  kFlagOwn = 8,
};

// Authentication (docs/PROTOCOL.md "Authentication"): a packet flagged kFlagAuth ends with a
// trailer {uint64 sequence number, 16-byte AES-128-GMAC tag} over every byte before the tag,
// under the job's key, with the nonce (sender id, sequence number). A worker's sender id is its
// worker id; an aggregator's is kAggregatorSender + its index in the job's aggregator list,
// which every REGISTER carries in `slot`. The structural checks below see the packet without
// its trailer.
constexpr size_t kTagBytes = 16;
constexpr size_t kAuthBytes = 8 + kTagBytes;
constexpr uint32_t kAggregatorSender = 0x10000;

constexpr uint32_t kInf = 0xFFFFFFFFu;  // lane position "none": no further non-zero block
constexpr int kMaxLanes = 64;           // lanes per packet (fusion), bounded by the bitmap
constexpr int kMaxWorkers = 1024;
constexpr int kMaxDatagram = 65507;  // UDP over IPv4 (IPv6: 65527, so it fits both)
// The UDP port aggregators and the switch listen on in the docs, the testbed and the images.
constexpr uint16_t kAggregatorPort = 9999;

// The switch (docs/PROTOCOL.md "In-network aggregation"): the geometry the emulator's data
// plane runs with unless told otherwise (csrc/switch/pipeline.h) and its program declares
// (hvd_sparse/tools/switch/program.py). A switch's REGACK tells its workers the geometry it
// actually has (RegAck, below), so a real switch may differ.
constexpr uint32_t kSwitchValuesPerPass = 64;  // int32 values one pass sums (256 B)
// Cells (passes) a slot holds: one, so that every packet (256 B of values, SwitchML's payload)
// is summed in one pass of the pipe, at line rate; each further pass would be a recirculation
// (program.py: Limits.recirculation_ports).
constexpr uint32_t kSwitchCellsPerSlot = 1;
constexpr uint32_t kSwitchMaxWorkers = 32;     // workers per job: the seen-bitmap's 32 bits
constexpr uint32_t kSwitchCells = 8192;        // the register pool's cells (SwitchML's slots)

// The fixed header, 64 bytes: the one list of its fields (name, type, offset; offsets are part
// of the spec, docs/PROTOCOL.md). The struct, load_header/store_header and the field table that
// Python reads (hvd_sparse._protocol.FIELDS) are all generated from it.
#define HVD_SPARSE_HEADER_FIELDS(X)                                                             \
  X(magic, uint32_t, 0)                                                                         \
  X(version, uint8_t, 4)                                                                        \
  X(type, uint8_t, 5)                                                                           \
  X(dtype, uint8_t, 6) /* wire dtype: 0 float32, 1 float64, 2 float16, 3 bfloat16, 4 fixed32 */ \
  X(flags, uint8_t, 7)                                                                          \
  X(token, uint64_t, 8) /* job token (random, shared by the job's ranks) */                     \
  X(worker, uint16_t, 16)                                                                       \
  X(nworkers, uint16_t, 18)                                                                     \
  X(slot, uint32_t, 20)       /* slot of the tensor, 0 .. nslots-1 */                           \
  X(tensor, uint64_t, 24)     /* tensor id (hash of the name and its call count) */             \
  X(round, uint32_t, 32)      /* round of the slot (kError: the ErrorCode) */                   \
  X(lanes, uint16_t, 36)      /* lanes per slot (block fusion), 1 .. kMaxLanes */               \
  X(block_size, uint16_t, 38) /* elements per block */                                          \
  X(nblocks, uint32_t, 40)    /* blocks of the tensor */                                        \
  X(nslots, uint32_t, 44)     /* slots of the tensor over all aggregators */                    \
  X(meta, uint32_t, 48)       /* hash of the tensor's shape and dtype */                        \
  X(present, uint32_t, 52)    /* DATA/RESULT: blocks carried (popcount of the bitmap) */     \
  X(epoch, uint32_t, 56)      /* the job's membership (docs/PROTOCOL.md "Memberships") */      \
  X(reserved, uint32_t, 60)   /* 0: keeps what follows 8-byte aligned; non-zero is malformed */

struct Header {
#define HVD_SPARSE_FIELD(name, type, offset) type name;
  HVD_SPARSE_HEADER_FIELDS(HVD_SPARSE_FIELD)
#undef HVD_SPARSE_FIELD
};

struct HeaderField {
  const char* name;
  size_t offset, size;
};
constexpr HeaderField kHeaderFields[] = {
#define HVD_SPARSE_FIELD(name, type, offset) {#name, offset, sizeof(type)},
    HVD_SPARSE_HEADER_FIELDS(HVD_SPARSE_FIELD)
#undef HVD_SPARSE_FIELD
};
constexpr size_t kHeaderBytes = 64;

// The fields are packed back to back and fill the header exactly.
constexpr bool header_packed() {
  size_t at = 0;
  for (const HeaderField& f : kHeaderFields) {
    if (f.offset != at) return false;
    at += f.size;
  }
  return at == kHeaderBytes;
}
static_assert(header_packed(), "header fields must be contiguous and fill kHeaderBytes");
constexpr size_t kFlagsOffset = 7;  // where a sender sets kFlagAuth in a packet it signs
static_assert(kHeaderFields[4].offset == kFlagsOffset && kHeaderFields[4].size == 1);
// DATA and RESULT follow the header with: a uint64 bitmap of the lanes that carry a block,
// `lanes` entries {uint32 offset, uint32 next}, then `present` blocks of `block_size` values.
constexpr size_t kBitmapBytes = 8;
constexpr size_t kLaneBytes = 8;

inline size_t data_bytes(uint32_t lanes, uint32_t present, uint32_t bs, uint8_t dtype) {
  return kHeaderBytes + kBitmapBytes + size_t(lanes) * kLaneBytes +
         size_t(present) * bs * wire_size(dtype);
}

// How a tensor of `nblocks` blocks is cut up: `lanes` blocks per packet (as many as fit
// `payload` bytes of values, 1 .. kMaxLanes) and `nslots` slots, one per packet's worth of
// blocks but at most `max_slots` (over all aggregators), so that long tensors take rounds.
struct Layout {
  uint32_t lanes, nslots;
};
inline Layout layout(uint64_t nblocks, uint32_t block_size, uint32_t esize, uint64_t payload,
                     uint64_t max_slots) {
  uint64_t lanes = payload / (uint64_t(block_size) * esize);
  lanes = lanes < 1 ? 1 : lanes > kMaxLanes ? kMaxLanes : lanes;
  uint64_t nslots = (nblocks + lanes - 1) / lanes;
  nslots = nslots < 1 ? 1 : nslots > max_slots ? max_slots : nslots;
  return {uint32_t(lanes), uint32_t(nslots)};
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
inline void st16(uint8_t* p, uint16_t v) {
  p[0] = uint8_t(v >> 8);
  p[1] = uint8_t(v);
}
inline void st32(uint8_t* p, uint32_t v) {
  p[0] = uint8_t(v >> 24);
  p[1] = uint8_t(v >> 16);
  p[2] = uint8_t(v >> 8);
  p[3] = uint8_t(v);
}
inline void st64(uint8_t* p, uint64_t v) {
  st32(p, uint32_t(v >> 32));
  st32(p + 4, uint32_t(v));
}

// Big-endian load and store of one header field, by its type.
inline uint64_t load_be(const uint8_t* p, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i) v = v << 8 | p[i];
  return v;
}
inline void store_be(uint8_t* p, size_t n, uint64_t v) {
  for (size_t i = n; i-- > 0; v >>= 8) p[i] = uint8_t(v);
}

inline Header load_header(const uint8_t* p) {
  Header h;
#define HVD_SPARSE_FIELD(name, type, offset) h.name = type(load_be(p + offset, sizeof(type)));
  HVD_SPARSE_HEADER_FIELDS(HVD_SPARSE_FIELD)
#undef HVD_SPARSE_FIELD
  return h;
}

inline void store_header(uint8_t* p, const Header& h) {
#define HVD_SPARSE_FIELD(name, type, offset) store_be(p + offset, sizeof(type), h.name);
  HVD_SPARSE_HEADER_FIELDS(HVD_SPARSE_FIELD)
#undef HVD_SPARSE_FIELD
}

inline Header make_header(uint8_t type, uint64_t token, uint32_t epoch, uint16_t worker,
                          uint16_t nworkers) {
  Header h{};
  h.magic = kMagic;
  h.version = kVersion;
  h.type = type;
  h.token = token;
  h.epoch = epoch;
  h.worker = worker;
  h.nworkers = nworkers;
  return h;
}

// The header of the RESULT that answers a slot's DATA `h`: round `round` (its parity names the
// shadow set), `present` blocks of `dtype`, flagged last when no lane has a next position.
inline Header result_header(const Header& h, uint16_t nworkers, uint8_t dtype, uint32_t round,
                            uint32_t present, bool last) {
  Header r = make_header(kResult, h.token, h.epoch, 0, nworkers);
  r.dtype = dtype;
  r.slot = h.slot;
  r.tensor = h.tensor;
  r.round = round;
  r.flags = uint8_t((round & 1 ? kFlagShadow : 0) | (last ? kFlagLast : 0));
  r.lanes = h.lanes;
  r.block_size = h.block_size;
  r.nblocks = h.nblocks;
  r.nslots = h.nslots;
  r.meta = h.meta;
  r.present = present;
  return r;
}

// The HELD that answers `h`, a resent DATA of the round in progress, when the round waits for
// worker `missing`.
inline Header held_header(const Header& h, uint16_t nworkers, uint16_t missing) {
  Header r = make_header(kHeld, h.token, h.epoch, missing, nworkers);
  r.slot = h.slot;
  r.tensor = h.tensor;
  r.round = h.round;
  r.flags = uint8_t(h.round & 1 ? kFlagShadow : 0);
  return r;
}

// What a REGACK tells a worker (docs/PROTOCOL.md "Jobs"): in `nslots` the slot groups the job
// owns on a switch, in `block_size` the int32 values one of its passes sums and in `lanes` the
// cells (passes) one slot holds. A software aggregator sends 0 in all three: no per-job slot
// limit and no per-slot cap.
struct RegAck {
  uint32_t groups = 0, values_per_pass = 0, cells_per_slot = 0;
  // Bytes of block values one packet may carry so that a slot holds it (0: no cap). A lane
  // takes whole passes, so the block size decides what fits within it.
  uint64_t slot_bytes() const { return uint64_t(values_per_pass) * cells_per_slot * 4; }
};
constexpr uint32_t kMaxRegAckGeometry = 0xFFFF;  // values_per_pass, cells_per_slot: 16 bits
inline RegAck load_regack(const Header& h) { return {h.nslots, h.block_size, h.lanes}; }
inline void store_regack(Header& h, const RegAck& a) {
  h.nslots = a.groups;
  h.block_size = uint16_t(a.values_per_pass);
  h.lanes = uint16_t(a.cells_per_slot);
}

// Structural checks every receiver applies before looking at state: a packet that fails them
// is malformed and dropped. Returns nullptr when valid, else the reason.
inline const char* check_structure(const Header& h, size_t len) {
  if (len < kHeaderBytes) return "truncated";
  if (h.magic != kMagic) return "magic";
  if (h.version != kVersion) return "version";
  if (h.type < kData || h.type > kHeld) return "type";
  if (h.reserved != 0) return "reserved";
  if (h.nworkers == 0 || h.nworkers > kMaxWorkers || h.worker >= h.nworkers) return "worker";
  if (h.type != kData && h.type != kResult) return len == kHeaderBytes ? nullptr : "size";
  if ((h.flags & kFlagOwn) && h.type != kResult) return "flags";
  if (h.dtype >= kNumWireDTypes) return "dtype";
  if (h.lanes == 0 || h.lanes > kMaxLanes || h.block_size == 0) return "layout";
  if (h.nslots == 0 || h.nblocks == 0 || h.slot >= h.nslots) return "slot";
  if (h.present > h.lanes) return "count";
  if (len != data_bytes(h.lanes, h.present, h.block_size, h.dtype)) return "size";
  return nullptr;
}

// The bitmap and lane table of a structurally valid DATA against the lanes' positions `cur`
// (nullptr: round 0, every non-empty lane at position 0): offsets at the positions, nexts
// beyond them and inside their streams, the bitmap's population `present`.
inline bool lanes_valid(const Header& h, const uint8_t* p, const uint32_t* cur) {
  const uint64_t bitmap = ld64(p + kHeaderBytes);
  if (h.lanes < 64 && (bitmap >> h.lanes)) return false;
  if (uint32_t(__builtin_popcountll(bitmap)) != h.present) return false;
  const uint8_t* lane = p + kHeaderBytes + kBitmapBytes;
  for (uint32_t l = 0; l < h.lanes; ++l) {
    uint32_t off = ld32(lane + l * kLaneBytes), nxt = ld32(lane + l * kLaneBytes + 4);
    uint32_t len = stream_length(h.slot, l, h.nblocks, h.nslots, h.lanes);
    uint32_t want = cur ? cur[l] : len ? 0 : kInf;
    if (off != want || (off == kInf && ((bitmap >> l & 1) || nxt != kInf)) ||
        (nxt != kInf && (nxt <= off || nxt >= len)))
      return false;
  }
  return true;
}

}  // namespace hvd_sparse::omni

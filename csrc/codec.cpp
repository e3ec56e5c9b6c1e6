// Block codec and collective segments (hvd_sparse._C). Every per-element and per-block loop of
// the allgather and Zen schemes lives here; Python only moves the resulting byte buffers through
// Horovod's collectives.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "blocks.h"
#include "parallel.h"
#include "segment.h"
#include "torch_dtype.h"

namespace hvd_sparse {

// csrc/fresh_zeros.cpp: a large byte buffer whose pages stay mapped from call to call.
at::Tensor reused_empty(int64_t nbytes);

// Threads the codec may use. Several ranks share a host, so hvd_sparse.init() sets this to
// cores / local ranks: oversubscribed OpenMP teams spin and run many times slower.
// Outside the anonymous namespace: the sparsify kernels share the budget (parallel.h).
int g_threads = 0;  // 0: torch's intra-op thread count

namespace {

// A contiguous CPU tensor seen as raw blocks.
struct Flat {
  const uint8_t* data;
  int64_t numel, bs, nblocks;
  int width;
  uint8_t dtype;
};

Flat flat_of(const at::Tensor& t, int64_t bs) {
  TORCH_CHECK(t.device().is_cpu(), "hvd_sparse codec: tensor must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), "hvd_sparse codec: tensor must be contiguous");
  TORCH_CHECK(bs > 0 && bs <= (1 << 24), "hvd_sparse codec: block size out of range");
  uint8_t d = dtype_code(t.scalar_type());
  return {static_cast<const uint8_t*>(t.data_ptr()),
          t.numel(),
          bs,
          num_blocks(t.numel(), bs),
          dtype_size(d),
          d};
}

// A block is non-zero when any element has a magnitude bit set. clear_signed_zeros: rewrite the
// blocks that hold only zeros, some of them -0, to +0 (in place; values unchanged), so that a
// result later built in this tensor's memory is +0 there on every rank.
at::Tensor mask_of(const Flat& f, bool clear_signed_zeros = false) {
  auto mask = at::empty({f.nblocks}, at::kByte);
  uint8_t* m = mask.data_ptr<uint8_t>();
  const int64_t bytes = f.bs * f.width;
  const uint64_t mag = magnitude_bits(f.width);
  par_for(0, f.nblocks, std::max<int64_t>(1, (1 << 20) / bytes), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = std::min(f.bs, f.numel - b * f.bs);
      const uint64_t bits = block_bits(f.data + b * bytes, n, f.width);
      m[b] = (bits & mag) != 0;
      if (clear_signed_zeros && bits != 0 && !m[b])
        std::memset(const_cast<uint8_t*>(f.data) + b * bytes, 0, n * f.width);
    }
  });
  return mask;
}

std::vector<uint32_t> nonzero_list(const at::Tensor& mask, int64_t nblocks) {
  TORCH_CHECK(mask.scalar_type() == at::kByte && mask.is_contiguous() && mask.numel() == nblocks,
              "hvd_sparse codec: mask must be a contiguous uint8 tensor with one entry per block");
  TORCH_CHECK(nblocks < (int64_t(1) << 32), "hvd_sparse codec: too many blocks");
  const uint8_t* m = mask.data_ptr<uint8_t>();
  std::vector<uint32_t> idx;
  idx.reserve(static_cast<size_t>(std::count_if(m, m + nblocks, [](uint8_t x) { return x != 0; })));
  for (int64_t b = 0; b < nblocks; ++b)
    if (m[b]) idx.push_back(static_cast<uint32_t>(b));
  return idx;
}

// Copies blocks idx[k] of f to dst[k], zero-padding the tail block.
void copy_blocks(const Flat& f, const uint32_t* idx, int64_t count, uint8_t* dst) {
  const int64_t bytes = f.bs * f.width;
  par_for(0, count, std::max<int64_t>(1, (1 << 18) / bytes), [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      int64_t b = idx[k];
      int64_t n = std::min(f.bs, f.numel - b * f.bs) * f.width;
      std::memcpy(dst + k * bytes, f.data + b * bytes, n);
      if (n < bytes) std::memset(dst + k * bytes + n, 0, bytes - n);
    }
  });
}

uint64_t segment_bytes(uint8_t kind, uint64_t count, uint64_t positions, int64_t bs, int width) {
  uint64_t head = kind == kIndexList ? align8(4 * count) : align8((positions + 7) / 8);
  return align8(sizeof(SegHeader) + head + count * bs * width);
}

SegHeader make_header(const Flat& f, uint8_t kind, uint64_t count, uint32_t part, uint32_t nparts,
                      uint64_t meta, uint64_t nbytes, uint64_t nnz_local) {
  SegHeader h{};
  h.magic = kSegMagic;
  h.version = kSegVersion;
  h.dtype = f.dtype;
  h.kind = kind;
  h.block_size = static_cast<uint32_t>(f.bs);
  h.count = static_cast<uint32_t>(count);
  h.part = part;
  h.nparts = nparts;
  h.numel = static_cast<uint64_t>(f.numel);
  h.meta = meta;
  h.nbytes = nbytes;
  h.nnz_local = nnz_local;
  return h;
}

// Block indices of each partition, ascending: the positions a partition bitmap refers to.
std::vector<std::vector<uint32_t>> partition_positions(int64_t nblocks, uint32_t nparts) {
  std::vector<std::vector<uint32_t>> pos(nparts);
  for (auto& p : pos) p.reserve(static_cast<size_t>(nblocks / nparts + 16));
  for (int64_t b = 0; b < nblocks; ++b)
    pos[partition_of(b, nparts)].push_back(static_cast<uint32_t>(b));
  return pos;
}

// One parsed, validated segment.
struct Seg {
  const SegHeader* h;
  const uint32_t* idx;          // ascending block indices
  std::vector<uint32_t> owned;  // backing store when decoded from a bitmap
  const uint8_t* vals;
};

// What every segment must agree on: this rank's view of the tensor.
struct Expect {
  uint8_t dtype;
  int64_t bs, numel;
  uint64_t meta;
};

[[noreturn]] void bad(int64_t s, const std::string& what) {
  std::ostringstream os;
  os << "rank " << s << ": " << what;
  throw std::runtime_error(os.str());
}

// Segments are laid out on 8-byte boundaries from the buffer's start and read as typed arrays; a
// buffer that does not itself start on one (a view at an odd offset) is copied once.
at::Tensor aligned8(const at::Tensor& buf) {
  return reinterpret_cast<uintptr_t>(buf.data_ptr()) % 8 ? buf.clone() : buf;
}

// Parses nsegs segments from buf (one per rank, in rank order) and checks each against ex;
// part_is_rank: segment s must cover partition s (Zen results). Bounds are checked before any
// write, so a bad buffer never changes the output.
std::vector<Seg> parse(const at::Tensor& buf, int64_t nsegs, const Expect& ex, int64_t want_part,
                       bool part_is_rank) {
  TORCH_CHECK(buf.scalar_type() == at::kByte && buf.is_contiguous(),
              "segment buffer must be uint8");
  const uint8_t* base = buf.data_ptr<uint8_t>();
  const uint64_t size = static_cast<uint64_t>(buf.numel());
  const int64_t nblocks = num_blocks(ex.numel, ex.bs);
  std::vector<Seg> segs(static_cast<size_t>(nsegs));
  std::vector<std::vector<uint32_t>> positions;
  uint64_t off = 0;
  for (int64_t s = 0; s < nsegs; ++s) {
    if (size - off < sizeof(SegHeader)) bad(s, "truncated segment (no header)");
    const SegHeader* h = reinterpret_cast<const SegHeader*>(base + off);
    if (h->magic != kSegMagic || h->version != kSegVersion) bad(s, "not an hvd_sparse segment");
    if (h->dtype != ex.dtype || h->numel != static_cast<uint64_t>(ex.numel) || h->meta != ex.meta) {
      std::ostringstream os;
      os << "tensor mismatch across ranks: rank " << s << " has numel=" << h->numel
         << " dtype=" << dtype_name(h->dtype) << " shape-hash=" << std::hex << h->meta << std::dec
         << ", this rank has numel=" << ex.numel << " dtype=" << dtype_name(ex.dtype)
         << " shape-hash=" << std::hex << ex.meta;
      throw std::runtime_error(os.str());
    }
    if (h->block_size != static_cast<uint64_t>(ex.bs)) bad(s, "block size differs across ranks");
    if (h->count > static_cast<uint64_t>(nblocks)) bad(s, "block count out of range");
    if (want_part >= 0 && h->part != static_cast<uint64_t>(want_part)) bad(s, "wrong partition");
    if (part_is_rank && h->part != static_cast<uint64_t>(s)) bad(s, "wrong partition");
    if (h->nparts == 0 || h->part >= h->nparts) bad(s, "partition out of range");
    Seg& g = segs[static_cast<size_t>(s)];
    g.h = h;
    uint64_t npos = 0;
    if (h->kind == kPartitionBitmap) {
      // Only Zen's partition sums are bitmaps, one per rank, so nparts is the segment count.
      // Checked before listing the positions, which takes memory in nparts: a forged count
      // must not ask for gigabytes.
      if (h->nparts != static_cast<uint64_t>(nsegs))
        bad(s, "partition count differs from the ranks'");
      if (positions.empty()) positions = partition_positions(nblocks, h->nparts);
      npos = positions[h->part].size();
    } else if (h->kind != kIndexList) {
      bad(s, "unknown segment kind");
    }
    uint64_t nbytes = segment_bytes(h->kind, h->count, npos, ex.bs, dtype_size(ex.dtype));
    if (h->nbytes != nbytes || nbytes > size - off)
      bad(s, "segment size is inconsistent or truncated");
    const uint8_t* body = base + off + sizeof(SegHeader);
    if (h->kind == kIndexList) {
      g.idx = reinterpret_cast<const uint32_t*>(body);
      for (uint32_t k = 0; k < h->count; ++k)
        if (g.idx[k] >= nblocks || (k > 0 && g.idx[k] <= g.idx[k - 1]))
          bad(s, "block indices out of range or not ascending");
      g.vals = body + align8(4ull * h->count);
    } else {
      const auto& pos = positions[h->part];
      for (uint64_t k = 0; k < npos; ++k)
        if (body[k >> 3] >> (k & 7) & 1) g.owned.push_back(pos[k]);
      if (g.owned.size() != h->count) bad(s, "bitmap population differs from block count");
      g.idx = g.owned.data();
      g.vals = body + align8((npos + 7) / 8);
    }
    off += nbytes;
  }
  if (off != size) throw std::runtime_error("trailing bytes after the last segment");
  return segs;
}

// Copies a summed block to the result past the caches: the result (tens to hundreds of MiB) is
// not read again here, and a plain store first reads each line it writes, which made the
// decode ~3.5x its memory bound (scripts/bench/bench_hostwork.py).
inline void stream_out(void* dst, const void* src, size_t bytes) {
#if defined(__SSE2__)
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  if ((reinterpret_cast<uintptr_t>(d) & 15) == 0 && bytes % 16 == 0) {
    for (size_t i = 0; i < bytes; i += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

template <typename A, typename V>
void add_block(A* out, const uint8_t* src, int64_t n) {
  const V* v = reinterpret_cast<const V*>(src);
  for (int64_t i = 0; i < n; ++i) out[i] += static_cast<A>(static_cast<float>(v[i]));
}
template <>
void add_block<double, double>(double* out, const uint8_t* src, int64_t n) {
  const double* v = reinterpret_cast<const double*>(src);
  for (int64_t i = 0; i < n; ++i) out[i] += v[i];
}

// Writes into out (the tensor's dtype V) every block some segment carries: the segments' sum in
// A (float64 for float64, else float32), added in rank order for every element so all ranks get
// identical bits, times scale, rounded once to V. Other blocks of out are neither read nor
// written: out must hold +0 there, and fresh zero pages stay unmapped (fresh_zeros.cpp). Sums a
// span of blocks at a time in a local buffer; parallel over disjoint block ranges. Returns the
// number of blocks written.
template <typename A, typename V>
int64_t sum_segments(const std::vector<Seg>& segs, V* out, int64_t numel, int64_t bs,
                     double scale) {
  const int64_t nblocks = num_blocks(numel, bs);
  const int64_t bytes = bs * static_cast<int64_t>(sizeof(V));
  const int64_t span = std::max<int64_t>(1, 16384 / bs);  // local buffer: 64-128 KiB
  const A sc = static_cast<A>(scale);
  std::atomic<int64_t> written{0};
  par_for(0, nblocks, std::max<int64_t>(span, 4096 / bs * 64), [&](int64_t c0, int64_t c1) {
    std::vector<A> acc(static_cast<size_t>(span * bs));
    std::vector<uint8_t> seen(static_cast<size_t>(span));
    std::vector<const uint32_t*> next(segs.size());  // per segment: its first block not yet summed
    for (size_t s = 0; s < segs.size(); ++s)
      next[s] =
          std::lower_bound(segs[s].idx, segs[s].idx + segs[s].h->count, static_cast<uint32_t>(c0));
    int64_t count = 0;
    for (int64_t b0 = c0; b0 < c1; b0 += span) {
      const int64_t b1 = std::min(c1, b0 + span);
      std::fill(seen.begin(), seen.end(), uint8_t(0));
      for (size_t s = 0; s < segs.size(); ++s) {
        const Seg& g = segs[s];
        const uint32_t* end = g.idx + g.h->count;
        for (const uint32_t*& p = next[s]; p != end && *p < b1; ++p) {
          const int64_t b = *p, n = std::min(bs, numel - b * bs);
          A* a = acc.data() + (b - b0) * bs;
          if (!seen[b - b0]) std::fill(a, a + n, A(0));
          seen[b - b0] = 1;
          add_block<A, V>(a, g.vals + (p - g.idx) * bytes, n);
        }
      }
      for (int64_t b = b0; b < b1; ++b) {
        if (!seen[b - b0]) continue;
        A* a = acc.data() + (b - b0) * bs;
        V* o = out + b * bs;
        const int64_t n = std::min(bs, numel - b * bs);
        if constexpr (std::is_same_v<A, V>) {
          if (scale != 1.0)
            for (int64_t i = 0; i < n; ++i) a[i] *= sc;
          stream_out(o, a, n * sizeof(V));
        } else if (scale == 1.0) {
          for (int64_t i = 0; i < n; ++i) o[i] = static_cast<V>(a[i]);
        } else {
          for (int64_t i = 0; i < n; ++i) o[i] = static_cast<V>(a[i] * sc);
        }
        ++count;
      }
    }
#if defined(__SSE2__)
    _mm_sfence();  // the streamed stores before the result is handed over
#endif
    written += count;
  });
  return written;
}

template <typename F>
auto dispatch_wire(uint8_t dtype, F&& f) {
  switch (dtype) {
    case kF32: return f(float{});
    case kF64: return f(double{});
    case kF16: return f(c10::Half{});
    default: return f(c10::BFloat16{});
  }
}

py::tuple stats_tuple(const std::vector<Seg>& segs, int64_t uni) {
  py::list counts, nnz;
  for (const Seg& g : segs) {
    counts.append(g.h->count);
    nnz.append(g.h->nnz_local);
  }
  return py::make_tuple(counts, nnz, uni);
}

}  // namespace

// ---- codec -------------------------------------------------------------------------------------

at::Tensor block_mask(const at::Tensor& t, int64_t bs, bool clear_signed_zeros) {
  return mask_of(flat_of(t, bs), clear_signed_zeros);
}

std::tuple<at::Tensor, at::Tensor> pack(const at::Tensor& t, int64_t bs,
                                        c10::optional<at::Tensor> mask) {
  Flat f = flat_of(t, bs);
  auto idx = nonzero_list(mask ? *mask : mask_of(f), f.nblocks);
  auto vals = at::empty({static_cast<int64_t>(idx.size()), bs}, t.options());
  copy_blocks(f, idx.data(), static_cast<int64_t>(idx.size()),
              static_cast<uint8_t*>(vals.data_ptr()));
  auto out_idx = at::empty({static_cast<int64_t>(idx.size())}, at::kInt);
  // memcpy from an empty vector's data() (null) is undefined even for 0 bytes (UBSan)
  if (!idx.empty()) std::memcpy(out_idx.data_ptr(), idx.data(), idx.size() * 4);
  return {out_idx, vals};
}

void unpack(at::Tensor& out, const at::Tensor& idx, const at::Tensor& vals, int64_t bs) {
  TORCH_CHECK(out.is_contiguous() && vals.is_contiguous() && idx.is_contiguous(),
              "unpack: contiguous tensors");
  TORCH_CHECK(idx.scalar_type() == at::kInt && vals.scalar_type() == out.scalar_type(),
              "unpack: dtypes");
  TORCH_CHECK(vals.numel() == idx.numel() * bs, "unpack: vals must be [len(idx), block_size]");
  const int64_t numel = out.numel(), nblocks = num_blocks(numel, bs), k = idx.numel();
  const int32_t* ix = idx.data_ptr<int32_t>();
  for (int64_t i = 0; i < k; ++i)
    TORCH_CHECK(ix[i] >= 0 && ix[i] < nblocks && (i == 0 || ix[i] > ix[i - 1]),
                "unpack: block indices must be ascending and in range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "unpack", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* v = vals.data_ptr<scalar_t>();
    par_for(0, k, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        int64_t b = ix[i], n = std::min(bs, numel - b * bs);
        for (int64_t j = 0; j < n; ++j) o[b * bs + j] += v[i * bs + j];
      }
    });
  });
}

// ---- allgather scheme ------------------------------------------------------------------------

// One index-list segment holding the non-zero blocks of t.
at::Tensor encode(const at::Tensor& t, int64_t bs, uint64_t meta, c10::optional<at::Tensor> mask) {
  Flat f = flat_of(t, bs);
  auto idx = nonzero_list(mask ? *mask : mask_of(f), f.nblocks);
  const uint64_t count = idx.size();
  const uint64_t nbytes = segment_bytes(kIndexList, count, 0, bs, f.width);
  auto buf = reused_empty(static_cast<int64_t>(nbytes));  // every byte written below
  uint8_t* p = buf.data_ptr<uint8_t>();
  SegHeader h = make_header(f, kIndexList, count, 0, 1, meta, nbytes, count);
  std::memcpy(p, &h, sizeof h);
  uint8_t* body = p + sizeof h;
  std::memset(body, 0, align8(4 * count));
  if (count) std::memcpy(body, idx.data(), 4 * count);  // data() is null when empty
  uint8_t* vals = body + align8(4 * count);
  copy_blocks(f, idx.data(), static_cast<int64_t>(count), vals);
  std::memset(vals + count * bs * f.width, 0, p + nbytes - (vals + count * bs * f.width));
  return buf;
}

// Validates nsegs concatenated segments and writes their scaled sum into out (the tensor's
// dtype, numel elements) in every block they carry; out must be +0 in all other blocks (see
// sum_segments). Returns (counts, nnz_local, union).
py::tuple decode_sum(const at::Tensor& buf, at::Tensor& out, int64_t bs, uint64_t meta,
                     int64_t dtype, int64_t numel, int64_t nsegs, bool part_is_rank, double scale) {
  Expect ex{static_cast<uint8_t>(dtype), bs, numel, meta};
  TORCH_CHECK(out.is_contiguous() && out.numel() == numel, "decode_sum: output size");
  TORCH_CHECK(out.device().is_cpu() && dtype_code(out.scalar_type()) == ex.dtype,
              "decode_sum: output must be a CPU tensor of the segments' dtype");
  const at::Tensor held = aligned8(buf);  // segs point into it
  std::vector<Seg> segs;
  int64_t uni;
  {
    py::gil_scoped_release nogil;
    segs = parse(held, nsegs, ex, -1, part_is_rank);
    uni = dispatch_wire(ex.dtype, [&](auto v) -> int64_t {
      using V = decltype(v);
      using A = acc_t<V>;
      return sum_segments<A, V>(segs, static_cast<V*>(out.data_ptr()), numel, bs, scale);
    });
  }
  return stats_tuple(segs, uni);
}

// ---- Zen scheme ----------------------------------------------------------------------------

// Splits the non-zero blocks of t by partition_of(): one segment per destination rank, in rank
// order. Returns the buffer and the byte size of each rank's segment (the alltoall splits).
std::tuple<at::Tensor, std::vector<int64_t>> zen_encode(const at::Tensor& t, int64_t bs,
                                                        int64_t nparts, uint64_t meta,
                                                        c10::optional<at::Tensor> mask) {
  TORCH_CHECK(nparts >= 1, "zen_encode: nparts must be >= 1");
  Flat f = flat_of(t, bs);
  auto idx = nonzero_list(mask ? *mask : mask_of(f), f.nblocks);
  const auto np = static_cast<uint32_t>(nparts);
  std::vector<uint32_t> dest(idx.size());
  std::vector<uint64_t> cnt(np, 0);
  for (size_t k = 0; k < idx.size(); ++k) cnt[dest[k] = partition_of(idx[k], np)]++;
  std::vector<int64_t> splits(np);
  std::vector<uint64_t> off(np + 1, 0);
  for (uint32_t p = 0; p < np; ++p) {
    splits[p] = static_cast<int64_t>(segment_bytes(kIndexList, cnt[p], 0, bs, f.width));
    off[p + 1] = off[p] + splits[p];
  }
  auto buf = reused_empty(static_cast<int64_t>(off[np]));
  uint8_t* base = buf.data_ptr<uint8_t>();
  const int64_t bytes = bs * f.width;
  for (uint32_t p = 0; p < np; ++p) {
    SegHeader h = make_header(f, kIndexList, cnt[p], p, np, meta, splits[p], idx.size());
    std::memcpy(base + off[p], &h, sizeof h);
    // Zero what the scatter below leaves unwritten: the index list's padding, the tail.
    uint8_t* body = base + off[p] + sizeof h;
    std::memset(body, 0, align8(4 * cnt[p]));
    uint8_t* end = body + align8(4 * cnt[p]) + cnt[p] * bytes;
    std::memset(end, 0, base + off[p + 1] - end);
  }
  // Stable scatter: each destination's indices stay ascending; remember each block's slot.
  std::vector<uint64_t> fill(np, 0);
  std::vector<uint8_t*> slot(idx.size());
  for (size_t k = 0; k < idx.size(); ++k) {
    uint32_t p = dest[k];
    uint8_t* body = base + off[p] + sizeof(SegHeader);
    reinterpret_cast<uint32_t*>(body)[fill[p]] = idx[k];
    slot[k] = body + align8(4 * cnt[p]) + fill[p] * bytes;
    fill[p]++;
  }
  par_for(0, static_cast<int64_t>(idx.size()), std::max<int64_t>(1, (1 << 18) / bytes),
          [&](int64_t k0, int64_t k1) {
            for (int64_t k = k0; k < k1; ++k) copy_blocks(f, &idx[k], 1, slot[k]);
          });
  return {buf, splits};
}

// Blocks of a tensor of nblocks that partition_of() gives to `part`.
int64_t count_partition(int64_t nblocks, int64_t part, int64_t nparts) {
  int64_t n = 0;
  for (int64_t b = 0; b < nblocks; ++b) n += partition_of(b, nparts) == part;
  return n;
}

// Sums the segments every rank sent for partition `part` and returns the result as one segment
// (index list or partition bitmap, whichever is smaller) for the final allgather.
at::Tensor zen_reduce(const at::Tensor& buf, int64_t bs, uint64_t meta, int64_t dtype,
                      int64_t numel, int64_t nsegs, int64_t part, int64_t nparts,
                      int64_t nnz_local) {
  Expect ex{static_cast<uint8_t>(dtype), bs, numel, meta};
  const at::Tensor held = aligned8(buf);  // segs point into it
  at::Tensor out;
  {
    py::gil_scoped_release nogil;
    auto segs = parse(held, nsegs, ex, part, false);
    for (size_t s = 0; s < segs.size(); ++s)
      if (segs[s].h->nparts != static_cast<uint64_t>(nparts)) bad(s, "partition count differs");
    // The union: each segment's indices are ascending (parse checked), so merges, not a sort.
    std::vector<uint32_t> uni;
    for (const Seg& g : segs) {
      const auto mid = static_cast<std::ptrdiff_t>(uni.size());
      uni.insert(uni.end(), g.idx, g.idx + g.h->count);
      std::inplace_merge(uni.begin(), uni.begin() + mid, uni.end());
    }
    uni.erase(std::unique(uni.begin(), uni.end()), uni.end());
    const int64_t nblocks = num_blocks(numel, bs), U = static_cast<int64_t>(uni.size());
    const int width = dtype_size(ex.dtype);
    const uint64_t npos = count_partition(nblocks, part, nparts);
    const uint8_t kind = align8((npos + 7) / 8) < align8(4ull * U) ? kPartitionBitmap : kIndexList;
    const uint64_t nbytes = segment_bytes(kind, U, npos, bs, width);
    out = reused_empty(static_cast<int64_t>(nbytes));
    uint8_t* p = out.data_ptr<uint8_t>();
    uint8_t* vals = p + sizeof(SegHeader) +
                    (kind == kIndexList ? align8(4ull * U) : align8((npos + 7) / 8));
    // Zero all but the values, which are written whole below (the bitmap is or-ed into).
    std::memset(p, 0, vals - p);
    std::memset(vals + U * bs * width, 0, p + nbytes - (vals + U * bs * width));
    Flat f{nullptr, numel, bs, nblocks, width, ex.dtype};
    SegHeader h = make_header(f, kind, U, part, nparts, meta, nbytes, nnz_local);
    std::memcpy(p, &h, sizeof h);
    uint8_t* body = p + sizeof h;
    if (kind == kIndexList) {
      if (U) std::memcpy(body, uni.data(), 4 * U);  // data() is null when empty
    } else {
      int64_t j = 0, k = 0;
      for (int64_t b = 0; b < nblocks && j < U; ++b) {
        if (partition_of(b, nparts) != part) continue;
        if (uni[j] == b) {
          body[k >> 3] |= uint8_t(1u << (k & 7));
          ++j;
        }
        ++k;
      }
    }
    dispatch_wire(ex.dtype, [&](auto v) {
      using V = decltype(v);
      using A = acc_t<V>;
      // Accumulate the partition's union compactly, then round once to the wire dtype.
      par_for(0, U, 16, [&](int64_t u0, int64_t u1) {
        if (u0 >= u1) return;
        std::vector<A> acc(static_cast<size_t>(bs));
        // Per segment, its first block not below uni[u]: uni ascends, so the cursors only move
        // forward (one search per chunk, not per block and segment).
        std::vector<const uint32_t*> next(segs.size());
        for (size_t s = 0; s < segs.size(); ++s)
          next[s] = std::lower_bound(segs[s].idx, segs[s].idx + segs[s].h->count, uni[u0]);
        for (int64_t u = u0; u < u1; ++u) {
          std::fill(acc.begin(), acc.end(), A(0));
          for (size_t s = 0; s < segs.size(); ++s) {  // in rank order: identical bits everywhere
            const Seg& g = segs[s];
            const uint32_t*& q = next[s];
            const uint32_t* end = g.idx + g.h->count;
            while (q != end && *q < uni[u]) ++q;
            if (q != end && *q == uni[u])
              add_block<A, V>(acc.data(), g.vals + (q - g.idx) * bs * width, bs);
          }
          V* dst = reinterpret_cast<V*>(vals) + u * bs;
          for (int64_t i = 0; i < bs; ++i) dst[i] = static_cast<V>(acc[i]);
        }
      });
      return 0;
    });
  }
  return out;
}

void register_codec(py::module_& m) {
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("block_mask", &block_mask, "uint8 mask of non-zero blocks", py::arg("t"),
        py::arg("block_size"), py::arg("clear_signed_zeros") = false, nogil());
  m.def("pack", &pack, py::arg("t"), py::arg("block_size"), py::arg("mask") = py::none(), nogil());
  m.def("unpack", &unpack, py::arg("out"), py::arg("idx"), py::arg("vals"), py::arg("block_size"),
        nogil());
  m.def("encode", &encode, py::arg("t"), py::arg("block_size"), py::arg("meta"),
        py::arg("mask") = py::none(), nogil());
  m.def("decode_sum", &decode_sum, py::arg("buf"), py::arg("out"), py::arg("block_size"),
        py::arg("meta"), py::arg("dtype"), py::arg("numel"), py::arg("nsegs"),
        py::arg("part_is_rank") = false, py::arg("scale") = 1.0);
  m.def("zen_encode", &zen_encode, py::arg("t"), py::arg("block_size"), py::arg("nparts"),
        py::arg("meta"), py::arg("mask") = py::none(), nogil());
  m.def("zen_reduce", &zen_reduce, py::arg("buf"), py::arg("block_size"), py::arg("meta"),
        py::arg("dtype"), py::arg("numel"), py::arg("nsegs"), py::arg("part"), py::arg("nparts"),
        py::arg("nnz_local"));
  m.def("partition_of", [](int64_t b, int64_t n) { return partition_of(b, n); });
  m.def("count_partition", &count_partition);
  m.def(
      "set_threads", [](int n) { g_threads = n; }, "codec threads (0: torch's setting)");
  m.attr("SEGMENT_HEADER_BYTES") = sizeof(SegHeader);
}

}  // namespace hvd_sparse

// Block codec core: which blocks of a flat tensor are non-zero, and the partition hash that
// the Zen scheme uses. Plain templates over the element's bit pattern, so the same per-block
// logic can be compiled for the host and (later) for CUDA.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace hvd_sparse {

// dtype codes shared with the Python side and the segment header.
enum DType : uint8_t { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3 };
constexpr int kNumDTypes = 4;
// Their names, indexed by code, as torch and numpy spell them: the one table Python and error
// messages read (hvd_sparse.protocol.DTYPES).
constexpr const char* kDTypeNames[kNumDTypes] = {"float32", "float64", "float16", "bfloat16"};

inline int dtype_size(uint8_t d) { return d == kF64 ? 8 : d == kF32 ? 4 : 2; }
inline const char* dtype_name(uint8_t d) { return d < kNumDTypes ? kDTypeNames[d] : "unknown"; }

// Unsigned word of an element's width and the mask that drops its sign bit: an element is zero
// iff (bits & mag) == 0, so +0 and -0 are zero while NaN, Inf and denormals are not.
template <int W>
struct Word;
template <>
struct Word<2> {
  using U = uint16_t;
  static constexpr U mag = 0x7fffu;
};
template <>
struct Word<4> {
  using U = uint32_t;
  static constexpr U mag = 0x7fffffffu;
};
template <>
struct Word<8> {
  using U = uint64_t;
  static constexpr U mag = 0x7fffffffffffffffull;
};

// OR of the bit patterns of n elements (widened to 64 bits). OR-reducing the whole block (no
// early exit) keeps the loop branch-free so the compiler vectorizes it; zero blocks must be read
// fully anyway.
template <int W>
inline uint64_t block_bits(const void* data, int64_t n) {
  using U = typename Word<W>::U;
  const U* p = static_cast<const U*>(data);
  U acc = 0;
  for (int64_t i = 0; i < n; ++i) acc |= p[i];
  return acc;
}

inline uint64_t block_bits(const void* data, int64_t n, int width) {
  switch (width) {
    case 2: return block_bits<2>(data, n);
    case 4: return block_bits<4>(data, n);
    default: return block_bits<8>(data, n);
  }
}

// The bits that make an element of this width non-zero: all but the sign.
inline uint64_t magnitude_bits(int width) {
  return width == 2 ? Word<2>::mag : width == 4 ? Word<4>::mag : Word<8>::mag;
}

// Data-independent partition of a block index among nparts ranks (Zen's balanced parallelism):
// Fibonacci hashing spreads clustered indices evenly; multiply-high maps to [0, nparts).
inline uint32_t partition_of(uint64_t block, uint32_t nparts) {
  uint64_t x = (block + 1) * 0x9E3779B97F4A7C15ull;
  x ^= x >> 29;
  return static_cast<uint32_t>(((x & 0xffffffffull) * nparts) >> 32);
}

inline int64_t num_blocks(int64_t numel, int64_t bs) { return (numel + bs - 1) / bs; }

// What sums of V are added in before one rounding to V: float64 for float64, else float32.
template <typename V>
using acc_t = std::conditional_t<std::is_same_v<V, double>, double, float>;

}  // namespace hvd_sparse

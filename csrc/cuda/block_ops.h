// Per-block logic of the CUDA packing kernels, written once for device and host. nvcc compiles
// it into the kernels (csrc/cuda/*.cu); the host build (csrc/cuda/host.cpp) compiles the same
// functions so the tests can check them against the CPU codec without a GPU.
#pragma once
#include <stdint.h>

#include "../omni/halfconv.h"

namespace hvd_sparse {
namespace cuda {

// Elements in block b (the tail block may be short).
__host__ __device__ inline int64_t block_len(int64_t numel, int64_t bs, int64_t b) {
  const int64_t rest = numel - b * bs;
  return rest < bs ? rest : bs;
}

// Bit pattern of an element without its sign: zero iff the element is +0 or -0, so NaN, Inf and
// denormals count as non-zero, exactly like the CPU codec (csrc/blocks.h).
__host__ __device__ inline uint32_t magnitude_bits(float v) {
  union {
    float f;
    uint32_t u;
  } c;
  c.f = v;
  return c.u & 0x7fffffffu;
}
__host__ __device__ inline uint64_t magnitude_bits(double v) {
  union {
    double f;
    uint64_t u;
  } c;
  c.f = v;
  return c.u & 0x7fffffffffffffffull;
}

// float16 and bfloat16 as their bits: the kernels test and copy them, and only the unpack's add
// widens them to float (correctly rounded: float carries more than twice their precision, so
// rounding twice is rounding once), as c10::Half's += does in the CPU codec.
struct F16 {
  uint16_t bits;
};
struct BF16 {
  uint16_t bits;
};
__host__ __device__ inline uint32_t magnitude_bits(F16 v) { return v.bits & 0x7fffu; }
__host__ __device__ inline uint32_t magnitude_bits(BF16 v) { return v.bits & 0x7fffu; }

template <typename T>
__host__ __device__ inline T add(T a, T b) {
  return a + b;
}
template <>
__host__ __device__ inline F16 add(F16 a, F16 b) {
  return {omni::float_to_f16(omni::f16_to_float(a.bits) + omni::f16_to_float(b.bits))};
}
template <>
__host__ __device__ inline BF16 add(BF16 a, BF16 b) {
  return {omni::float_to_bf16(omni::bf16_to_float(a.bits) + omni::bf16_to_float(b.bits))};
}

// Elements [lo, hi) of block b have a non-zero (one thread's share of a block when hi-lo < bs).
template <typename T>
__host__ __device__ inline bool range_nonzero(const T* x, int64_t lo, int64_t hi) {
  bool nz = false;
  for (int64_t i = lo; i < hi; ++i) nz |= magnitude_bits(x[i]) != 0;
  return nz;
}

template <typename T>
__host__ __device__ inline bool block_nonzero(const T* x, int64_t numel, int64_t bs, int64_t b) {
  return range_nonzero(x, b * bs, b * bs + block_len(numel, bs, b));
}

// Copies element j of block b to its packed slot at `slot` (the block's rank among non-zero
// blocks, from an exclusive prefix sum of the bitmap); pads the tail block with zeros.
template <typename T>
__host__ __device__ inline void pack_element(const T* x, int64_t numel, int64_t bs, int64_t b,
                                             int64_t slot, int64_t j, T* vals) {
  const int64_t i = b * bs + j;
  vals[slot * bs + j] = i < numel ? x[i] : T{};
}

// Adds element j of packed block k (block index b) into out. Block indices of one segment are
// distinct, so threads never add to the same element: no atomics.
template <typename T>
__host__ __device__ inline void unpack_add_element(T* out, int64_t numel, int64_t bs, int64_t b,
                                                   int64_t k, int64_t j, const T* vals) {
  const int64_t i = b * bs + j;
  if (i < numel) out[i] = add(out[i], vals[k * bs + j]);
}

// Threshold selection: |v| >= thr (NaN never passes: callers check finiteness separately).
template <typename T>
__host__ __device__ inline bool passes(T v, T thr) {
  return (v < T(0) ? -v : v) >= thr;
}

}  // namespace cuda
}  // namespace hvd_sparse

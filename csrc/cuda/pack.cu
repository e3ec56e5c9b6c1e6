// Block bitmap and compaction of non-zero blocks: one warp per block for the bitmap, a prefix
// sum for the output slots, one thread per packed element for the copy (float16 and bfloat16
// as their bits: nothing here computes with them). The per-block logic is
// block_ops.h, which the host build (host.cpp) tests against the CPU codec.
#include "block_ops.h"
#include "launch.h"
#include "scan.cuh"

namespace hvd_sparse {
namespace cuda {
namespace {

constexpr int kThreads = 256;

inline unsigned grid_for(int64_t items, int per_block) {
  int64_t g = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(g < 65535 * 32 ? (g > 0 ? g : 1) : 65535 * 32);
}

// Each warp ORs a block's magnitude bits: lanes stride over the block, then a warp vote.
template <typename T>
__global__ void bitmap_kernel(const T* x, int64_t numel, int64_t bs, int64_t nblocks,
                              int32_t* flags) {
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int lane = threadIdx.x % 32;
  for (int64_t b = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; b < nblocks; b += warps) {
    const int64_t lo = b * bs, hi = lo + block_len(numel, bs, b);
    bool nz = false;
    for (int64_t i = lo + lane; i < hi; i += 32) nz |= range_nonzero(x, i, i + 1);
    nz = __any_sync(0xffffffffu, nz);
    if (lane == 0) flags[b] = nz;
  }
}

// One thread per (block, element) of the padded tensor; only flagged blocks are written.
template <typename T>
__global__ void pack_kernel(const T* x, int64_t numel, int64_t bs, int64_t nblocks,
                            const int32_t* flags, const int64_t* offsets, int32_t* idx, T* vals) {
  const int64_t total = nblocks * bs, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += stride) {
    const int64_t b = t / bs, j = t % bs;
    if (!flags[b]) continue;
    if (j == 0) idx[offsets[b]] = static_cast<int32_t>(b);
    pack_element(x, numel, bs, b, offsets[b], j, vals);
  }
}

}  // namespace

size_t scan_temp_bytes(int64_t n) {
  size_t bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                static_cast<int64_t*>(nullptr), n > 0 ? n : 1);
  return bytes;
}

cudaError_t scan_flags(const int32_t* flags, int64_t n, int64_t* offsets, void* temp,
                       size_t temp_bytes, cudaStream_t s) {
  return exclusive_scan(flags, offsets, n, temp, temp_bytes, s);
}

template <typename T>
cudaError_t block_bitmap(const T* x, int64_t numel, int64_t bs, int32_t* flags, cudaStream_t s) {
  const int64_t nblocks = (numel + bs - 1) / bs;
  if (nblocks == 0) return cudaSuccess;
  bitmap_kernel<<<grid_for(nblocks, kThreads / 32), kThreads, 0, s>>>(x, numel, bs, nblocks, flags);
  return cudaGetLastError();
}

template <typename T>
cudaError_t pack_blocks(const T* x, int64_t numel, int64_t bs, const int32_t* flags,
                        const int64_t* offsets, int32_t* idx, T* vals, cudaStream_t s) {
  const int64_t nblocks = (numel + bs - 1) / bs;
  if (nblocks == 0) return cudaSuccess;
  pack_kernel<<<grid_for(nblocks * bs, kThreads), kThreads, 0, s>>>(x, numel, bs, nblocks, flags,
                                                                    offsets, idx, vals);
  return cudaGetLastError();
}

#define INSTANTIATE(T)                                                                            \
  template cudaError_t block_bitmap<T>(const T*, int64_t, int64_t, int32_t*, cudaStream_t);       \
  template cudaError_t pack_blocks<T>(const T*, int64_t, int64_t, const int32_t*, const int64_t*, \
                                      int32_t*, T*, cudaStream_t);
INSTANTIATE(float)
INSTANTIATE(double)
INSTANTIATE(F16)
INSTANTIATE(BF16)

}  // namespace cuda
}  // namespace hvd_sparse

// Host-side entry points of the CUDA packing kernels (csrc/cuda/*.cu). Plain pointers and a
// stream, no torch: csrc/cuda/binding.cpp wraps them for torch when a CUDA build exists.
// Every output count stays on the device (no per-block host copies); callers that need it on
// the host copy one integer. Element types: float, double, and float16/bfloat16 as F16/BF16
// (block_ops.h).
#pragma once
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

namespace hvd_sparse {
namespace cuda {

struct F16;
struct BF16;

// Scratch bytes the prefix sums below need for n items.
size_t scan_temp_bytes(int64_t n);

// flags[b] = 1 where block b of x (numel elements, blocks of bs) has a non-zero element.
template <typename T>
cudaError_t block_bitmap(const T* x, int64_t numel, int64_t bs, int32_t* flags, cudaStream_t s);

// offsets = exclusive prefix sum of the n flags, n + 1 entries: the last is the count.
cudaError_t scan_flags(const int32_t* flags, int64_t n, int64_t* offsets, void* temp,
                       size_t temp_bytes, cudaStream_t s);

// Packs the flagged blocks to their slots: idx[offsets[b]] = b and vals[offsets[b]] = block b
// zero-padded; idx and vals hold the count (offsets[nblocks]) entries.
template <typename T>
cudaError_t pack_blocks(const T* x, int64_t numel, int64_t bs, const int32_t* flags,
                        const int64_t* offsets, int32_t* idx, T* vals, cudaStream_t s);

// out[idx[k] * bs + j] += vals[k * bs + j] for the count packed blocks (distinct indices).
template <typename T>
cudaError_t unpack_add(T* out, int64_t numel, int64_t bs, const int32_t* idx, const T* vals,
                       int64_t count, cudaStream_t s);

// Ascending indices i with |x[i]| >= thr: flags, exclusive prefix sum into offsets (n + 1
// entries, the last is the count), scatter of i to out[offsets[i]] (out holds n entries).
template <typename T>
cudaError_t select_ge(const T* x, int64_t n, T thr, int32_t* flags, int64_t* offsets, int64_t* out,
                      void* temp, size_t temp_bytes, cudaStream_t s);

}  // namespace cuda
}  // namespace hvd_sparse

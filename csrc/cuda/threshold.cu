// Threshold selection: flag |x| >= thr, prefix sum of the flags, scatter of the indices to their
// slots: ascending indices with no host round trip.
#include "block_ops.h"
#include "launch.h"
#include "scan.cuh"

namespace hvd_sparse {
namespace cuda {
namespace {

inline unsigned grid_for(int64_t n) {
  const int64_t g = (n + 255) / 256;
  return static_cast<unsigned>(g < 65535 * 32 ? (g > 0 ? g : 1) : 65535 * 32);
}

template <typename T>
__global__ void flag_kernel(const T* x, int64_t n, T thr, int32_t* flags) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride)
    flags[i] = passes(x[i], thr);
}

__global__ void scatter_kernel(const int32_t* flags, const int64_t* offsets, int64_t n,
                               int64_t* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride)
    if (flags[i]) out[offsets[i]] = i;
}

}  // namespace

template <typename T>
cudaError_t select_ge(const T* x, int64_t n, T thr, int32_t* flags, int64_t* offsets, int64_t* out,
                      void* temp, size_t temp_bytes, cudaStream_t s) {
  if (n > 0) flag_kernel<<<grid_for(n), 256, 0, s>>>(x, n, thr, flags);
  cudaError_t e = exclusive_scan(flags, offsets, n, temp, temp_bytes, s);
  if (e != cudaSuccess || n == 0) return e;
  scatter_kernel<<<grid_for(n), 256, 0, s>>>(flags, offsets, n, out);
  return cudaGetLastError();
}

template cudaError_t select_ge<float>(const float*, int64_t, float, int32_t*, int64_t*, int64_t*,
                                      void*, size_t, cudaStream_t);
template cudaError_t select_ge<double>(const double*, int64_t, double, int32_t*, int64_t*, int64_t*,
                                       void*, size_t, cudaStream_t);

}  // namespace cuda
}  // namespace hvd_sparse

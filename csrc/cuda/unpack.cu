// Scatter-add of packed blocks into a dense tensor: one thread per packed element. Indices of
// one segment are distinct, so no two threads add to one element (no atomics); segments of
// several ranks are added one launch after another, in rank order, like the CPU decoder.
#include "block_ops.h"
#include "launch.h"

namespace hvd_sparse {
namespace cuda {
namespace {

template <typename T>
__global__ void unpack_kernel(T* out, int64_t numel, int64_t bs, const int32_t* idx, const T* vals,
                              int64_t count) {
  const int64_t total = count * bs, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < total;
       t += stride) {
    const int64_t k = t / bs;
    unpack_add_element(out, numel, bs, idx[k], k, t % bs, vals);
  }
}

}  // namespace

template <typename T>
cudaError_t unpack_add(T* out, int64_t numel, int64_t bs, const int32_t* idx, const T* vals,
                       int64_t count, cudaStream_t s) {
  if (count == 0) return cudaSuccess;
  const int64_t blocks = (count * bs + 255) / 256;
  unpack_kernel<<<static_cast<unsigned>(blocks < 65535 * 32 ? blocks : 65535 * 32), 256, 0, s>>>(
      out, numel, bs, idx, vals, count);
  return cudaGetLastError();
}

#define INSTANTIATE(T)                                                                        \
  template cudaError_t unpack_add<T>(T*, int64_t, int64_t, const int32_t*, const T*, int64_t, \
                                     cudaStream_t);
INSTANTIATE(float)
INSTANTIATE(double)
INSTANTIATE(F16)
INSTANTIATE(BF16)

}  // namespace cuda
}  // namespace hvd_sparse

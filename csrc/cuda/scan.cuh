// Exclusive prefix sum of int32 flags into int64 offsets with the total in offsets[n] (CUB).
#pragma once
#include <cub/device/device_scan.cuh>

#include "launch.h"

namespace hvd_sparse {
namespace cuda {

// flags has n entries; offsets n + 1. Scanning n + 1 items of a zero-extended view would need
// a copy, so the total is written by one extra thread instead.
static __global__ void write_total(const int32_t* flags, int64_t* offsets, int64_t n) {
  offsets[n] = n ? offsets[n - 1] + flags[n - 1] : 0;
}

inline cudaError_t exclusive_scan(const int32_t* flags, int64_t* offsets, int64_t n, void* temp,
                                  size_t temp_bytes, cudaStream_t s) {
  if (n > 0) {
    cudaError_t e = cub::DeviceScan::ExclusiveSum(temp, temp_bytes, flags, offsets, n, s);
    if (e != cudaSuccess) return e;
  }
  write_total<<<1, 1, 0, s>>>(flags, offsets, n);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace hvd_sparse

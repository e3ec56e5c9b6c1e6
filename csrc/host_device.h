// __host__ __device__ marks the functions that both the CUDA kernels and host builds compile
// (csrc/cuda/block_ops.h, csrc/omni/halfconv.h); without nvcc the marks are empty.
#pragma once
#ifndef __CUDACC__
#ifndef __host__
#define __host__
#endif
#ifndef __device__
#define __device__
#endif
#endif

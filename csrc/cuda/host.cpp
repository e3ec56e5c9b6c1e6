// Host builds of the CUDA kernels' algorithms (pack.cu, unpack.cu, threshold.cu in this
// directory): the same __host__ __device__ per-block functions (block_ops.h), driven by
// sequential loops in the order the GPU grid would run them (bitmap, exclusive prefix sum, pack
// by slot). Compiled into hvd_sparse._C (setup.py), not by nvcc.
// No GPU is lent to this project; the tests compare these against the CPU codec instead.
#include <torch/extension.h>

#include <type_traits>
#include <vector>

#include "block_ops.h"

namespace hvd_sparse {
namespace {

namespace cu = hvd_sparse::cuda;

// Calls f with a pointer to t's data as the kernels' element type (float16/bfloat16 as their
// bits, block_ops.h's F16/BF16, exactly as binding.cpp hands them to the kernels).
template <typename F>
void dispatch(const at::Tensor& t, F&& f) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "cuda_host: contiguous CPU tensor");
  switch (t.scalar_type()) {
    case at::kFloat: return f(static_cast<float*>(t.data_ptr()));
    case at::kDouble: return f(static_cast<double*>(t.data_ptr()));
    case at::kHalf: return f(static_cast<cu::F16*>(t.data_ptr()));
    case at::kBFloat16: return f(static_cast<cu::BF16*>(t.data_ptr()));
    default: TORCH_CHECK(false, "cuda_host: float32, float64, float16 or bfloat16");
  }
}

// Kernel 1 (bitmap): one flag per block.
at::Tensor host_block_mask(const at::Tensor& x, int64_t bs) {
  TORCH_CHECK(bs > 0, "block_size must be > 0");
  const int64_t n = x.numel(), nb = (n + bs - 1) / bs;
  auto mask = at::empty({nb}, at::kByte);
  uint8_t* m = mask.data_ptr<uint8_t>();
  dispatch(x, [&](auto* p) {
    for (int64_t b = 0; b < nb; ++b) m[b] = cu::block_nonzero(p, n, bs, b);
  });
  return mask;
}

// Kernel 2 (exclusive scan of the bitmap) + kernel 3 (pack: block b to slot offset[b]).
std::tuple<at::Tensor, at::Tensor> host_pack(const at::Tensor& x, int64_t bs) {
  auto mask = host_block_mask(x, bs);
  const int64_t n = x.numel(), nb = mask.numel();
  const uint8_t* m = mask.data_ptr<uint8_t>();
  std::vector<int64_t> offset(static_cast<size_t>(nb) + 1, 0);
  for (int64_t b = 0; b < nb; ++b) offset[b + 1] = offset[b] + m[b];
  const int64_t count = offset[nb];
  auto idx = at::empty({count}, at::kInt);
  auto vals = at::empty({count, bs}, x.options());
  int32_t* ix = idx.data_ptr<int32_t>();
  dispatch(x, [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    T* v = static_cast<T*>(vals.data_ptr());
    for (int64_t b = 0; b < nb; ++b) {
      if (!m[b]) continue;
      ix[offset[b]] = static_cast<int32_t>(b);
      for (int64_t j = 0; j < bs; ++j) cu::pack_element(p, n, bs, b, offset[b], j, v);
    }
  });
  return {idx, vals};
}

// Kernel 4 (unpack): adds packed blocks into out.
void host_unpack(at::Tensor& out, const at::Tensor& idx, const at::Tensor& vals, int64_t bs) {
  TORCH_CHECK(idx.scalar_type() == at::kInt && vals.scalar_type() == out.scalar_type() &&
                  vals.numel() == idx.numel() * bs && vals.is_contiguous() && idx.is_contiguous(),
              "cuda_host unpack: int32 idx, vals [len(idx), block_size] of out's dtype");
  const int64_t n = out.numel(), nb = (n + bs - 1) / bs;
  const int32_t* ix = idx.data_ptr<int32_t>();
  for (int64_t k = 0; k < idx.numel(); ++k)
    TORCH_CHECK(ix[k] >= 0 && ix[k] < nb && (k == 0 || ix[k] > ix[k - 1]),
                "cuda_host unpack: block indices must be ascending and in range");
  dispatch(out, [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    const T* v = static_cast<T*>(vals.data_ptr());
    for (int64_t k = 0; k < idx.numel(); ++k)
      for (int64_t j = 0; j < bs; ++j) cu::unpack_add_element(o, n, bs, ix[k], k, j, v);
  });
}

// Kernels 5-6 (threshold selection): flag |x| >= thr, exclusive scan, scatter indices to slots.
at::Tensor host_select_ge(const at::Tensor& x, double thr) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
              "cuda_host select_ge: float32 or float64");
  const int64_t n = x.numel();
  std::vector<int64_t> offset(static_cast<size_t>(n) + 1, 0);
  at::Tensor out;
  dispatch(x, [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    if constexpr (std::is_floating_point_v<T>) {
      for (int64_t i = 0; i < n; ++i)
        offset[i + 1] = offset[i] + cu::passes(p[i], static_cast<T>(thr));
      out = at::empty({offset[n]}, at::kLong);
      int64_t* o = out.data_ptr<int64_t>();
      for (int64_t i = 0; i < n; ++i)
        if (offset[i + 1] != offset[i]) o[offset[i]] = i;
    }
  });
  return out;
}

}  // namespace
}  // namespace hvd_sparse

void register_cuda_host(pybind11::module_& m) {
  using namespace hvd_sparse;
  m.def("cuda_host_block_mask", &host_block_mask, py::arg("x"), py::arg("block_size"));
  m.def("cuda_host_pack", &host_pack, py::arg("x"), py::arg("block_size"));
  m.def("cuda_host_unpack", &host_unpack, py::arg("out"), py::arg("idx"), py::arg("vals"),
        py::arg("block_size"));
  m.def("cuda_host_select_ge", &host_select_ge, py::arg("x"), py::arg("thr"));
}

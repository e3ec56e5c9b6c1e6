// hvd_sparse._cuda: torch bindings of the CUDA packing kernels. setup.py builds it where torch
// has CUDA and nvcc exists; `make cuda-check` compiles it (and links the kernels) everywhere else.
// Every kernel runs on the current stream: callers pick the stream (staging.py packs on a side
// stream), and nothing here synchronizes the device.
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "block_ops.h"
#include "launch.h"

namespace hc = hvd_sparse::cuda;

namespace {

// Calls f with a value of the kernels' element type for t's dtype.
template <typename F>
void dispatch(const at::Tensor& t, F&& f) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous(), "hvd_sparse._cuda: contiguous CUDA tensor");
  switch (t.scalar_type()) {
    case at::kFloat: return f(float{});
    case at::kDouble: return f(double{});
    case at::kHalf: return f(hc::F16{});
    case at::kBFloat16: return f(hc::BF16{});
    default:
      TORCH_CHECK(false, "hvd_sparse._cuda: float32, float64, float16 or bfloat16, got ",
                  t.scalar_type());
  }
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

void ok(cudaError_t e) {
  TORCH_CHECK(e == cudaSuccess, "hvd_sparse._cuda: ", cudaGetErrorString(e));
}

at::Tensor scratch(int64_t n, const at::Tensor& like) {
  return at::empty({static_cast<int64_t>(hc::scan_temp_bytes(n))}, like.options().dtype(at::kByte));
}

// First half of pack: (int32 block flags, int64 offsets: their exclusive prefix sum, nblocks + 1
// entries, the last being the count). Nothing is read back: the caller copies the count when
// it wants it (staging.py, asynchronously).
std::tuple<at::Tensor, at::Tensor> mask_scan(const at::Tensor& x, int64_t bs) {
  TORCH_CHECK(bs > 0, "block_size must be > 0");
  const int64_t n = x.numel(), nb = (n + bs - 1) / bs;
  cudaStream_t s = c10::cuda::getCurrentCUDAStream();
  auto flags = at::empty({nb}, x.options().dtype(at::kInt));
  auto offsets = at::empty({nb + 1}, x.options().dtype(at::kLong));
  auto temp = scratch(nb, x);
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    ok(hc::block_bitmap(ptr<T>(x), n, bs, ptr<int32_t>(flags), s));
  });
  ok(hc::scan_flags(ptr<int32_t>(flags), nb, ptr<int64_t>(offsets), temp.data_ptr(), temp.numel(),
                    s));
  return {flags, offsets};
}

// Second half: (int32 block indices [count], values [count, bs]) of the flagged blocks.
std::tuple<at::Tensor, at::Tensor> pack_counted(const at::Tensor& x, int64_t bs,
                                                const at::Tensor& flags, const at::Tensor& offsets,
                                                int64_t count) {
  const int64_t nb = (x.numel() + bs - 1) / bs;
  TORCH_CHECK(flags.numel() == nb && offsets.numel() == nb + 1 && count >= 0 && count <= nb,
              "pack_counted: flags and offsets of mask_scan(x, block_size)");
  auto idx = at::empty({count}, x.options().dtype(at::kInt));
  auto vals = at::empty({count, bs}, x.options());
  if (count == 0) return {idx, vals};
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    ok(hc::pack_blocks(ptr<T>(x), x.numel(), bs, ptr<int32_t>(flags), ptr<int64_t>(offsets),
                       ptr<int32_t>(idx), ptr<T>(vals), c10::cuda::getCurrentCUDAStream()));
  });
  return {idx, vals};
}

// Both halves; reads the count back (one integer, this stream only).
std::tuple<at::Tensor, at::Tensor> pack(const at::Tensor& x, int64_t bs) {
  auto [flags, offsets] = mask_scan(x, bs);
  return pack_counted(x, bs, flags, offsets, offsets[flags.numel()].item<int64_t>());
}

void unpack(at::Tensor& out, const at::Tensor& idx, const at::Tensor& vals, int64_t bs) {
  TORCH_CHECK(idx.is_cuda() && idx.scalar_type() == at::kInt && idx.is_contiguous() &&
                  vals.is_contiguous() && vals.scalar_type() == out.scalar_type() &&
                  vals.numel() == idx.numel() * bs,
              "unpack: int32 idx, vals [len(idx), block_size] of out's dtype");
  dispatch(out, [&](auto tag) {
    using T = decltype(tag);
    ok(hc::unpack_add(ptr<T>(out), out.numel(), bs, ptr<int32_t>(idx), ptr<T>(vals), idx.numel(),
                      c10::cuda::getCurrentCUDAStream()));
  });
}

at::Tensor select_ge(const at::Tensor& x, double thr) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
              "select_ge: float32 or float64");
  const int64_t n = x.numel();
  auto flags = at::empty({n}, x.options().dtype(at::kInt));
  auto offsets = at::empty({n + 1}, x.options().dtype(at::kLong));
  auto out = at::empty({n}, x.options().dtype(at::kLong));
  auto temp = scratch(n, x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "select_ge", [&] {
    ok(hc::select_ge(x.data_ptr<scalar_t>(), n, static_cast<scalar_t>(thr),
                     flags.data_ptr<int32_t>(), offsets.data_ptr<int64_t>(),
                     out.data_ptr<int64_t>(), temp.data_ptr(), temp.numel(),
                     c10::cuda::getCurrentCUDAStream()));
  });
  return out.narrow(0, 0, offsets[n].item<int64_t>());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hvd-sparse CUDA packing kernels";
  m.def("mask_scan", &mask_scan, py::arg("x"), py::arg("block_size"));
  m.def("pack_counted", &pack_counted, py::arg("x"), py::arg("block_size"), py::arg("flags"),
        py::arg("offsets"), py::arg("count"));
  m.def("pack", &pack, py::arg("x"), py::arg("block_size"));
  m.def("unpack", &unpack, py::arg("out"), py::arg("idx"), py::arg("vals"), py::arg("block_size"));
  m.def("select_ge", &select_ge, py::arg("x"), py::arg("thr"));
}

// hvd_sparse._cuda: torch bindings of the CUDA packing kernels. Built by setup.py only when the
// installed torch has CUDA and nvcc exists; this project has no GPU, so this file is compiled
// only on such machines, while the kernels' per-block logic is tested on the host.
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

#include "launch.h"

namespace hc = hvd_sparse::cuda;

namespace {

void check(const at::Tensor& t) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous(), "hvd_sparse._cuda: contiguous CUDA tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, "float32/float64");
}

void ok(cudaError_t e) { TORCH_CHECK(e == cudaSuccess, "hvd_sparse._cuda: ", cudaGetErrorString(e)); }

at::Tensor scratch(int64_t n, const at::Tensor& like) {
  return at::empty({static_cast<int64_t>(hc::scan_temp_bytes(n))}, like.options().dtype(at::kByte));
}

// (int32 block indices, values [count, bs]) of the non-zero blocks; one integer read back.
std::tuple<at::Tensor, at::Tensor> pack(const at::Tensor& x, int64_t bs) {
  check(x);
  const int64_t n = x.numel(), nb = (n + bs - 1) / bs;
  auto s = at::cuda::getCurrentCUDAStream();
  auto flags = at::empty({nb}, x.options().dtype(at::kInt));
  auto offsets = at::empty({nb + 1}, x.options().dtype(at::kLong));
  auto idx = at::empty({nb}, x.options().dtype(at::kInt));
  auto vals = at::empty({nb, bs}, x.options());
  auto temp = scratch(nb, x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "pack", [&] {
    ok(hc::block_bitmap(x.data_ptr<scalar_t>(), n, bs, flags.data_ptr<int32_t>(), s));
    ok(hc::pack_blocks(x.data_ptr<scalar_t>(), n, bs, flags.data_ptr<int32_t>(),
                       offsets.data_ptr<int64_t>(), idx.data_ptr<int32_t>(),
                       vals.data_ptr<scalar_t>(), temp.data_ptr(), temp.numel(), s));
  });
  const int64_t count = offsets[nb].item<int64_t>();
  return {idx.narrow(0, 0, count), vals.narrow(0, 0, count)};
}

void unpack(at::Tensor& out, const at::Tensor& idx, const at::Tensor& vals, int64_t bs) {
  check(out);
  TORCH_CHECK(idx.is_cuda() && idx.scalar_type() == at::kInt && vals.numel() == idx.numel() * bs,
              "unpack: int32 idx, vals [len(idx), block_size]");
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "unpack", [&] {
    ok(hc::unpack_add(out.data_ptr<scalar_t>(), out.numel(), bs, idx.data_ptr<int32_t>(),
                      vals.data_ptr<scalar_t>(), idx.numel(), at::cuda::getCurrentCUDAStream()));
  });
}

at::Tensor select_ge(const at::Tensor& x, double thr) {
  check(x);
  const int64_t n = x.numel();
  auto flags = at::empty({n}, x.options().dtype(at::kInt));
  auto offsets = at::empty({n + 1}, x.options().dtype(at::kLong));
  auto out = at::empty({n}, x.options().dtype(at::kLong));
  auto temp = scratch(n, x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "select_ge", [&] {
    ok(hc::select_ge(x.data_ptr<scalar_t>(), n, static_cast<scalar_t>(thr),
                     flags.data_ptr<int32_t>(), offsets.data_ptr<int64_t>(),
                     out.data_ptr<int64_t>(), temp.data_ptr(), temp.numel(),
                     at::cuda::getCurrentCUDAStream()));
  });
  return out.narrow(0, 0, offsets[n].item<int64_t>());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hvd-sparse CUDA packing kernels";
  m.def("pack", &pack, py::arg("x"), py::arg("block_size"));
  m.def("unpack", &unpack, py::arg("out"), py::arg("idx"), py::arg("vals"), py::arg("block_size"));
  m.def("select_ge", &select_ge, py::arg("x"), py::arg("thr"));
}

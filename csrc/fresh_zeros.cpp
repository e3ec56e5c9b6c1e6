// Zero tensors whose pages cost nothing until written (hvd_sparse._C.fresh_zeros).
//
// An out-of-place sparse reduction returns a dense tensor that is zero outside the blocks some
// rank sent. torch.zeros faults in and memsets every page of it: for 100 MiB that took longer
// than the whole sparse exchange. A fresh anonymous mapping is already zero, so the decoders
// write only the blocks they carry and pages no block lands in are never faulted in (they read
// back as zero). Huge pages (MADV_HUGEPAGE, honoured when THP is "madvise" or "always") make
// the pages that are touched 512 times fewer faults; without them the mapping still works with
// 4 KiB pages.
#include <torch/extension.h>

#include <sys/mman.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

namespace hvd_sparse {
namespace {

constexpr size_t kHugePage = size_t(2) << 20;
// Below this the caching allocator's warm memory plus a memset costs less than mapping pages.
constexpr size_t kMinBytes = size_t(4) << 20;

}  // namespace

at::Tensor fresh_zeros(int64_t numel, at::ScalarType dtype) {
  TORCH_CHECK(numel >= 0, "fresh_zeros: negative size");
  const size_t bytes = size_t(numel) * c10::elementSize(dtype);
  if (bytes < kMinBytes) return at::zeros({numel}, at::TensorOptions().dtype(dtype));
  const size_t len = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  // Map one huge page more and trim both ends: the kernel backs only 2 MiB-aligned ranges with
  // huge pages.
  void* raw = mmap(nullptr, len + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
  TORCH_CHECK(raw != MAP_FAILED, "fresh_zeros: mmap of ", len, " bytes: ", std::strerror(errno));
  const uintptr_t base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t start = (base + kHugePage - 1) & ~(kHugePage - 1);
  if (start > base) munmap(raw, start - base);
  munmap(reinterpret_cast<void*>(start + len), base + kHugePage - start);
  void* p = reinterpret_cast<void*>(start);
  (void)madvise(p, len, MADV_HUGEPAGE);  // advice only: EINVAL without THP changes nothing
  return at::from_blob(p, {numel}, [len](void* q) { munmap(q, len); },
                       at::TensorOptions().dtype(dtype));
}

void register_fresh_zeros(pybind11::module_& m) {
  m.def("fresh_zeros", &fresh_zeros,
        "zero tensor; large ones are fresh mappings that fault in only the pages written",
        py::arg("numel"), py::arg("dtype"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace hvd_sparse

// Zero tensors for large results: fresh mappings whose pages cost nothing until written, or
// freed ones reused (hvd_sparse._C.fresh_zeros).
//
// An out-of-place sparse reduction returns a dense tensor that is zero outside the blocks some
// rank sent. torch.zeros faults in and memsets every page of it: for 100 MiB that took longer
// than the whole sparse exchange. A fresh anonymous mapping is already zero, so the decoders
// write only the blocks they carry; pages no block lands in are never faulted in and read back
// as zero. With huge pages (MADV_HUGEPAGE: THP "madvise" or "always") a 1%-dense result still
// touches every 2 MiB page, but as 50 faults the kernel zeroes in bulk instead of 25,600 faults
// plus a memset; 4 KiB pages would touch fewer bytes at 1% but cost more at 10%, and leave the
// reader of the result a zero-page fault per 4 KiB (scripts/bench/profile_output.py). Without THP the
// mapping simply uses 4 KiB pages.
//
// The same cache serves large byte buffers that their writer fills whole (the codec's segments,
// reused_empty): glibc hands such buffers back to the kernel when they are freed, so each call
// faulted its output in anew, and on this project's VMs the ~2,500 faults of a 10 MiB segment
// took 4-5 ms where writing it takes under 1 (scripts/bench/bench_hostwork.py).
//
// Freed mappings are kept (up to kCacheBytes) and reused by the next request of the same size
// after a memset: a page the process keeps costs a write, while a page given back costs a fault
// and a kernel zeroing, and under free page reporting (this project's VMs) the host takes it
// back and faults it in again, 10-50x slower. A mapping returns to the cache only when its last
// tensor is freed, so no live tensor ever shares memory with a new one.
#include <torch/extension.h>

#include <sys/mman.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

namespace hvd_sparse {
namespace {

constexpr size_t kHugePage = size_t(2) << 20;
// Below this, torch.zeros mostly reuses warm heap memory (glibc), and its memset is cheap.
constexpr size_t kMinBytes = size_t(4) << 20;
constexpr size_t kCacheBytes = size_t(1) << 30;

struct Cache {
  std::mutex mu;
  std::vector<std::pair<void*, size_t>> maps;  // freed mappings (address, length), oldest first
  size_t bytes = 0;
};

Cache& cache() {
  static Cache* c = new Cache;  // never destroyed: tensors may be freed during process exit
  return *c;
}

void* take_cached(size_t len) {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  for (size_t i = c.maps.size(); i-- > 0;) {
    if (c.maps[i].second != len) continue;
    void* p = c.maps[i].first;
    c.maps.erase(c.maps.begin() + i);
    c.bytes -= len;
    return p;
  }
  return nullptr;
}

// The smallest cached mapping of at least len bytes and at most twice that (a much larger one
// would hold memory the caller does not use); its length in *got.
void* take_fitting(size_t len, size_t* got) {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  size_t best = c.maps.size();
  for (size_t i = 0; i < c.maps.size(); ++i) {
    const size_t n = c.maps[i].second;
    if (n >= len && n <= 2 * len && (best == c.maps.size() || n < c.maps[best].second)) best = i;
  }
  if (best == c.maps.size()) return nullptr;
  void* p = c.maps[best].first;
  *got = c.maps[best].second;
  c.bytes -= *got;
  c.maps.erase(c.maps.begin() + best);
  return p;
}

void give_back(void* p, size_t len) {
  Cache& c = cache();
  std::vector<std::pair<void*, size_t>> evicted;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    c.maps.emplace_back(p, len);
    c.bytes += len;
    while (c.bytes > kCacheBytes) {
      evicted.push_back(c.maps.front());
      c.bytes -= c.maps.front().second;
      c.maps.erase(c.maps.begin());
    }
  }
  for (auto& [q, n] : evicted) munmap(q, n);
}

void* map_fresh(size_t len) {
  // Map one huge page more and trim both ends: the kernel backs only 2 MiB-aligned ranges with
  // huge pages.
  void* raw =
      mmap(nullptr, len + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(raw != MAP_FAILED, "fresh_zeros: mmap of ", len, " bytes: ", std::strerror(errno));
  const uintptr_t base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t start = (base + kHugePage - 1) & ~(kHugePage - 1);
  if (start > base) munmap(raw, start - base);
  munmap(reinterpret_cast<void*>(start + len), base + kHugePage - start);
  void* p = reinterpret_cast<void*>(start);
  (void)madvise(p, len, MADV_HUGEPAGE);  // advice only: EINVAL without THP changes nothing
  return p;
}

}  // namespace

at::Tensor fresh_zeros(int64_t numel, at::ScalarType dtype) {
  TORCH_CHECK(numel >= 0, "fresh_zeros: negative size");
  const size_t bytes = size_t(numel) * c10::elementSize(dtype);
  if (bytes < kMinBytes) return at::zeros({numel}, at::TensorOptions().dtype(dtype));
  const size_t len = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* p = take_cached(len);
  if (p != nullptr) std::memset(p, 0, bytes);
  else p = map_fresh(len);
  return at::from_blob(
      p, {numel}, [len](void* q) { give_back(q, len); }, at::TensorOptions().dtype(dtype));
}

at::Tensor reused_empty(int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0, "reused_empty: negative size");
  const size_t bytes = static_cast<size_t>(nbytes);
  if (bytes < kMinBytes) return at::empty({nbytes}, at::kByte);
  size_t len = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* p = take_fitting(len, &len);
  if (p == nullptr) p = map_fresh(len);
  return at::from_blob(
      p, {nbytes}, [len](void* q) { give_back(q, len); }, at::TensorOptions().dtype(at::kByte));
}

void register_fresh_zeros(pybind11::module_& m) {
  m.def("fresh_zeros", &fresh_zeros,
        "zero tensor; large ones are fresh mappings that fault in only the pages written",
        py::arg("numel"), py::arg("dtype"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace hvd_sparse

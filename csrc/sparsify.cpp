// Sparsifier kernels (hvd_sparse._C): magnitude sampling, threshold counting and selection, exact
// top-k without a full sort, per-block scores for ExDyna, per-partition counts, and the in-place
// moves between a gradient and its error-feedback memory. Every per-element loop of the
// sparsifiers lives here; Python only decides what to select.
//
// Selections are ascending int64 indices of "units": elements, or blocks of `bs` elements.
// float32 and float64 only (the Python side widens half types).
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "parallel.h"

namespace hvd_sparse {
namespace {

constexpr int64_t kGrain = 1 << 16;  // elements per chunk below which threads do not pay

void check_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what,
              ": tensor must be contiguous on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, what,
              ": tensor must be float32 or float64, got ", t.scalar_type());
}

template <typename F>
void dispatch(const at::Tensor& t, const char* what, F&& f) {
  check_float(t, what);
  if (t.scalar_type() == at::kFloat) f(t.data_ptr<float>());
  else f(t.data_ptr<double>());
}

// splitmix64: a cheap, seedable generator, so samples are reproducible across runs and ranks.
inline uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Concatenates per-chunk index lists in chunk order: ascending, as each chunk was.
at::Tensor concat(const std::vector<std::vector<int64_t>>& parts) {
  int64_t total = 0;
  for (const auto& p : parts) total += static_cast<int64_t>(p.size());
  auto out = at::empty({total}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (const auto& p : parts) o = std::copy(p.begin(), p.end(), o);
  return out;
}

// |x| of m elements at pseudo-random positions of x[0, n).
template <typename T>
std::vector<float> sample(const T* x, int64_t n, int64_t m, uint64_t seed) {
  std::vector<float> s(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i)
    s[i] = static_cast<float>(std::abs(x[mix(seed + i) % static_cast<uint64_t>(n)]));
  return s;
}

// Indices and magnitudes of the elements with |x| >= thr, ascending.
template <typename T>
void candidates(const T* x, int64_t n, T thr, std::vector<int64_t>& idx, std::vector<T>& mag) {
  const int64_t chunks = chunk_count(n, kGrain);
  std::vector<std::vector<int64_t>> pi(chunks);
  std::vector<std::vector<T>> pm(chunks);
  for_chunks(n, chunks, [&](int64_t c, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T a = std::abs(x[i]);
      if (a >= thr) {
        pi[c].push_back(i);
        pm[c].push_back(a);
      }
    }
  });
  for (int64_t c = 0; c < chunks; ++c) {
    idx.insert(idx.end(), pi[c].begin(), pi[c].end());
    mag.insert(mag.end(), pm[c].begin(), pm[c].end());
  }
}

}  // namespace

// (count of |x| >= thr, count of non-finite elements).
std::tuple<int64_t, int64_t> count_abs_ge(const at::Tensor& x, double thr) {
  int64_t count = 0, bad = 0;
  dispatch(x, "count_abs_ge", [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    const int64_t n = x.numel(), chunks = chunk_count(n, kGrain);
    std::vector<int64_t> cs(chunks, 0), bs(chunks, 0);
    for_chunks(n, chunks, [&](int64_t c, int64_t b, int64_t e) {
      int64_t k = 0, f = 0;
      for (int64_t i = b; i < e; ++i) {
        k += std::abs(p[i]) >= static_cast<T>(thr);
        f += !std::isfinite(p[i]);
      }
      cs[c] = k;
      bs[c] = f;
    });
    for (int64_t c = 0; c < chunks; ++c) count += cs[c], bad += bs[c];
  });
  return {count, bad};
}

// Ascending indices i with |x[i]| >= thr: per-thread lists in chunk order, then one concat.
at::Tensor select_abs_ge(const at::Tensor& x, double thr) {
  at::Tensor out;
  dispatch(x, "select_abs_ge", [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    const int64_t n = x.numel(), chunks = chunk_count(n, kGrain);
    std::vector<std::vector<int64_t>> parts(chunks);
    for_chunks(n, chunks, [&](int64_t c, int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        if (std::abs(p[i]) >= static_cast<T>(thr)) parts[c].push_back(i);
    });
    out = concat(parts);
  });
  return out;
}

// |x| at m pseudo-random positions (with replacement), as float32.
at::Tensor sample_abs(const at::Tensor& x, int64_t m, int64_t seed) {
  TORCH_CHECK(x.numel() > 0 && m > 0, "sample_abs: empty tensor or sample");
  at::Tensor out = at::empty({m}, at::kFloat);
  dispatch(x, "sample_abs", [&](auto* p) {
    auto s = sample(p, x.numel(), m, static_cast<uint64_t>(seed));
    std::copy(s.begin(), s.end(), out.data_ptr<float>());
  });
  return out;
}

// Exact top-k by magnitude, as ascending indices, in expected O(n): a sample sets a threshold
// that lets through somewhat more than k elements, one pass collects them, nth_element on that
// small set finds the k-th magnitude. Ties at the k-th magnitude are taken in index order.
// NaN is never selected (callers check finiteness first).
at::Tensor topk_abs(const at::Tensor& x, int64_t k, int64_t seed) {
  const int64_t n = x.numel();
  TORCH_CHECK(k >= 0, "topk_abs: k must be >= 0");
  if (k >= n) return at::arange(n, at::kLong);
  if (k == 0) return at::empty({0}, at::kLong);
  at::Tensor out;
  dispatch(x, "topk_abs", [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    const int64_t m = std::min<int64_t>(n, 1 << 16);
    auto s = sample(p, n, m, static_cast<uint64_t>(seed));
    // Aim for 1.25 k candidates plus 4 sigma of sampling noise: rarely short, rarely many.
    const double q = static_cast<double>(k) / n;
    const double want = m * q * 1.25 + 4.0 * std::sqrt(m * q) + 8.0;
    T thr = 0;
    if (want < m) {
      const int64_t r = static_cast<int64_t>(want);
      std::nth_element(s.begin(), s.begin() + r, s.end(), std::greater<float>());
      thr = static_cast<T>(s[r]);
    }
    std::vector<int64_t> idx;
    std::vector<T> mag;
    candidates(p, n, thr, idx, mag);
    if (static_cast<int64_t>(idx.size()) < k && thr > 0) {  // unlucky sample: take everything
      idx.clear();
      mag.clear();
      candidates(p, n, T(0), idx, mag);
    }
    const int64_t c = static_cast<int64_t>(idx.size());
    if (c <= k) {
      out = at::empty({c}, at::kLong);
      std::copy(idx.begin(), idx.end(), out.data_ptr<int64_t>());
      return;
    }
    std::vector<T> tmp(mag);
    std::nth_element(tmp.begin(), tmp.begin() + (k - 1), tmp.end(), std::greater<T>());
    const T kth = tmp[k - 1];
    int64_t above = 0;
    for (T v : mag) above += v > kth;
    int64_t ties = k - above;
    out = at::empty({k}, at::kLong);
    int64_t* o = out.data_ptr<int64_t>();
    for (int64_t i = 0; i < c; ++i)
      if (mag[i] > kth || (mag[i] == kth && ties-- > 0)) *o++ = idx[i];
  });
  return out;
}

// ExDyna's block scores: mean |x| over each block, summed in float64 (as the sampled scores are,
// and the device version in sparsifiers/ops.py). Returns (ascending block indices in [b0, b1)
// whose score >= thr, the largest finite score seen, the number of blocks whose score is not
// finite).
std::tuple<at::Tensor, double, int64_t> select_blocks(const at::Tensor& x, int64_t bs, int64_t b0,
                                                      int64_t b1, double thr) {
  const int64_t n = x.numel();
  TORCH_CHECK(bs > 0 && b0 >= 0 && b0 <= b1 && (b1 - 1) * bs < std::max<int64_t>(n, 1) + bs,
              "select_blocks: block range out of bounds");
  at::Tensor out;
  double best = 0;
  int64_t bad = 0;
  dispatch(x, "select_blocks", [&](auto* p) {
    const int64_t nb = b1 - b0, chunks = chunk_count(nb * bs, kGrain);
    std::vector<std::vector<int64_t>> parts(chunks);
    std::vector<double> bests(chunks, 0);
    std::vector<int64_t> bads(chunks, 0);
    for_chunks(nb, chunks, [&](int64_t c, int64_t lo, int64_t hi) {
      double top = 0;
      for (int64_t b = b0 + lo; b < b0 + hi; ++b) {
        const int64_t s = b * bs, e = std::min(n, s + bs);
        double sum = 0;
        for (int64_t i = s; i < e; ++i) sum += std::abs(static_cast<double>(p[i]));
        const double score = sum / static_cast<double>(e - s);
        if (!std::isfinite(score)) {
          ++bads[c];
          continue;
        }
        top = std::max(top, score);
        if (score >= thr) parts[c].push_back(b);
      }
      bests[c] = top;
    });
    out = concat(parts);
    for (int64_t c = 0; c < chunks; ++c) best = std::max(best, bests[c]), bad += bads[c];
  });
  return {out, best, bad};
}

// Mean |x| of m pseudo-random blocks in [b0, b1), as float32.
at::Tensor sample_block_scores(const at::Tensor& x, int64_t bs, int64_t b0, int64_t b1, int64_t m,
                               int64_t seed) {
  TORCH_CHECK(bs > 0 && b0 < b1 && m > 0, "sample_block_scores: empty range or sample");
  at::Tensor out = at::empty({m}, at::kFloat);
  float* o = out.data_ptr<float>();
  dispatch(x, "sample_block_scores", [&](auto* p) {
    const int64_t n = x.numel();
    for (int64_t k = 0; k < m; ++k) {
      const int64_t b = b0 + static_cast<int64_t>(mix(seed + k) % static_cast<uint64_t>(b1 - b0));
      const int64_t s = b * bs, e = std::min(n, s + bs);
      double sum = 0;
      for (int64_t i = s; i < e; ++i) sum += std::abs(static_cast<double>(p[i]));
      o[k] = static_cast<float>(sum / static_cast<double>(e - s));
    }
  });
  return out;
}

// Non-zero blocks of x per partition, partition p covering blocks [bounds[p], bounds[p+1]);
// also the number of non-zero elements and of non-finite elements in all of x.
std::tuple<at::Tensor, int64_t, int64_t> partition_counts(const at::Tensor& x, int64_t bs,
                                                          const at::Tensor& bounds) {
  TORCH_CHECK(bounds.scalar_type() == at::kLong && bounds.is_contiguous() && bounds.numel() >= 2,
              "partition_counts: bounds must be int64 with at least 2 entries");
  const int64_t n = x.numel(), np = bounds.numel() - 1, nblocks = (n + bs - 1) / bs;
  const int64_t* bd = bounds.data_ptr<int64_t>();
  TORCH_CHECK(bd[0] == 0 && bd[np] == nblocks, "partition_counts: bounds must span all blocks");
  for (int64_t q = 0; q < np; ++q)
    TORCH_CHECK(bd[q] <= bd[q + 1], "partition_counts: bounds must ascend");
  auto counts = at::zeros({np}, at::kLong);
  int64_t* cnt = counts.data_ptr<int64_t>();
  int64_t nnz = 0, bad = 0;
  dispatch(x, "partition_counts", [&](auto* p) {
    const int64_t chunks = chunk_count(n, kGrain);
    std::vector<std::vector<int64_t>> pc(chunks, std::vector<int64_t>(np, 0));
    std::vector<int64_t> nz(chunks, 0), nf(chunks, 0);
    for_chunks(nblocks, chunks, [&](int64_t c, int64_t lo, int64_t hi) {
      int64_t q = std::upper_bound(bd, bd + np + 1, lo) - bd - 1;
      for (int64_t b = lo; b < hi; ++b) {
        while (b >= bd[q + 1]) ++q;
        const int64_t s = b * bs, e = std::min(n, s + bs);
        int64_t k = 0;
        for (int64_t i = s; i < e; ++i) {
          k += p[i] != 0;
          nf[c] += !std::isfinite(p[i]);
        }
        nz[c] += k;
        pc[c][q] += k > 0;
      }
    });
    for (int64_t c = 0; c < chunks; ++c) {
      nnz += nz[c];
      bad += nf[c];
      for (int64_t q = 0; q < np; ++q) cnt[q] += pc[c][q];
    }
  });
  return {counts, nnz, bad};
}

// Error feedback: acc += g in place; returns how many elements of acc are then not finite.
int64_t accumulate_(at::Tensor& acc, const at::Tensor& g) {
  TORCH_CHECK(acc.numel() == g.numel() && acc.scalar_type() == g.scalar_type(),
              "accumulate_: tensors must match in size and dtype");
  check_float(g, "accumulate_");
  int64_t bad = 0;
  dispatch(acc, "accumulate_", [&](auto* a) {
    using T = std::remove_pointer_t<decltype(a)>;
    const T* v = g.data_ptr<T>();
    const int64_t n = acc.numel(), chunks = chunk_count(n, kGrain);
    std::vector<int64_t> nf(chunks, 0);
    for_chunks(n, chunks, [&](int64_t c, int64_t b, int64_t e) {
      int64_t f = 0;
      for (int64_t i = b; i < e; ++i) {
        a[i] += v[i];
        f += !std::isfinite(a[i]);
      }
      nf[c] = f;
    });
    for (int64_t f : nf) bad += f;
  });
  return bad;
}

// DGC momentum correction: u = momentum * u + g; v += u. Returns the non-finite count of v.
int64_t momentum_accumulate_(at::Tensor& u, at::Tensor& v, const at::Tensor& g, double momentum) {
  TORCH_CHECK(u.numel() == g.numel() && v.numel() == g.numel() &&
                  u.scalar_type() == g.scalar_type() && v.scalar_type() == g.scalar_type(),
              "momentum_accumulate_: tensors must match in size and dtype");
  check_float(g, "momentum_accumulate_");
  check_float(v, "momentum_accumulate_");
  int64_t bad = 0;
  dispatch(u, "momentum_accumulate_", [&](auto* up) {
    using T = std::remove_pointer_t<decltype(up)>;
    T* vp = v.data_ptr<T>();
    const T* gp = g.data_ptr<T>();
    const T m = static_cast<T>(momentum);
    const int64_t n = g.numel(), chunks = chunk_count(n, kGrain);
    std::vector<int64_t> nf(chunks, 0);
    for_chunks(n, chunks, [&](int64_t c, int64_t b, int64_t e) {
      int64_t f = 0;
      for (int64_t i = b; i < e; ++i) {
        up[i] = m * up[i] + gp[i];
        vp[i] += up[i];
        f += !std::isfinite(vp[i]);
      }
      nf[c] = f;
    });
    for (int64_t f : nf) bad += f;
  });
  return bad;
}

// Moves the selected units (idx ascending, units of bs elements) from src to dst: dst holds
// src's values there and zeros elsewhere; with clear, src is zeroed there (what stays in src is
// the error-feedback residual). dst may be src (then: zero everything not selected).
void extract_(at::Tensor& src, at::Tensor& dst, const at::Tensor& idx, int64_t bs, bool clear) {
  TORCH_CHECK(src.numel() == dst.numel() && src.scalar_type() == dst.scalar_type(),
              "extract_: src and dst must match in size and dtype");
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.is_contiguous() && bs > 0,
              "extract_: int64 idx");
  check_float(dst, "extract_");
  const int64_t n = src.numel(), k = idx.numel(), units = (n + bs - 1) / bs;
  const int64_t* ix = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i)
    TORCH_CHECK(ix[i] >= 0 && ix[i] < units && (i == 0 || ix[i] > ix[i - 1]),
                "extract_: indices must be ascending and in range");
  const bool same = src.data_ptr() == dst.data_ptr();
  dispatch(src, "extract_", [&](auto* sp) {
    using T = std::remove_pointer_t<decltype(sp)>;
    T* d = dst.data_ptr<T>();
    // Chunks over selected units; chunk c also owns the gap before its first unit (and the last
    // chunk the tail), so every element is written by exactly one thread.
    const int64_t chunks = std::max<int64_t>(1, std::min(chunk_count(n, kGrain), k));
    for_chunks(k, chunks, [&](int64_t c, int64_t lo, int64_t hi) {
      int64_t pos = lo == 0 ? 0 : std::min(n, (ix[lo - 1] + 1) * bs);
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t s = ix[i] * bs, e = std::min(n, s + bs);
        std::fill(d + pos, d + s, T(0));
        if (!same) {
          std::copy(sp + s, sp + e, d + s);
          if (clear) std::fill(sp + s, sp + e, T(0));
        }
        pos = e;
      }
      if (c == chunks - 1) std::fill(d + pos, d + n, T(0));
    });
  });
}

// Zeroes the selected units of t (DGC's momentum factor masking).
void zero_units_(at::Tensor& t, const at::Tensor& idx, int64_t bs) {
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.is_contiguous() && bs > 0,
              "zero_units_: int64 idx");
  const int64_t n = t.numel(), k = idx.numel(), units = (n + bs - 1) / bs;
  const int64_t* ix = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i)
    TORCH_CHECK(ix[i] >= 0 && ix[i] < units, "zero_units_: index out of range");
  dispatch(t, "zero_units_", [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    for_chunks(k, chunk_count(k * bs, kGrain), [&](int64_t, int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t s = ix[i] * bs;
        std::fill(p + s, p + std::min(n, s + bs), T(0));
      }
    });
  });
}

// Non-finite elements in t.
int64_t count_nonfinite(const at::Tensor& t) { return std::get<1>(count_abs_ge(t, 0.0)); }

}  // namespace hvd_sparse

void register_sparsify(pybind11::module_& m) {
  using namespace hvd_sparse;
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("count_abs_ge", &count_abs_ge, py::arg("x"), py::arg("thr"), nogil());
  m.def("select_abs_ge", &select_abs_ge, py::arg("x"), py::arg("thr"), nogil());
  m.def("sample_abs", &sample_abs, py::arg("x"), py::arg("m"), py::arg("seed"), nogil());
  m.def("topk_abs", &topk_abs, py::arg("x"), py::arg("k"), py::arg("seed") = 0, nogil());
  m.def("select_blocks", &select_blocks, py::arg("x"), py::arg("block_size"), py::arg("b0"),
        py::arg("b1"), py::arg("thr"), nogil());
  m.def("sample_block_scores", &sample_block_scores, py::arg("x"), py::arg("block_size"),
        py::arg("b0"), py::arg("b1"), py::arg("m"), py::arg("seed"), nogil());
  m.def("partition_counts", &partition_counts, py::arg("x"), py::arg("block_size"),
        py::arg("bounds"), nogil());
  m.def("accumulate_", &accumulate_, py::arg("acc"), py::arg("g"), nogil());
  m.def("momentum_accumulate_", &momentum_accumulate_, py::arg("u"), py::arg("v"), py::arg("g"),
        py::arg("momentum"), nogil());
  m.def("extract_", &extract_, py::arg("src"), py::arg("dst"), py::arg("idx"),
        py::arg("block_size"), py::arg("clear"), nogil());
  m.def("zero_units_", &zero_units_, py::arg("t"), py::arg("idx"), py::arg("block_size"), nogil());
  m.def("count_nonfinite", &count_nonfinite, py::arg("t"), nogil());
}

// Thread budget shared by the C++ kernels. hvd_sparse.init() sets it (via _C.set_threads) to
// cores / local ranks: ranks share a host, and oversubscribed OpenMP teams spin.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace hvd_sparse {

extern int g_threads;  // defined in codec.cpp; 0: torch's intra-op thread count

// Number of contiguous chunks of at least `grain` items to split [0, n) into.
inline int64_t chunk_count(int64_t n, int64_t grain) {
  const int64_t threads = g_threads > 0 ? g_threads : at::get_num_threads();
  return std::max<int64_t>(
      1, std::min<int64_t>(threads, (n + grain - 1) / std::max<int64_t>(1, grain)));
}

// Calls f(chunk, begin, end) for each of `chunks` contiguous pieces of [0, n), in parallel.
template <typename F>
void for_chunks(int64_t n, int64_t chunks, const F& f) {
  const int64_t step = (n + chunks - 1) / chunks;
  if (chunks <= 1) {
    f(int64_t(0), int64_t(0), n);
    return;
  }
#pragma omp parallel for num_threads(chunks) schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t b = std::min(n, c * step);
    f(c, b, std::min(n, b + step));
  }
}

// Runs f(b, e) over [begin, end) in contiguous, non-empty chunks of at least `grain` items, on
// up to the thread budget's threads (the codec's loops).
template <typename F>
void par_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t n = end - begin;
  for_chunks(n, chunk_count(n, grain), [&](int64_t, int64_t b, int64_t e) {
    if (b < e) f(begin + b, begin + e);
  });
}

}  // namespace hvd_sparse

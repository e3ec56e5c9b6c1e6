// Row-sparse gradients (hvd_sparse._C): the rows of an embedding table's COO gradient, summed
// per distinct row. Used twice per reduction: on this rank's gradient before it is sent (an
// embedding gradient repeats a row once per lookup), and on the rows gathered from all ranks.
// The work is proportional to the rows given, never to the table's size.
//
// Deterministic: each row's terms are added in the order given (rank order, for gathered
// rows), so every rank computes bit-identical sums. 16-bit values are added in float32 and
// rounded once.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "blocks.h"
#include "parallel.h"

namespace hvd_sparse {
namespace {

// Sorted distinct rows of `rows` (entries < 0 skipped: header rows) and, for each entry,
// the index of its row among them (-1: skipped), with the sort's scratch. One per thread,
// kept between calls up to kKeep entries: vectors of a few hundred KB made afresh each call
// cost as much in page faults (glibc maps them anew) as the sort.
struct Groups {
  std::vector<int64_t> row, slot, order, key, order2, key2;
  std::vector<uint64_t> bits, below;  // by_bitmap's
};
constexpr size_t kKeep = size_t(1) << 20;

// group_rows for a table whose bitmap of rows (one bit a row) is small beside the rows given:
// a bit set per row, the set bits read in order are the distinct rows, and a row's slot is
// the set bits below it (counted per 64-bit word, then within its word). Linear in the rows
// and the table's words, with no sort: two passes over the rows where the radix sort takes
// two to four, each moving two arrays.
void by_bitmap(Groups& g, const int64_t* r, int64_t n, int64_t nrows) {
  const size_t words = size_t((nrows + 63) / 64);
  g.bits.assign(words, 0);
  g.below.resize(words);
  for (int64_t i = 0; i < n; ++i) {
    if (r[i] < 0) continue;
    TORCH_CHECK(r[i] < nrows, "row ", r[i], " out of range for ", nrows, " rows");
    g.bits[size_t(r[i] >> 6)] |= uint64_t(1) << (r[i] & 63);
  }
  uint64_t seen = 0;
  for (size_t w = 0; w < words; ++w) {
    g.below[w] = seen;
    for (uint64_t b = g.bits[w]; b; b &= b - 1)
      g.row.push_back(int64_t(w * 64) + __builtin_ctzll(b));
    seen += uint64_t(__builtin_popcountll(g.bits[w]));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (r[i] < 0) continue;
    const size_t w = size_t(r[i] >> 6);
    const uint64_t lower = g.bits[w] & ((uint64_t(1) << (r[i] & 63)) - 1);
    g.slot[size_t(i)] = int64_t(g.below[w]) + __builtin_popcountll(lower);
  }
}

const Groups& group_rows(const int64_t* r, int64_t n, int64_t nrows) {
  thread_local Groups scratch;
  Groups& g = scratch;  // one look-up of the thread's copy (each costs a call in a .so)
  if (g.key.capacity() > kKeep || g.bits.capacity() > kKeep) g = Groups();
  g.order.clear();
  g.key.clear();
  g.row.clear();
  g.slot.assign(size_t(n), -1);
  // the bitmap's words cost about what a radix pass's entries do: take it where it is smaller
  if (nrows <= 64 * (2 * n + 1024)) {
    by_bitmap(g, r, n, nrows);
    return g;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (r[i] < 0) continue;
    TORCH_CHECK(r[i] < nrows, "row ", r[i], " out of range for ", nrows, " rows");
    g.order.push_back(i);
    g.key.push_back(r[i]);
  }
  // LSD radix sort by row, 11 bits a pass (a 16 KiB histogram stays in L1): linear in the
  // rows. A comparison sort of the tens of thousands of rows a step gathers cost more than
  // summing them.
  constexpr int kBits = 11;
  constexpr int64_t kRadix = int64_t(1) << kBits;
  int width = 0;
  while (width < 63 && (int64_t(1) << width) < nrows) ++width;
  const size_t m = g.key.size();
  g.order2.resize(m);
  g.key2.resize(m);
  std::vector<int64_t> count(static_cast<size_t>(kRadix));
  for (int shift = 0; shift < width; shift += kBits) {
    std::fill(count.begin(), count.end(), 0);
    for (int64_t k : g.key) ++count[size_t((k >> shift) & (kRadix - 1))];
    int64_t at = 0;
    for (int64_t& c : count) {  // counts to where each digit's rows start
      const int64_t here = c;
      c = at;
      at += here;
    }
    for (size_t j = 0; j < m; ++j) {
      const int64_t dst = count[size_t((g.key[j] >> shift) & (kRadix - 1))]++;
      g.key2[size_t(dst)] = g.key[j];
      g.order2[size_t(dst)] = g.order[j];
    }
    g.key.swap(g.key2);
    g.order.swap(g.order2);
  }
  for (size_t k = 0; k < m; ++k) {
    if (k == 0 || g.key[k] != g.key[k - 1]) g.row.push_back(g.key[k]);
    g.slot[size_t(g.order[k])] = int64_t(g.row.size()) - 1;
  }
  return g;
}

// Where sums of `count` values of type T are added up, zeroed: `out` itself, or for 16-bit
// values `wide` (float32: rounded once, at the end).
template <typename A, typename T>
A* zeroed_sums(T* out, int64_t count, std::vector<A>& wide) {
  if constexpr (std::is_same_v<A, T>) {
    std::fill(out, out + count, A(0));
    return out;
  } else {
    wide.assign(size_t(count), A(0));
    return wide.data();
  }
}

}  // namespace

// (distinct rows ascending, int64 [u]; their summed values times `scale`, [u, ...]) of the
// COO rows `rows` (int64 [n]) and the value rows `values` ([n, ...]), or, given `uses` (int64
// [n]), of `values[uses[i]]` for row i: an EmbeddingBag's gradient repeats one value row for
// every id of a bag, and travels with each row once. The value rows may come in `parts`, one
// after another (each rank's, where an allgather left them: no copy to join them). Rows < 0
// are skipped; rows >= nrows raise.
std::tuple<at::Tensor, at::Tensor> sum_rows(const at::Tensor& rows,
                                            const std::vector<at::Tensor>& parts, int64_t nrows,
                                            double scale,
                                            const c10::optional<at::Tensor>& uses) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "sum_rows: rows must be a contiguous int64 vector");
  const int64_t n = rows.size(0);
  TORCH_CHECK(!parts.empty(), "sum_rows: no values");
  const at::Tensor& first = parts[0];
  int64_t vrows = 0;
  for (const at::Tensor& p : parts) {
    TORCH_CHECK(p.dim() >= 1 && p.is_contiguous() && p.device().is_cpu() &&
                    p.scalar_type() == first.scalar_type() &&
                    p.sizes().slice(1) == first.sizes().slice(1),
                "sum_rows: values must be contiguous CPU rows, every part of one dtype and "
                "row shape");
    vrows += p.size(0);
  }
  const int64_t* use = nullptr;
  if (uses.has_value()) {
    TORCH_CHECK(uses->scalar_type() == at::kLong && uses->dim() == 1 && uses->is_contiguous() &&
                    uses->size(0) == n,
                "sum_rows: uses must be a contiguous int64 vector, one entry per row");
    use = uses->data_ptr<int64_t>();
  } else {
    TORCH_CHECK(vrows == n, "sum_rows: values must hold one row per index");
  }
  const int64_t width = first.size(0) ? first.numel() / first.size(0)
                                      : c10::multiply_integers(first.sizes().slice(1));
  const Groups& g = group_rows(rows.data_ptr<int64_t>(), n, nrows);
  if (use) {
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(g.slot[size_t(i)] < 0 || (use[i] >= 0 && use[i] < vrows), "sum_rows: row ",
                  i, " uses value row ", use[i], " of ", vrows);
  }
  const int64_t u = int64_t(g.row.size());
  auto shape = first.sizes().vec();
  shape[0] = u;
  at::Tensor out_rows = at::empty({u}, at::kLong);
  std::copy(g.row.begin(), g.row.end(), out_rows.data_ptr<int64_t>());
  at::Tensor out = at::empty(shape, first.options());
  const int64_t* slot = g.slot.data();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, first.scalar_type(), "sum_rows", [&] {
    using A = acc_t<scalar_t>;
    // Value row k wherever its part lies: the gathered parts are summed where they landed.
    std::vector<const scalar_t*> row(size_t(vrows), nullptr);
    int64_t at_row = 0;
    for (const at::Tensor& p : parts) {
      const scalar_t* v = p.data_ptr<scalar_t>();
      for (int64_t r = 0; r < p.size(0); ++r) row[size_t(at_row++)] = v + r * width;
    }
    scalar_t* o = out.data_ptr<scalar_t>();
    std::vector<A> wide;
    A* acc = zeroed_sums<A>(o, u * width, wide);
    const A s = A(scale);
    // Entries in input order: each row's terms are added in the order given (rank order, for
    // gathered rows), so every rank computes the same bits; the values are read once, in
    // order, and what is written at random is the union's sums, which stay in cache. Threads
    // take columns.
    for_chunks(width, chunk_count(u * std::max<int64_t>(1, width), 1 << 16),
               [&](int64_t, int64_t c0, int64_t c1) {
                 for (int64_t i = 0; i < n; ++i) {
                   const int64_t k = slot[i];
                   if (k < 0) continue;
                   const scalar_t* __restrict__ src = row[size_t(use ? use[i] : i)];
                   A* __restrict__ dst = acc + k * width;
                   for (int64_t c = c0; c < c1; ++c) dst[c] += A(src[c]);
                 }
                 for (int64_t k = 0; k < u; ++k)
                   for (int64_t c = c0; c < c1; ++c)
                     o[k * width + c] = scalar_t(acc[k * width + c] * s);
               });
  });
  return {out_rows, out};
}

std::tuple<at::Tensor, at::Tensor> sum_rows_one(const at::Tensor& rows, const at::Tensor& values,
                                                int64_t nrows, double scale,
                                                const c10::optional<at::Tensor>& uses) {
  return sum_rows(rows, std::vector<at::Tensor>{values}, nrows, scale, uses);
}

// Where each run of bit-identical consecutive rows of `values` ([n, ...], contiguous) starts:
// int64 [m], 0 first. An EmbeddingBag's gradient repeats its bag's row once per id of the bag.
at::Tensor row_runs(const at::Tensor& values) {
  TORCH_CHECK(values.dim() >= 1 && values.is_contiguous() && values.device().is_cpu(),
              "row_runs: values must be contiguous CPU rows");
  const int64_t n = values.size(0);
  const size_t bytes = n ? size_t(values.nbytes() / size_t(n)) : 0;
  const auto* v = static_cast<const unsigned char*>(values.data_ptr());
  std::vector<int64_t> first;
  for (int64_t i = 0; i < n; ++i)
    if (i == 0 || std::memcmp(v + size_t(i) * bytes, v + size_t(i - 1) * bytes, bytes) != 0)
      first.push_back(i);
  at::Tensor out = at::empty({int64_t(first.size())}, at::kLong);
  std::copy(first.begin(), first.end(), out.data_ptr<int64_t>());
  return out;
}

// How many distinct rows `rows` (int64 [n]) names (entries < 0 skipped; >= nrows raise).
int64_t count_rows(const at::Tensor& rows, int64_t nrows) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "count_rows: rows must be a contiguous int64 vector");
  return int64_t(group_rows(rows.data_ptr<int64_t>(), rows.size(0), nrows).row.size());
}

// The value row of every gathered row, as sum_rows takes it (``uses``), or None when every
// rank sent a value row per row. What came from the `ranks` ranks, in rank order: `rows`,
// each rank's part a header row (`header`, negative) then its rows; `runs`, each rank's
// [0] (a value row each) or [m, len_1 .. len_m] (m value rows, each for a run of len_i rows);
// `nvals` value rows, each rank's part a zero row (its header's) then its values. Raises,
// naming the rank, where a header differs (the ranks disagree on the tensor: "mismatch") or
// runs do not add up.
c10::optional<at::Tensor> gathered_uses(const at::Tensor& rows, int64_t header,
                                        const at::Tensor& runs, int64_t nvals, int64_t ranks) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() &&
                  runs.scalar_type() == at::kLong && runs.dim() == 1 && runs.is_contiguous(),
              "gathered_uses: rows and runs must be contiguous int64 vectors");
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* run = runs.data_ptr<int64_t>();
  const int64_t n = rows.size(0), nruns = runs.size(0);
  constexpr const char* kMismatch =
      "tensor mismatch across ranks: the ranks' sparse gradients differ in shape or dtype";
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < n; ++i) {
    if (r[i] >= 0) continue;
    TORCH_CHECK(r[i] == header && int64_t(starts.size()) < ranks, kMismatch);
    starts.push_back(i);
  }
  TORCH_CHECK(int64_t(starts.size()) == ranks && (n == 0 || starts[0] == 0), kMismatch);
  at::Tensor uses = at::empty({n}, at::kLong);
  int64_t* u = uses.data_ptr<int64_t>();
  int64_t at = 0, base = 0;
  bool plain = true;
  for (int64_t k = 0; k < ranks; ++k) {
    const int64_t c = (k + 1 < ranks ? starts[size_t(k + 1)] : n) - starts[size_t(k)] - 1;
    const int64_t m = at < nruns ? run[at] : -1;
    bool ok = m >= 0 && m < nruns - at;  // (not at + 1 + m: a sent m may be near 2^63)
    int64_t total = 0;
    for (int64_t j = 0; ok && j < m; ++j) {  // each at most what is left: no overflow
      const int64_t len = run[at + 1 + j];
      ok = len >= 1 && len <= c - total;
      if (ok) total += len;
    }
    TORCH_CHECK(ok && (m == 0 || total == c), "rank ", k, " sent malformed runs (", m,
                " of them for ", c, " rows)");
    int64_t* out = u + starts[size_t(k)];
    *out++ = base;  // the header row: its zero value row
    if (m == 0) {
      for (int64_t j = 0; j < c; ++j) *out++ = base + 1 + j;
    } else {
      plain = false;
      for (int64_t j = 0; j < m; ++j)
        for (int64_t l = 0; l < run[at + 1 + j]; ++l) *out++ = base + 1 + j;
    }
    at += 1 + m;
    base += 1 + (m ? m : c);
  }
  TORCH_CHECK(at == nruns && base == nvals,
              "the gathered runs and values do not match the rows");
  if (plain) return c10::nullopt;
  return uses;
}

}  // namespace hvd_sparse

void register_rows(pybind11::module_& m) {
  m.def("sum_rows", &hvd_sparse::sum_rows_one,
        "distinct rows of a COO gradient and their summed values", pybind11::arg("rows"),
        pybind11::arg("values"), pybind11::arg("nrows"), pybind11::arg("scale") = 1.0,
        pybind11::arg("uses") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("sum_rows", &hvd_sparse::sum_rows,
        "the same, of values in parts (their rows one after another)", pybind11::arg("rows"),
        pybind11::arg("values"), pybind11::arg("nrows"), pybind11::arg("scale") = 1.0,
        pybind11::arg("uses") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("count_rows", &hvd_sparse::count_rows, "distinct rows named (entries < 0 skipped)",
        pybind11::arg("rows"), pybind11::arg("nrows"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gathered_uses", &hvd_sparse::gathered_uses,
        "the value row of every gathered row (their runs undone), or None", pybind11::arg("rows"),
        pybind11::arg("header"), pybind11::arg("runs"), pybind11::arg("nvals"),
        pybind11::arg("ranks"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("row_runs", &hvd_sparse::row_runs,
        "where each run of bit-identical consecutive rows starts", pybind11::arg("values"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}

// Row-sparse gradients (hvd_sparse._C): the rows of an embedding table's COO gradient, summed
// per distinct row. Used twice per reduction: on this rank's gradient before it is sent (an
// embedding gradient repeats a row once per lookup), and on the rows gathered from all ranks.
// The work is proportional to the rows given, never to the table's size.
//
// Deterministic: rows are ordered by a stable sort, so equal rows are added in the order given
// (rank order, for gathered rows) and every rank computes bit-identical sums. 16-bit values
// are added in float32 and rounded once.
#include <torch/extension.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "blocks.h"
#include "parallel.h"

namespace hvd_sparse {
namespace {

// Sorted distinct rows of `rows` (entries < 0 skipped: header rows) with, for each, the
// positions of its occurrences in input order (CSR: `first` and `order`).
struct Groups {
  std::vector<int64_t> row, first, order;
};

Groups group_rows(const int64_t* r, int64_t n, int64_t nrows) {
  std::vector<int64_t> order;
  order.reserve(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    if (r[i] < 0) continue;
    TORCH_CHECK(r[i] < nrows, "row ", r[i], " out of range for ", nrows, " rows");
    order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(), [r](int64_t a, int64_t b) { return r[a] < r[b]; });
  Groups g;
  g.order = std::move(order);
  for (size_t k = 0; k < g.order.size(); ++k) {
    if (k == 0 || r[g.order[k]] != r[g.order[k - 1]]) {
      g.row.push_back(r[g.order[k]]);
      g.first.push_back(int64_t(k));
    }
  }
  g.first.push_back(int64_t(g.order.size()));
  return g;
}

}  // namespace

// (distinct rows ascending, int64 [u]; their summed values times `scale`, [u, ...]) of the
// COO rows `rows` (int64 [n]) and `values` ([n, ...]), or, given `uses` (int64 [n]), of
// `values[uses[i]]` for row i: an EmbeddingBag's gradient repeats one value row for every id
// of a bag, and travels with each row once. Rows < 0 are skipped; rows >= nrows raise.
std::tuple<at::Tensor, at::Tensor> sum_rows(const at::Tensor& rows, const at::Tensor& values,
                                            int64_t nrows, double scale,
                                            const c10::optional<at::Tensor>& uses) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "sum_rows: rows must be a contiguous int64 vector");
  const int64_t n = rows.size(0);
  TORCH_CHECK(values.dim() >= 1 && values.is_contiguous() && values.device().is_cpu(),
              "sum_rows: values must be contiguous CPU rows");
  const int64_t* use = nullptr;
  if (uses.has_value()) {
    TORCH_CHECK(uses->scalar_type() == at::kLong && uses->dim() == 1 && uses->is_contiguous() &&
                    uses->size(0) == n,
                "sum_rows: uses must be a contiguous int64 vector, one entry per row");
    use = uses->data_ptr<int64_t>();
  } else {
    TORCH_CHECK(values.size(0) == n, "sum_rows: values must hold one row per index");
  }
  const int64_t vrows = values.size(0);
  const int64_t width = vrows ? values.numel() / vrows : 0;
  Groups g = group_rows(rows.data_ptr<int64_t>(), n, nrows);
  if (use) {
    for (int64_t i : g.order)
      TORCH_CHECK(use[i] >= 0 && use[i] < vrows, "sum_rows: row ", i, " uses value row ",
                  use[i], " of ", vrows);
  }
  const int64_t u = int64_t(g.row.size());
  auto shape = values.sizes().vec();
  shape[0] = u;
  at::Tensor out_rows = at::empty({u}, at::kLong);
  std::copy(g.row.begin(), g.row.end(), out_rows.data_ptr<int64_t>());
  at::Tensor out = at::empty(shape, values.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "sum_rows", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t* v = values.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const A s = A(scale);
    for_chunks(u, chunk_count(u * std::max<int64_t>(1, width), 1 << 16),
               [&](int64_t, int64_t lo, int64_t hi) {
                 std::vector<A> acc(static_cast<size_t>(width), A(0));
                 for (int64_t k = lo; k < hi; ++k) {
                   std::fill(acc.begin(), acc.end(), A(0));
                   for (int64_t j = g.first[k]; j < g.first[k + 1]; ++j) {
                     const int64_t i = g.order[j];
                     const scalar_t* src = v + (use ? use[i] : i) * width;
                     for (int64_t c = 0; c < width; ++c) acc[c] += A(src[c]);
                   }
                   scalar_t* dst = o + k * width;
                   for (int64_t c = 0; c < width; ++c) dst[c] = scalar_t(acc[c] * s);
                 }
               });
  });
  return {out_rows, out};
}

}  // namespace hvd_sparse

void register_rows(pybind11::module_& m) {
  m.def("sum_rows", &hvd_sparse::sum_rows,
        "distinct rows of a COO gradient and their summed values", pybind11::arg("rows"),
        pybind11::arg("values"), pybind11::arg("nrows"), pybind11::arg("scale") = 1.0,
        pybind11::arg("uses") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}

// The one definition of the extension module hvd_sparse._C: each source file registers its own
// functions; this file only gathers them.
#include <torch/extension.h>

namespace hvd_sparse {
void register_codec(pybind11::module_& m);        // csrc/codec.cpp
void register_fresh_zeros(pybind11::module_& m);  // csrc/fresh_zeros.cpp
namespace omni {
void register_omni(pybind11::module_& m);             // csrc/omni/worker/binding.cpp
void register_aggregation(pybind11::module_& m);      // csrc/omni/aggregator/binding.cpp
void register_aggregator_core(pybind11::module_& m);  // csrc/omni/aggregator/binding.cpp
void register_auth(pybind11::module_& m);             // csrc/omni/aggregator/binding.cpp
void register_endpoint(pybind11::module_& m);         // csrc/omni/aggregator/binding.cpp
void register_switch_pipeline(pybind11::module_& m);  // csrc/switch/binding.cpp
}  // namespace omni
}  // namespace hvd_sparse
void register_sparsify(pybind11::module_& m);   // csrc/sparsify.cpp
void register_rows(pybind11::module_& m);       // csrc/rows.cpp
void register_cuda_host(pybind11::module_& m);  // csrc/cuda/host.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hvd-sparse C++ core: block codec, collective segments, sparsifiers, aggregation";
  hvd_sparse::register_codec(m);
  register_sparsify(m);
  register_rows(m);
  hvd_sparse::register_fresh_zeros(m);
  register_cuda_host(m);
  hvd_sparse::omni::register_omni(m);
  hvd_sparse::omni::register_aggregation(m);  // the base of the next two
  hvd_sparse::omni::register_aggregator_core(m);
  hvd_sparse::omni::register_auth(m);
  hvd_sparse::omni::register_endpoint(m);
  hvd_sparse::omni::register_switch_pipeline(m);
}

// torch's ScalarType -> the wire/segment dtype code (blocks.h): the one mapping, for the codec
// (csrc/codec.cpp) and the aggregation worker (csrc/omni/worker/binding.cpp). Torch-side only: the
// torch-free aggregator and hvd_sparse._protocol never see a ScalarType.
#pragma once
#include <torch/extension.h>

#include <stdexcept>
#include <string>

#include "blocks.h"

namespace hvd_sparse {

inline uint8_t dtype_code(at::ScalarType s) {
  switch (s) {
    case at::kFloat: return kF32;
    case at::kDouble: return kF64;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    default:
      throw std::invalid_argument(std::string("hvd_sparse: unsupported dtype ") + c10::toString(s));
  }
}

}  // namespace hvd_sparse

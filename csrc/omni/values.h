// Block values, per dtype: loading and storing the elements of a block as they lie in a tensor
// and on the wire (little-endian, the host's order on every supported platform; any
// alignment). The one copy of these conversions for the aggregator's float64 sums
// (aggregator/core.cpp), the switch's int32 adds (csrc/switch/pipeline.cpp) and the
// worker's scaling and fixed point (worker/engine.cpp). float16 and bfloat16 go through
// halfconv.h, which the CUDA kernels share. Torch-free.
//
// The block codec (csrc/codec.cpp) is not a user: it reads typed tensors through torch's
// c10::Half and c10::BFloat16, whose bfloat16 rounding of NaN differs from halfconv.h's (a
// canonical NaN vs the sign and payload kept), so moving it here would change bytes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "halfconv.h"
#include "protocol.h"

namespace hvd_sparse::omni {

// One wire dtype: `Arith` is the type its values compute in (float32 for float32, float16 and
// bfloat16, as torch does; float64; int32 for fixed32); get/put read and write element i of
// the array at v, rounding to nearest; put_double rounds a float64 value once to the dtype
// (16-bit floats through round-to-odd float32, halfconv.h).
template <uint8_t D>
struct Value;

template <>
struct Value<kF32> {
  using Arith = float;
  static float get(const uint8_t* v, size_t i) {
    float x;
    std::memcpy(&x, v + 4 * i, 4);
    return x;
  }
  static void put(uint8_t* o, size_t i, float x) { std::memcpy(o + 4 * i, &x, 4); }
  static void put_double(uint8_t* o, size_t i, double x) { put(o, i, float(x)); }
};

template <>
struct Value<kF64> {
  using Arith = double;
  static double get(const uint8_t* v, size_t i) {
    double x;
    std::memcpy(&x, v + 8 * i, 8);
    return x;
  }
  static void put(uint8_t* o, size_t i, double x) { std::memcpy(o + 8 * i, &x, 8); }
  static void put_double(uint8_t* o, size_t i, double x) { put(o, i, x); }
};

// float16 and bfloat16: 16-bit patterns, computed in float32.
template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
struct Value16 {
  using Arith = float;
  static float get(const uint8_t* v, size_t i) {
    uint16_t x;
    std::memcpy(&x, v + 2 * i, 2);
    return ToFloat(x);
  }
  static void put(uint8_t* o, size_t i, float x) {
    const uint16_t h = FromFloat(x);
    std::memcpy(o + 2 * i, &h, 2);
  }
  static void put_double(uint8_t* o, size_t i, double x) { put(o, i, to_float_odd(x)); }
};
template <>
struct Value<kF16> : Value16<f16_to_float, float_to_f16> {};
template <>
struct Value<kBF16> : Value16<bf16_to_float, float_to_bf16> {};

// int32 fixed point (docs/PROTOCOL.md "Fixed point"); put_double truncates a value the caller
// has already made integral and in range.
template <>
struct Value<kFixed32> {
  using Arith = int32_t;
  static int32_t get(const uint8_t* v, size_t i) {
    int32_t x;
    std::memcpy(&x, v + 4 * i, 4);
    return x;
  }
  static void put(uint8_t* o, size_t i, int32_t x) { std::memcpy(o + 4 * i, &x, 4); }
  static void put_double(uint8_t* o, size_t i, double x) { put(o, i, int32_t(x)); }
};

// Calls f(Value<d>{}) for a wire dtype known only at run time (validated by the caller): the
// switch sits outside the caller's per-element loop. Loops that store through the byte
// pointers belong in a function taking them by value, not in a lambda capturing them by
// reference: a byte store may alias the captured pointers, which then are reloaded for every
// element and the loop is not vectorized (3x slower sums' rounding, measured).
template <typename F>
decltype(auto) with_dtype(uint8_t d, F&& f) {
  switch (d) {
    case kF32: return f(Value<kF32>{});
    case kF64: return f(Value<kF64>{});
    case kF16: return f(Value<kF16>{});
    case kFixed32: return f(Value<kFixed32>{});
    default: return f(Value<kBF16>{});
  }
}

// a[i] += element i of v, for n elements, in float64 (exact for every dtype's values).
template <typename V>
void add_values(double* a, const uint8_t* v, size_t n) {
  for (size_t i = 0; i < n; ++i) a[i] += V::get(v, i);
}
inline void add_values(double* a, const uint8_t* v, size_t n, uint8_t dtype) {
  with_dtype(dtype, [=](auto t) { add_values<decltype(t)>(a, v, n); });
}

// Element i of o = a[i] rounded once to the dtype, for n elements.
template <typename V>
void store_values(uint8_t* o, const double* a, size_t n) {
  if constexpr (std::is_same_v<V, Value<kF64>>) {
    std::memcpy(o, a, n * 8);
  } else {
    for (size_t i = 0; i < n; ++i) V::put_double(o, i, a[i]);
  }
}
inline void store_values(uint8_t* o, const double* a, size_t n, uint8_t dtype) {
  with_dtype(dtype, [=](auto t) { store_values<decltype(t)>(o, a, n); });
}

// o = v * scale, element by element, in the dtype's own arithmetic (float32 for float32 and
// the 16-bit floats, as torch's x.mul_(scale) does; float64 for float64).
template <typename V>
void scale_values(uint8_t* o, const uint8_t* v, size_t n, typename V::Arith scale) {
  for (size_t i = 0; i < n; ++i) V::put(o, i, V::get(v, i) * scale);
}
inline void scale_values(uint8_t* o, const uint8_t* v, size_t n, uint8_t dtype, double scale) {
  with_dtype(dtype, [=](auto t) {
    using V = decltype(t);
    scale_values<V>(o, v, n, typename V::Arith(scale));
  });
}

}  // namespace hvd_sparse::omni

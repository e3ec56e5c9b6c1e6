// float16 / bfloat16 <-> float32 bit conversions (round to nearest even), torch-free so the
// aggregator binary can sum 16-bit wire values in wider precision; the CUDA unpack kernel adds
// 16-bit values with the same functions.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../host_device.h"

namespace hvd_sparse::omni {

__host__ __device__ inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
__host__ __device__ inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

__host__ __device__ inline float bf16_to_float(uint16_t h) {
  return bits_to_float(uint32_t(h) << 16);
}

__host__ __device__ inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}

__host__ __device__ inline float f16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    float f = float(man) * (1.0f / 16777216.0f);  // subnormal: man * 2^-24
    return sign ? -f : f;
  }
  return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
}

__host__ __device__ inline uint16_t float_to_f16(float f) {
  uint32_t u = float_to_bits(f), sign = (u >> 16) & 0x8000, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00);   // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00);  // rounds to Inf
  if (a < 0x38800000u) {                                 // subnormal or zero in f16
    float m = bits_to_float(a) * 16777216.0f;            // value in units of 2^-24
    uint32_t q = uint32_t(m);                            // exact: scaling by 2^24
    float frac = m - float(q);
    if (frac > 0.5f || (frac == 0.5f && (q & 1))) ++q;
    return uint16_t(sign | q);
  }
  uint32_t e = (a >> 23) - 112, man = a & 0x7fffff;
  uint32_t h = (e << 10) | (man >> 13), rest = man & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;  // may carry into the exponent: fine
  return uint16_t(sign | h);
}

// float64 -> float32 rounded to odd (truncated, lowest bit set when inexact): rounding that to
// float16 or bfloat16 (at least 2 bits narrower than float32) then rounds the float64 value
// exactly once; rounding to nearest twice can land one ulp off (e.g. 1 + 2^-11 + 2^-24 would
// become 1.0 in float16 instead of 1 + 2^-10). The aggregator's sums and the worker's
// fixed-point results both go through it, so every rank gets the same bytes.
inline float to_float_odd(double d) {
  float f = float(d);
  if (std::isfinite(f) && double(f) != d) {
    uint32_t u = float_to_bits(f);
    if (std::fabs(double(f)) > std::fabs(d)) --u;  // toward zero (sign-magnitude)
    f = bits_to_float(u | 1);
  }
  return f;
}

}  // namespace hvd_sparse::omni

// Storage element <-> float32 conversions shared by the kernels (paged_attention.cpp,
// norm_rope.cpp). bf16 is the top half of a float, so loading one is a shift, which the
// compiler vectorizes inside loops where c10's conversion operator is not vectorized.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace kvserve {

// float64 (dispatched with the others, never a model's dtype) is computed in float32 too.
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// float32 to bf16 bits, rounding to nearest even as torch's own conversion does (finite
// values: the kernels are built with -ffast-math, which assumes no NaNs), written so the
// compiler vectorizes it.
inline uint16_t bf16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

inline void store(double* out, float x) { *out = x; }
inline void store(float* out, float x) { *out = x; }
inline void store(c10::Half* out, float x) { *out = c10::Half(x); }
inline void store(c10::BFloat16* out, float x) { out->x = bf16_bits(x); }

}  // namespace kvserve

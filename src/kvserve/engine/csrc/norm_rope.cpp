// A decoder layer's elementwise passes as single loops: RMSNorm, and Q/K's per-head norm
// plus rotary embedding in place on the fused QKV projection.
//
// Written with torch ops, an RMSNorm is half a dozen passes over the tensor (square, mean,
// add, rsqrt, scale, weight; in bf16 also a conversion to float and back), and RoPE three
// more (roll, multiply, addcmul): in a bf16 round on the 1024-wide model they took 11% of
// the CPU time, against the linears' 74% (docs/benchmarks.md). Here each row is read once
// and written once, computed in float32 whatever the storage dtype, rounded once.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "convert.h"

namespace {

using kvserve::store;
using kvserve::to_float;

// Rows of this many elements or more per thread: smaller ops run on one thread, where
// waking a sibling costs more than the split saves (decode steps' 16 rows).
constexpr int64_t kElementsPerTask = 32768;

// 1 / sqrt(mean(x^2) + eps) of one row of float32 values.
inline float inverse_rms(const float* row, int64_t dim, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < dim; ++i) sum += row[i] * row[i];
  return 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
}

// One row: dst = src / rms(src) * weight, through the float scratch `row` [dim].
template <typename T>
void norm_row(const T* src, const T* weight, T* dst, int64_t dim, float eps, float* row) {
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) row[i] = to_float(src[i]);
  const float scale = inverse_rms(row, dim, eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) store(dst + i, row[i] * scale * to_float(weight[i]));
}

// One head in place: normalized when `weight` is given, then rotated.
template <typename T>
void norm_rope_row(T* x, const T* weight, const T* cos, const T* sin, int64_t head_dim,
                   float eps, float* row) {
  const int64_t half = head_dim / 2;
#pragma omp simd
  for (int64_t i = 0; i < head_dim; ++i) row[i] = to_float(x[i]);
  if (weight != nullptr) {
    const float scale = inverse_rms(row, head_dim, eps);
#pragma omp simd
    for (int64_t i = 0; i < head_dim; ++i) row[i] = row[i] * scale * to_float(weight[i]);
  }
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    store(x + i, row[i] * to_float(cos[i]) + row[i + half] * to_float(sin[i]));
    store(x + i + half, row[i + half] * to_float(cos[i + half]) + row[i] * to_float(sin[i + half]));
  }
}

// x [rows..., dim] (last dim contiguous; leading dims any strides, flattened here) ->
// a new contiguous tensor. weight [dim], or [x.size(-2), dim]: one weight row per head.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 2 && x.stride(-1) == 1, "rms_norm: x must be [..., dim], dim contiguous");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be contiguous, of x's dtype");
  const int64_t dim = x.size(-1);
  const int64_t per_row_weight = weight.dim() == 2 ? x.size(-2) : 1;
  TORCH_CHECK(weight.size(-1) == dim && weight.numel() == per_row_weight * dim,
              "rms_norm: weight must be [dim] or [x.size(-2), dim]");
  // Flatten the leading dims as (outer, inner): every layout here is [T, dim] or a view of
  // [T, heads, dim] whose heads are adjacent rows.
  const at::Tensor rows = x.dim() == 2 ? x.unsqueeze(0) : x.flatten(0, x.dim() - 3);
  TORCH_CHECK(rows.stride(1) == dim, "rms_norm: a token's rows must be adjacent");
  const int64_t outer = rows.size(0), inner = rows.size(1), outer_stride = rows.stride(0);
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const float epsilon = static_cast<float>(eps);
  const int64_t total = outer * inner;
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / dim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> row(dim);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t t = r / inner, h = r % inner;
        norm_row(in + t * outer_stride + h * dim, w + (per_row_weight > 1 ? h * dim : 0),
                 o + r * dim, dim, epsilon, row.data());
      }
    });
  });
  return out;
}

// In place on qkv [T, heads, head_dim] (head_dim contiguous): the first `rotated` heads of
// each token (Q's, then K's) are normalized per head when `norm_weight` ([rotated,
// head_dim]) is given, then rotated by the half-split convention: out = x * cos +
// swap_halves(x) * signed_sin, with cos and signed_sin [T, head_dim] (any row stride; the
// sin table's first half already negated, as RotaryTable keeps it).
void qk_norm_rope_(at::Tensor& qkv, const std::optional<at::Tensor>& norm_weight,
                   const at::Tensor& cos, const at::Tensor& sin, int64_t rotated, double eps) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2),
              "qk_norm_rope_: qkv must be [T, heads, head_dim] with contiguous heads");
  const int64_t tokens = qkv.size(0), head_dim = qkv.size(2);
  TORCH_CHECK(head_dim % 2 == 0 && rotated <= qkv.size(1), "qk_norm_rope_: bad shapes");
  const at::Tensor cos2 = cos.reshape({tokens, head_dim});
  const at::Tensor sin2 = sin.reshape({tokens, head_dim});
  TORCH_CHECK(cos2.stride(1) == 1 && sin2.stride(1) == 1 &&
                  cos2.scalar_type() == qkv.scalar_type() &&
                  sin2.scalar_type() == qkv.scalar_type(),
              "qk_norm_rope_: cos/sin must be [T, head_dim] of qkv's dtype");
  if (norm_weight) {
    TORCH_CHECK(norm_weight->is_contiguous() && norm_weight->numel() == rotated * head_dim &&
                    norm_weight->scalar_type() == qkv.scalar_type(),
                "qk_norm_rope_: norm weight must be [rotated, head_dim] of qkv's dtype");
  }
  const float epsilon = static_cast<float>(eps);
  const int64_t total = tokens * rotated;
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / head_dim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "qk_norm_rope_", [&] {
    scalar_t* data = qkv.data_ptr<scalar_t>();
    const scalar_t* w = norm_weight ? norm_weight->data_ptr<scalar_t>() : nullptr;
    const scalar_t* cos_data = cos2.data_ptr<scalar_t>();
    const scalar_t* sin_data = sin2.data_ptr<scalar_t>();
    at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> row(head_dim);
      for (int64_t r = begin; r < end; ++r) {
        const int64_t t = r / rotated, h = r % rotated;
        norm_rope_row(data + t * qkv.stride(0) + h * head_dim,
                      w == nullptr ? nullptr : w + h * head_dim, cos_data + t * cos2.stride(0),
                      sin_data + t * sin2.stride(0), head_dim, epsilon, row.data());
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_kernels, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("qk_norm_rope_(Tensor(a!) qkv, Tensor? norm_weight, Tensor cos, Tensor sin, "
        "int rotated, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_kernels, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("qk_norm_rope_", &qk_norm_rope_);
}

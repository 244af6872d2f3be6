// Attention that reads K/V where they live in the paged pool: no per-step gather.
//
// One work item is one sequence's KV head and a tile of its new tokens. The query heads
// sharing that KV head are its rows (grouped-query attention folded, never expanded), so
// each K/V block is read once per tile and used by every row. A block's keys are
// transposed into a small buffer first, so that both products are vectorized broadcasts
// (scores over the block's keys, outputs over head_dim) rather than horizontal sums.
// Softmax is computed online (running max and sum), one block at a time, in float32
// whatever the storage dtype. Threads come from ATen's intra-op pool (torch's
// set_num_threads), so the kernel shares the linear layers' threads and never spins
// beside them.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kQueryTile = 16;  // new tokens per work item: bounds the row buffers
// Built with -ffast-math (vectorized exp), which assumes no infinities: a finite floor
// stands for "no score yet". Every row sees at least one key, so it is always replaced.
constexpr float kNoScore = -1e30f;

template <typename scalar_t>
void attend_tile(const scalar_t* q, int64_t q_token_stride, int64_t q_head_stride,
                 const scalar_t* pool, int64_t block_size, int64_t slot_stride,
                 int64_t kv_heads, int64_t head_dim, const int64_t* table,
                 int64_t first_position, int64_t num_queries, int64_t group, int64_t kv_head,
                 int64_t window, float scale, scalar_t* out, int64_t out_token_stride) {
  const int64_t rows = num_queries * group;
  std::vector<float> query(rows * head_dim), acc(rows * head_dim, 0.0f);
  std::vector<float> row_max(rows, kNoScore);
  std::vector<float> row_sum(rows, 0.0f);
  std::vector<float> keys_t(head_dim * block_size), values(block_size * head_dim);
  std::vector<float> scores(block_size);
  for (int64_t i = 0; i < num_queries; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const scalar_t* src = q + i * q_token_stride + (kv_head * group + g) * q_head_stride;
      float* dst = query.data() + (i * group + g) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * scale;
    }
  }
  const int64_t last_position = first_position + num_queries - 1;
  const int64_t lowest_key =
      window > 0 ? std::max<int64_t>(0, first_position - window + 1) : 0;
  for (int64_t block = lowest_key / block_size; block <= last_position / block_size; ++block) {
    const scalar_t* slots = pool + table[block] * block_size * slot_stride;
    for (int64_t j = 0; j < block_size; ++j) {
      const scalar_t* k = slots + j * slot_stride + kv_head * head_dim;
      const scalar_t* v = slots + j * slot_stride + (kv_heads + kv_head) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) {
        keys_t[d * block_size + j] = static_cast<float>(k[d]);
        values[j * head_dim + d] = static_cast<float>(v[d]);
      }
    }
    const int64_t block_start = block * block_size;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t position = first_position + r / group;
      // Keys this query may see in the block: [low, high).
      const int64_t low = std::max<int64_t>(0, window > 0 ? position - window + 1 - block_start : 0);
      const int64_t high = std::min<int64_t>(block_size, position + 1 - block_start);
      if (low >= high) continue;
      const float* qr = query.data() + r * head_dim;
      float* s = scores.data();
      for (int64_t j = 0; j < block_size; ++j) s[j] = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) {
        const float qd = qr[d];
        const float* kd = keys_t.data() + d * block_size;
#pragma omp simd
        for (int64_t j = 0; j < block_size; ++j) s[j] += qd * kd[j];
      }
      float block_max = kNoScore;
      for (int64_t j = low; j < high; ++j) block_max = std::max(block_max, s[j]);
      const float new_max = std::max(row_max[r], block_max);
      const float correction = std::exp(row_max[r] - new_max);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < block_size; ++j) {
        const float p = (j >= low && j < high) ? std::exp(s[j] - new_max) : 0.0f;
        s[j] = p;
        sum += p;
      }
      row_sum[r] = row_sum[r] * correction + sum;
      row_max[r] = new_max;
      float* a = acc.data() + r * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] *= correction;
      for (int64_t j = low; j < high; ++j) {
        const float p = s[j];
        const float* vj = values.data() + j * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vj[d];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inverse = 1.0f / row_sum[r];
    const float* a = acc.data() + r * head_dim;
    scalar_t* dst = out + (r / group) * out_token_stride + (kv_head * group + r % group) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(a[d] * inverse);
  }
}

// q: [T, heads, head_dim] (token and head strides free, dims contiguous);
// pool: [blocks, block_size, 2 * kv_heads, head_dim] contiguous, K heads then V heads;
// tables: [N, width] int64; sequences: [N, 3] int64 rows (start_pos, num_new, first token
// of the sequence in q). window <= 0: none. Returns [T, heads, head_dim] contiguous.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& tables,
                           const at::Tensor& sequences, int64_t window, double scale) {
  TORCH_CHECK(q.device().is_cpu() && pool.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, heads, head_dim], dims contiguous");
  TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous(), "pool must be contiguous 4-D");
  TORCH_CHECK(pool.scalar_type() == q.scalar_type(), "q and pool dtypes differ");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous(), "tables: int64");
  TORCH_CHECK(sequences.scalar_type() == at::kLong && sequences.is_contiguous() &&
                  sequences.dim() == 2 && sequences.size(1) == 3,
              "sequences: [N, 3] int64");
  const int64_t heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = pool.size(1), kv_heads = pool.size(2) / 2;
  TORCH_CHECK(pool.size(3) == head_dim && heads % kv_heads == 0, "head shapes disagree");
  const int64_t group = heads / kv_heads;
  const int64_t num_sequences = sequences.size(0), width = tables.size(1);
  auto out = at::empty({q.size(0), heads, head_dim}, q.options());
  const int64_t* seq = sequences.data_ptr<int64_t>();
  // Work items: (sequence, query tile, KV head), listed once so threads split them evenly.
  std::vector<int64_t> item_sequence, item_tile;
  for (int64_t n = 0; n < num_sequences; ++n) {
    TORCH_CHECK(seq[n * 3 + 1] > 0 && seq[n * 3] >= 0, "bad sequence row");
    TORCH_CHECK((seq[n * 3] + seq[n * 3 + 1] - 1) / block_size < width, "block table too short");
    for (int64_t t = 0; t < seq[n * 3 + 1]; t += kQueryTile) {
      item_sequence.push_back(n);
      item_tile.push_back(t);
    }
  }
  const int64_t num_items = static_cast<int64_t>(item_sequence.size()) * kv_heads;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    const scalar_t* q_data = q.data_ptr<scalar_t>();
    const scalar_t* pool_data = pool.data_ptr<scalar_t>();
    scalar_t* out_data = out.data_ptr<scalar_t>();
    const int64_t* table_data = tables.data_ptr<int64_t>();
    at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t pair = item / kv_heads, kv_head = item % kv_heads;
        const int64_t n = item_sequence[pair], tile = item_tile[pair];
        const int64_t start = seq[n * 3], num_new = seq[n * 3 + 1], first = seq[n * 3 + 2];
        const int64_t count = std::min(kQueryTile, num_new - tile);
        attend_tile<scalar_t>(q_data + (first + tile) * q.stride(0), q.stride(0), q.stride(1),
                              pool_data, block_size, pool.stride(1), kv_heads, head_dim,
                              table_data + n * width, start + tile, count, group, kv_head,
                              window, static_cast<float>(scale),
                              out_data + (first + tile) * heads * head_dim, heads * head_dim);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvserve_kernels, m) {
  m.def("paged_attention(Tensor q, Tensor pool, Tensor tables, Tensor sequences, int window, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_kernels, CPU, m) { m.impl("paged_attention", &paged_attention); }

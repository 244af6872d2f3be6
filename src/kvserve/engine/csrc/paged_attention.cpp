// Attention that reads K/V from the paged pool where they live: no per-step gather of
// each sequence's context into a fresh tensor.
//
// One work item is one sequence's KV head and a tile of its new tokens. The query heads
// sharing that KV head become the tile's rows (grouped-query attention folded, never
// expanded), so each K/V block is read once per tile and used by every row. Tiles of
// many rows (prefill) take keys a chunk of whole blocks at a time into a small float
// buffer that stays in cache, and both products run as BLAS GEMMs on it (scores = Q K^T,
// then out += P V); tiles of few rows (decodes) read each key and value straight from
// its slot. Softmax is online (running max and sum per row), in float32 whatever the storage
// dtype. Threads come from ATen's intra-op pool (torch.set_num_threads), the same threads
// the linear layers use, so nothing spins beside them.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// The BLAS torch itself links (MKL in its CPU wheels); column-major, Fortran calling.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);

namespace {

// Storage element to float. bf16 is the top half of a float: a shift the compiler
// vectorizes inside the dot products (c10's conversion operator is not vectorized there).
inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

constexpr int64_t kQueryTile = 32;   // new tokens per work item
constexpr int64_t kKeyChunk = 256;   // keys per GEMM (whole blocks; at least one block)
// Built with -ffast-math (vectorized exp), which assumes no infinities: a finite floor
// stands for "masked" and "no score yet". Every row sees at least one key.
constexpr float kMasked = -1e30f;

// Row-major out[rows][cols] = alpha * a[rows][inner] . b[cols][inner]^T + beta * out.
void gemm_abt(int64_t rows, int64_t cols, int64_t inner, const float* a, const float* b,
              float beta, float* out) {
  const int m = static_cast<int>(cols), n = static_cast<int>(rows), k = static_cast<int>(inner);
  const float alpha = 1.0f;
  sgemm_("T", "N", &m, &n, &k, &alpha, b, &k, a, &k, &beta, out, &m);
}

// Row-major out[rows][cols] += a[rows][inner] . b[inner][cols].
void gemm_ab_accumulate(int64_t rows, int64_t cols, int64_t inner, const float* a,
                        const float* b, float* out) {
  const int m = static_cast<int>(cols), n = static_cast<int>(rows), k = static_cast<int>(inner);
  const float alpha = 1.0f, beta = 1.0f;
  sgemm_("N", "N", &m, &n, &k, &alpha, b, &m, a, &k, &beta, out, &m);
}

// Few rows (decodes: one token, its group of query heads): GEMM calls and the tile copy
// cost more than they save, so scores and outputs are computed straight from the pool's
// slots, one block at a time, each key and value read once for all rows.
constexpr int64_t kMaxDirectRows = 8;

template <typename scalar_t>
void attend_rows_direct(const float* query, int64_t rows, int64_t group,
                        const scalar_t* pool, int64_t block_size, int64_t slot_stride,
                        int64_t kv_heads, int64_t head_dim, const int64_t* table,
                        int64_t first_position, int64_t kv_head, int64_t window,
                        float* acc, float* row_max, float* row_sum, float* scores) {
  const int64_t last_position = first_position + (rows - 1) / group;
  const int64_t lowest_key = window > 0 ? std::max<int64_t>(0, first_position - window + 1) : 0;
  for (int64_t block = lowest_key / block_size; block <= last_position / block_size; ++block) {
    const scalar_t* slots = pool + table[block] * block_size * slot_stride;
    const int64_t block_start = block * block_size;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t position = first_position + r / group;
      const int64_t low = std::max<int64_t>(0, (window > 0 ? position - window + 1 : 0) - block_start);
      const int64_t high = std::min<int64_t>(block_size, position + 1 - block_start);
      if (low >= high) continue;
      const float* qr = query + r * head_dim;
      float* s = scores + r * block_size;
      float block_max = kMasked;
      for (int64_t j = low; j < high; ++j) {
        const scalar_t* k = slots + j * slot_stride + kv_head * head_dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * to_float(k[d]);
        s[j] = dot;
        block_max = std::max(block_max, dot);
      }
      const float new_max = std::max(row_max[r], block_max);
      const float correction = std::exp(row_max[r] - new_max);
      float* a = acc + r * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] *= correction;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = low; j < high; ++j) {
        s[j] = std::exp(s[j] - new_max);
        sum += s[j];
      }
      for (int64_t j = low; j < high; ++j) {
        const float p = s[j];
        const scalar_t* v = slots + j * slot_stride + (kv_heads + kv_head) * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] += p * to_float(v[d]);
      }
      row_sum[r] = row_sum[r] * correction + sum;
      row_max[r] = new_max;
    }
  }
}

struct Buffers {
  std::vector<float> query, acc, row_max, row_sum, keys, values, scores;
};

// Many rows (prefill tiles): keys a chunk of whole blocks at a time into a float tile that
// stays in cache, both products as GEMMs on it.
template <typename scalar_t>
void attend_rows_gemm(int64_t rows, int64_t group, const scalar_t* pool, int64_t block_size,
                      int64_t slot_stride, int64_t kv_heads, int64_t head_dim,
                      const int64_t* table, int64_t first_position, int64_t kv_head,
                      int64_t window, Buffers& buf) {
  const int64_t chunk_blocks = std::max<int64_t>(1, kKeyChunk / block_size);
  buf.keys.resize(chunk_blocks * block_size * head_dim);
  buf.values.resize(chunk_blocks * block_size * head_dim);
  const int64_t num_queries = (rows - 1) / group + 1;
  const int64_t last_position = first_position + num_queries - 1;
  const int64_t lowest_key = window > 0 ? std::max<int64_t>(0, first_position - window + 1) : 0;
  const int64_t first_block = lowest_key / block_size, end_block = last_position / block_size + 1;
  for (int64_t chunk = first_block; chunk < end_block; chunk += chunk_blocks) {
    const int64_t blocks = std::min(chunk_blocks, end_block - chunk);
    const int64_t keys = blocks * block_size, key_start = chunk * block_size;
    for (int64_t b = 0; b < blocks; ++b) {
      const scalar_t* slots = pool + table[chunk + b] * block_size * slot_stride;
      for (int64_t j = 0; j < block_size; ++j) {
        const scalar_t* k = slots + j * slot_stride + kv_head * head_dim;
        const scalar_t* v = slots + j * slot_stride + (kv_heads + kv_head) * head_dim;
        float* kd = buf.keys.data() + (b * block_size + j) * head_dim;
        float* vd = buf.values.data() + (b * block_size + j) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) {
          kd[d] = to_float(k[d]);
          vd[d] = to_float(v[d]);
        }
      }
    }
    float* scores = buf.scores.data();
    gemm_abt(rows, keys, head_dim, buf.query.data(), buf.keys.data(), 0.0f, scores);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t position = first_position + r / group;
      // Keys of the chunk this row may see: [low, high).
      const int64_t low = std::max<int64_t>(0, (window > 0 ? position - window + 1 : 0) - key_start);
      const int64_t high = std::min<int64_t>(keys, position + 1 - key_start);
      float* s = scores + r * keys;
      if (low >= high) {  // nothing visible: contributes nothing to the P V product
        std::fill(s, s + keys, 0.0f);
        continue;
      }
      float chunk_max = kMasked;
      for (int64_t j = low; j < high; ++j) chunk_max = std::max(chunk_max, s[j]);
      const float new_max = std::max(buf.row_max[r], chunk_max);
      const float correction = std::exp(buf.row_max[r] - new_max);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < keys; ++j) {
        const float p = (j >= low && j < high) ? std::exp(s[j] - new_max) : 0.0f;
        s[j] = p;
        sum += p;
      }
      buf.row_sum[r] = buf.row_sum[r] * correction + sum;
      buf.row_max[r] = new_max;
      float* a = buf.acc.data() + r * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] *= correction;
    }
    gemm_ab_accumulate(rows, head_dim, keys, scores, buf.values.data(), buf.acc.data());
  }
}

template <typename scalar_t>
void attend_tile(const scalar_t* q, int64_t q_token_stride, int64_t q_head_stride,
                 const scalar_t* pool, int64_t block_size, int64_t slot_stride,
                 int64_t kv_heads, int64_t head_dim, const int64_t* table,
                 int64_t first_position, int64_t num_queries, int64_t group, int64_t kv_head,
                 int64_t window, float scale, scalar_t* out, int64_t out_token_stride,
                 Buffers& buf) {
  const int64_t rows = num_queries * group;
  const int64_t chunk_blocks = std::max<int64_t>(1, kKeyChunk / block_size);
  const int64_t chunk_keys = chunk_blocks * block_size;
  buf.query.resize(rows * head_dim);
  buf.acc.assign(rows * head_dim, 0.0f);
  buf.row_max.assign(rows, kMasked);
  buf.row_sum.assign(rows, 0.0f);
  buf.scores.resize(rows * std::max(chunk_keys, block_size));
  // Row r is query token r / group, head kv_head * group + r % group; scaled once here.
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* src = q + (r / group) * q_token_stride + (kv_head * group + r % group) * q_head_stride;
    float* dst = buf.query.data() + r * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = to_float(src[d]) * scale;
  }
  if (rows <= kMaxDirectRows) {
    attend_rows_direct<scalar_t>(buf.query.data(), rows, group, pool, block_size, slot_stride,
                                 kv_heads, head_dim, table, first_position, kv_head, window,
                                 buf.acc.data(), buf.row_max.data(), buf.row_sum.data(),
                                 buf.scores.data());
  } else {
    attend_rows_gemm<scalar_t>(rows, group, pool, block_size, slot_stride, kv_heads, head_dim,
                               table, first_position, kv_head, window, buf);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inverse = 1.0f / buf.row_sum[r];
    const float* a = buf.acc.data() + r * head_dim;
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
  const int64_t num_pairs = static_cast<int64_t>(item_sequence.size());
  const int64_t num_items = num_pairs * kv_heads;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    const scalar_t* q_data = q.data_ptr<scalar_t>();
    const scalar_t* pool_data = pool.data_ptr<scalar_t>();
    scalar_t* out_data = out.data_ptr<scalar_t>();
    const int64_t* table_data = tables.data_ptr<int64_t>();
    at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
      Buffers buffers;  // per thread: reused by all of its work items
      for (int64_t item = begin; item < end; ++item) {
        // Sequence-major: consecutive items read the other heads of the same slots, which
        // are then in cache (measured 2-4x faster than head-major, even with shared prefixes).
        const int64_t pair = item / kv_heads, kv_head = item % kv_heads;
        const int64_t n = item_sequence[pair], tile = item_tile[pair];
        const int64_t start = seq[n * 3], num_new = seq[n * 3 + 1], first = seq[n * 3 + 2];
        const int64_t count = std::min(kQueryTile, num_new - tile);
        attend_tile<scalar_t>(q_data + (first + tile) * q.stride(0), q.stride(0), q.stride(1),
                              pool_data, block_size, pool.stride(1), kv_heads, head_dim,
                              table_data + n * width, start + tile, count, group, kv_head,
                              window, static_cast<float>(scale),
                              out_data + (first + tile) * heads * head_dim, heads * head_dim,
                              buffers);
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

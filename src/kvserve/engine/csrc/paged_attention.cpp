// Attention that reads K/V from the paged pool where they live: no per-step gather of
// each sequence's context into a fresh tensor.
//
// A run of new tokens is split into work items of one KV head and a tile of tokens. The
// query heads sharing that KV head become the tile's rows (grouped-query attention folded,
// never expanded), so each K/V block is read once per tile and used by every row. Tiles of
// many rows (prefill) take keys a chunk of whole blocks at a time into a small float
// buffer that stays in cache, and both products run as GEMMs on it (scores = Q K^T,
// then out += P V); tiles of few rows read each key and value straight from its slot. A
// decode (one new token) is one item over all its heads, reading each slot whole. Sequences
// (decodes and prefill chunks alike) whose block tables start with the same blocks (a shared
// prompt prefix) read those blocks once for all their new tokens, as GEMMs over tiles of
// rows taken across the sequences, before each goes on over its own blocks (cascade
// attention: the prefix's softmax state is where each sequence's own pass starts).
// Softmax is online (running max and sum per row), in float32 whatever the storage dtype.
// Threads come from ATen's intra-op pool (torch.set_num_threads), the same threads
// the linear layers use, so nothing spins beside them.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <type_traits>
#include <utility>
#include <vector>

#include "convert.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#endif

namespace {

using kvserve::bf16_bits;
using kvserve::to_float;

// New tokens per work item: each key chunk a tile copies into its float buffers serves the
// tile's rows (tokens x the query heads of one KV head), so larger tiles copy less per
// product; 64 against 32 took a 1,088-token causal prefill's attention from 18.1 to 15.6
// ms on one core (docs/benchmarks.md); 128 was slower again (more masked keys on the
// diagonal).
constexpr int64_t kQueryTile = 64;
constexpr int64_t kKeyChunk = 256;   // keys per GEMM (whole blocks; at least one block)
// Built with -ffast-math (vectorized exp), which assumes no infinities: a finite floor
// stands for "masked" and "no score yet". Every row sees at least one key.
constexpr float kMasked = -1e30f;

#if defined(__AVX512F__)
// e^x for the softmax's x <= 0 (a score minus its row's running max), 16 lanes at a time:
// x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r keeps float precision), e^r by
// its Taylor series to r^6 (relative error below 2e-7, under two float ulps), scaled by
// 2^n. x is first raised to -86, whose e^x is still a normal float: the weights it gives
// (~1e-37 of the row's largest) vanish in float sums. glibc's vector expf (libmvec) took
// half the softmax's time in a prefill's attention; this one took the kernel's shared-
// prefix call from 24.9 to 23.3 ms and a 16-sequence decode from 0.73 to 0.62 ms.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-86.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln2's top bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);       // and the rest
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Lanes [0, count) of 16.
inline __mmask16 first_lanes(int64_t count) {
  return static_cast<__mmask16>((1u << count) - 1u);
}
#endif

// One step of the online softmax for one row: folds the scores s[low, high) of a new run of
// keys into the row's running max and sum, turning those scores into their (unnormalized)
// weights in place and rescaling the row's output accumulator acc[head_dim] to the new max.
// Scores outside [low, high) are left alone. Used by every path: per block by the direct
// ones, per key chunk by the GEMM one.
inline void online_softmax_step(float* s, int64_t low, int64_t high, float& row_max,
                                float& row_sum, float* acc, int64_t head_dim) {
  float step_max = kMasked;
  float sum = 0.0f;
#if defined(__AVX512F__)
  __m512 lanes_max = _mm512_set1_ps(kMasked);
  int64_t j = low;
  for (; j + 16 <= high; j += 16) lanes_max = _mm512_max_ps(lanes_max, _mm512_loadu_ps(s + j));
  if (j < high) {
    const __mmask16 tail = first_lanes(high - j);
    lanes_max = _mm512_mask_max_ps(lanes_max, tail, lanes_max, _mm512_maskz_loadu_ps(tail, s + j));
  }
  step_max = _mm512_reduce_max_ps(lanes_max);
  const float new_max = std::max(row_max, step_max);
  const __m512 shift = _mm512_set1_ps(new_max);
  __m512 lanes_sum = _mm512_setzero_ps();
  for (j = low; j + 16 <= high; j += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift));
    _mm512_storeu_ps(s + j, e);
    lanes_sum = _mm512_add_ps(lanes_sum, e);
  }
  if (j < high) {
    const __mmask16 tail = first_lanes(high - j);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), shift));
    _mm512_mask_storeu_ps(s + j, tail, e);
    lanes_sum = _mm512_mask_add_ps(lanes_sum, tail, lanes_sum, e);
  }
  sum = _mm512_reduce_add_ps(lanes_sum);
#else
  for (int64_t j = low; j < high; ++j) step_max = std::max(step_max, s[j]);
  const float new_max = std::max(row_max, step_max);
#pragma omp simd reduction(+ : sum)
  for (int64_t j = low; j < high; ++j) {
    s[j] = std::exp(s[j] - new_max);
    sum += s[j];
  }
#endif
  const float correction = std::exp(row_max - new_max);
#pragma omp simd
  for (int64_t d = 0; d < head_dim; ++d) acc[d] *= correction;
  row_sum = row_sum * correction + sum;
  row_max = new_max;
}

#if defined(__AVX512F__)
// On CPUs with AVX-512 the GEMMs are written out here instead of called from BLAS: torch's
// MKL runs these small shapes ([tile rows, 64] x [64, 256 keys] and back) at ~100 GFLOP/s
// on AMD's Zen (its AVX2 code path there), a register-blocked kernel at 200-250 on the same
// core (docs/benchmarks.md, "Attention's GEMMs written out"). Elsewhere BLAS stays.
typedef float Vec16 __attribute__((vector_size(64), aligned(4)));
constexpr int kBlockRows = 8;     // rows per register block: 8 x 2 accumulators of 16 floats
constexpr int kBlockVectors = 2;  // 32 columns per register block

// c[R][16 V] (+)= a[R][inner] . b[inner][16 V], all in registers.
template <int R, int V>
inline void gemm_block(int64_t inner, const float* a, int64_t lda, const float* b, int64_t ldb,
                       float* c, int64_t ldc, bool accumulate) {
  Vec16 acc[R][V];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v)
      acc[i][v] = accumulate ? *reinterpret_cast<const Vec16*>(c + i * ldc + 16 * v) : Vec16{};
  for (int64_t p = 0; p < inner; ++p) {
    Vec16 bv[V];
    for (int v = 0; v < V; ++v) bv[v] = *reinterpret_cast<const Vec16*>(b + p * ldb + 16 * v);
    for (int i = 0; i < R; ++i) {
      const float ai = a[i * lda + p];
      for (int v = 0; v < V; ++v) acc[i][v] += ai * bv[v];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v) *reinterpret_cast<Vec16*>(c + i * ldc + 16 * v) = acc[i][v];
}

template <int V>
void gemm_columns(int64_t rows, int64_t inner, const float* a, int64_t lda, const float* b,
                  int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  int64_t i = 0;
  for (; i + kBlockRows <= rows; i += kBlockRows)
    gemm_block<kBlockRows, V>(inner, a + i * lda, lda, b, ldb, c + i * ldc, ldc, accumulate);
  for (; i < rows; ++i) gemm_block<1, V>(inner, a + i * lda, lda, b, ldb, c + i * ldc, ldc, accumulate);
}

// Row-major c[rows][cols] (+)= a[rows][inner] . b[inner][cols].
void gemm_nn(int64_t rows, int64_t cols, int64_t inner, const float* a, int64_t lda,
             const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  int64_t j = 0;
  for (; j + 16 * kBlockVectors <= cols; j += 16 * kBlockVectors)
    gemm_columns<kBlockVectors>(rows, inner, a, lda, b + j, ldb, c + j, ldc, accumulate);
  for (; j + 16 <= cols; j += 16) gemm_columns<1>(rows, inner, a, lda, b + j, ldb, c + j, ldc, accumulate);
  for (; j < cols; ++j) {
    for (int64_t i = 0; i < rows; ++i) {
      float sum = accumulate ? c[i * ldc + j] : 0.0f;
      for (int64_t p = 0; p < inner; ++p) sum += a[i * lda + p] * b[p * ldb + j];
      c[i * ldc + j] = sum;
    }
  }
}
#else
}  // namespace
// The BLAS torch itself links (MKL in its CPU wheels); column-major, Fortran calling.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);

namespace {

// Row-major c[rows][cols] (+)= a[rows][inner] . b[inner][cols], by BLAS (column-major: c^T =
// b^T a^T).
void gemm_nn(int64_t rows, int64_t cols, int64_t inner, const float* a, int64_t lda,
             const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  const int m = static_cast<int>(cols), n = static_cast<int>(rows), k = static_cast<int>(inner);
  const int ld_b = static_cast<int>(ldb), ld_a = static_cast<int>(lda), ld_c = static_cast<int>(ldc);
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  sgemm_("N", "N", &m, &n, &k, &alpha, b, &ld_b, a, &ld_a, &beta, c, &ld_c);
}
#endif

#if defined(__AVX512BF16__)
// bf16 storage on CPUs with AVX512-BF16: both products of the GEMM path take bf16 operands
// in pairs (two neighbours along the inner dimension in one 32-bit word) into float32
// accumulators, one vdpbf16ps doing the work of two float FMAs, and the key and value tiles
// are copied as bf16 (half the bytes of the float tiles, no conversion). Scores are the exact
// products of the stored values, summed in float32; the softmax weights are rounded to bf16
// for the P V product, as torch's own CPU attention does in bf16.

// c[R][16 V] (+)= a[R][pairs] . b[pairs][16 V], all in registers.
template <int R, int V>
inline void gemm_block_bf16(int64_t pairs, const uint32_t* a, int64_t lda, const uint32_t* b,
                            int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  __m512 acc[R][V];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v)
      acc[i][v] = accumulate ? _mm512_loadu_ps(c + i * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh bv[V];
    for (int v = 0; v < V; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + p * ldb + 16 * v);
    for (int i = 0; i < R; ++i) {
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i * lda + p]));
      for (int v = 0; v < V; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], ai, bv[v]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(c + i * ldc + 16 * v, acc[i][v]);
}

template <int V>
void gemm_columns_bf16(int64_t rows, int64_t pairs, const uint32_t* a, int64_t lda,
                       const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  int64_t i = 0;
  for (; i + kBlockRows <= rows; i += kBlockRows)
    gemm_block_bf16<kBlockRows, V>(pairs, a + i * lda, lda, b, ldb, c + i * ldc, ldc, accumulate);
  for (; i < rows; ++i)
    gemm_block_bf16<1, V>(pairs, a + i * lda, lda, b, ldb, c + i * ldc, ldc, accumulate);
}

// The two bf16 values of a pair as floats (bf16 is a float's top half).
inline float low_half(uint32_t pair) {
  const uint32_t bits = pair << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}
inline float high_half(uint32_t pair) {
  const uint32_t bits = pair & 0xFFFF0000u;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// Row-major c[rows][cols] (+)= a[rows][2 pairs] . b[2 pairs][cols]: a's rows as words of
// two neighbours (lda in words), b as [pairs][cols] words of (row 2p, row 2p + 1).
void gemm_nn_bf16(int64_t rows, int64_t cols, int64_t pairs, const uint32_t* a, int64_t lda,
                  const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  int64_t j = 0;
  for (; j + 16 * kBlockVectors <= cols; j += 16 * kBlockVectors)
    gemm_columns_bf16<kBlockVectors>(rows, pairs, a, lda, b + j, ldb, c + j, ldc, accumulate);
  for (; j + 16 <= cols; j += 16)
    gemm_columns_bf16<1>(rows, pairs, a, lda, b + j, ldb, c + j, ldc, accumulate);
  for (; j < cols; ++j) {
    for (int64_t i = 0; i < rows; ++i) {
      float sum = accumulate ? c[i * ldc + j] : 0.0f;
      for (int64_t p = 0; p < pairs; ++p) {
        const uint32_t x = a[i * lda + p], y = b[p * ldb + j];
        sum += low_half(x) * low_half(y) + high_half(x) * high_half(y);
      }
      c[i * ldc + j] = sum;
    }
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// On CPUs with AMX (Sapphire Rapids and later) the bf16 products run on its tile unit: one
// tdpbf16ps multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 floats, 16 times
// the work of a vdpbf16ps. The operands are already in the layout it reads: a's rows as
// words of two neighbours along the inner dimension, b as [pairs][cols] words. vLLM's CPU
// attention takes this path for bf16 where AMX is there; without it kvserve's bf16
// shared-prefix rounds ran at 0.70x of vLLM's on such a CPU (docs/benchmarks.md).

// Linux hands out the tile state only to a process that asks for it (once; torch's oneDNN
// asks too when its own AMX kernels run). Off with KVSERVE_PAGED_AMX=0, to compare.
bool amx_ready() {
  static const bool ready = [] {
    const char* setting = std::getenv("KVSERVE_PAGED_AMX");
    if (setting != nullptr && std::strcmp(setting, "0") == 0) return false;
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ready;
}

constexpr int64_t kTile = 16;  // rows of every tile, and 16 words (64 bytes) per row

// The tile shapes of a work item's products, configured on its thread for as long as the
// item runs and released after it (oneDNN configures its own before each of its kernels):
// tiles 0-3 the 2 x 2 output block, 4-5 two row tiles of a, 6-7 two column tiles of b.
class TileScope {
 public:
  explicit TileScope(bool active) : active_(active) {
    if (!active) return;
    struct Config {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t colsb[16] = {};
      uint8_t rows[16] = {};
    } config;
    for (int t = 0; t < 8; ++t) {
      config.colsb[t] = kTile * 4;
      config.rows[t] = kTile;
    }
    _tile_loadconfig(&config);
  }
  ~TileScope() {
    if (active_) _tile_release();
  }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;

 private:
  bool active_;
};

// c[16 R][16 C] (+)= a[16 R][pairs] . b[pairs][16 C] on the tiles; pairs a multiple of 16.
template <int R, int C>
inline void amx_block(int64_t pairs, const uint32_t* a, int64_t lda, const uint32_t* b,
                      int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  const int64_t a_bytes = lda * 4, b_bytes = ldb * 4, c_bytes = ldc * 4;
  float* c1 = c + kTile;
  float* c2 = c + kTile * ldc;
  float* c3 = c2 + kTile;
  if (accumulate) {
    _tile_loadd(0, c, c_bytes);
    if constexpr (C == 2) _tile_loadd(1, c1, c_bytes);
    if constexpr (R == 2) _tile_loadd(2, c2, c_bytes);
    if constexpr (R == 2 && C == 2) _tile_loadd(3, c3, c_bytes);
  } else {
    _tile_zero(0);
    if constexpr (C == 2) _tile_zero(1);
    if constexpr (R == 2) _tile_zero(2);
    if constexpr (R == 2 && C == 2) _tile_zero(3);
  }
  for (int64_t p = 0; p < pairs; p += kTile) {
    _tile_loadd(4, a + p, a_bytes);
    if constexpr (R == 2) _tile_loadd(5, a + kTile * lda + p, a_bytes);
    _tile_loadd(6, b + p * ldb, b_bytes);
    if constexpr (C == 2) _tile_loadd(7, b + p * ldb + kTile, b_bytes);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (C == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (R == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (R == 2 && C == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, c_bytes);
  if constexpr (C == 2) _tile_stored(1, c1, c_bytes);
  if constexpr (R == 2) _tile_stored(2, c2, c_bytes);
  if constexpr (R == 2 && C == 2) _tile_stored(3, c3, c_bytes);
}

template <int R>
void amx_rows(int64_t cols, int64_t pairs, const uint32_t* a, int64_t lda, const uint32_t* b,
              int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  int64_t j = 0;
  for (; j + 2 * kTile <= cols; j += 2 * kTile)
    amx_block<R, 2>(pairs, a, lda, b + j, ldb, c + j, ldc, accumulate);
  if (j < cols) amx_block<R, 1>(pairs, a, lda, b + j, ldb, c + j, ldc, accumulate);
}

// gemm_nn_bf16 with its whole 16 x 16 tiles on AMX (pairs a multiple of 16, inside a
// TileScope) and the rows and columns past them on AVX512-BF16.
void gemm_nn_amx(int64_t rows, int64_t cols, int64_t pairs, const uint32_t* a, int64_t lda,
                 const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  const int64_t tiled_rows = rows / kTile * kTile, tiled_cols = cols / kTile * kTile;
  int64_t i = 0;
  for (; i + 2 * kTile <= tiled_rows; i += 2 * kTile)
    amx_rows<2>(tiled_cols, pairs, a + i * lda, lda, b, ldb, c + i * ldc, ldc, accumulate);
  if (i < tiled_rows)
    amx_rows<1>(tiled_cols, pairs, a + i * lda, lda, b, ldb, c + i * ldc, ldc, accumulate);
  if (tiled_cols < cols)
    gemm_nn_bf16(tiled_rows, cols - tiled_cols, pairs, a, lda, b + tiled_cols, ldb,
                 c + tiled_cols, ldc, accumulate);
  if (tiled_rows < rows)
    gemm_nn_bf16(rows - tiled_rows, cols, pairs, a + tiled_rows * lda, lda, b, ldb,
                 c + tiled_rows * ldc, ldc, accumulate);
}
#endif
#endif

// Few rows (a short run of new tokens, its groups of query heads): GEMM calls and the tile copy
// cost more than they save, so scores and outputs are computed straight from the pool's
// slots, one block at a time, each key and value read once for all rows.
constexpr int64_t kMaxDirectRows = 8;

template <typename scalar_t>
void attend_rows_direct(const float* query, int64_t rows, int64_t group,
                        const scalar_t* pool, int64_t block_size, int64_t slot_stride,
                        int64_t kv_heads, int64_t head_dim, const int64_t* table,
                        int64_t first_position, int64_t first_block, int64_t kv_head,
                        int64_t window, float* acc, float* row_max, float* row_sum,
                        float* scores) {
  const int64_t last_position = first_position + (rows - 1) / group;
  const int64_t lowest_key = window > 0 ? std::max<int64_t>(0, first_position - window + 1) : 0;
  for (int64_t block = std::max(first_block, lowest_key / block_size);
       block <= last_position / block_size; ++block) {
    const scalar_t* slots = pool + table[block] * block_size * slot_stride;
    const int64_t block_start = block * block_size;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t position = first_position + r / group;
      const int64_t low = std::max<int64_t>(0, (window > 0 ? position - window + 1 : 0) - block_start);
      const int64_t high = std::min<int64_t>(block_size, position + 1 - block_start);
      if (low >= high) continue;
      const float* qr = query + r * head_dim;
      float* s = scores + r * block_size;
      for (int64_t j = low; j < high; ++j) {
        const scalar_t* k = slots + j * slot_stride + kv_head * head_dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * to_float(k[d]);
        s[j] = dot;
      }
      float* a = acc + r * head_dim;
      online_softmax_step(s, low, high, row_max[r], row_sum[r], a, head_dim);
      for (int64_t j = low; j < high; ++j) {
        const float p = s[j];
        const scalar_t* v = slots + j * slot_stride + (kv_heads + kv_head) * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] += p * to_float(v[d]);
      }
    }
  }
}

struct Buffers {
  std::vector<float> query, acc, row_max, row_sum, keys, values, scores;
  // The bf16 GEMM path's operands, as words of two bf16 values.
  std::vector<uint32_t> query_pairs, key_pairs, value_pairs, score_pairs;
};

// One chunk's scores [rows][keys] (keys from key_start) turned into softmax weights in place
// (0 where a row may not look), folding the chunk into each row's running max, sum and
// rescaled output accumulator.
template <typename Visible>
void online_softmax_chunk(int64_t rows, int64_t keys, int64_t key_start, int64_t head_dim,
                          const Visible& visible, float* scores, Buffers& buf) {
  for (int64_t r = 0; r < rows; ++r) {
    const auto [low, high] = visible(r, key_start, keys);
    float* s = scores + r * keys;
    if (low >= high) {  // nothing visible: contributes nothing to the P V product
      std::fill(s, s + keys, 0.0f);
      continue;
    }
    // The P V product runs over the whole chunk: keys the row may not see weigh 0.
    std::fill(s, s + low, 0.0f);
    std::fill(s + high, s + keys, 0.0f);
    online_softmax_step(s, low, high, buf.row_max[r], buf.row_sum[r],
                        buf.acc.data() + r * head_dim, head_dim);
  }
}

#if defined(__AVX512BF16__)
// dst[w * ld + j] = word w of rows[j] + offset (16-bit units) for 16 rows and 16 words: the
// 16 x 16 block of 32-bit words transposed in registers (pairs of lanes, then quads, then
// 128-bit lanes, then halves). Against the word-by-word copy, with AMX: a 1,088-token causal
// prompt's attention 13.6 -> 12.4-13.2 ms and 16 x 256-token prompts' 20.6-21.2 -> 19.6-19.7
// on one core (docs/benchmarks.md).
inline void transpose_words16(const uint16_t* const* rows, int64_t offset, uint32_t* dst,
                              int64_t ld) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows[i] + offset);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4q + k] now holds, in its 128-bit lane L, word 4L + k of rows 4q..4q+3.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);            // lanes 0, 2 of each
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);        // lanes 1, 3 of each
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);        // words i, rows 0..15
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);    // words 8 + i
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);   // words 4 + i
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);  // words 12 + i
  }
  for (int w = 0; w < 16; ++w) _mm512_storeu_si512(dst + w * ld, r[w]);
}

// attend_rows_gemm on bf16 pairs (head_dim and block_size even). buf.query holds the query
// times `scale`; dividing it out gives back the stored bf16 values exactly (float32's
// rounding error is far below half a bf16 step), and the scores are scaled instead.
template <typename Visible>
void attend_rows_gemm_bf16(int64_t rows, const c10::BFloat16* pool, int64_t block_size,
                           int64_t slot_stride, int64_t kv_heads, int64_t head_dim,
                           const int64_t* table, int64_t first_block, int64_t end_block,
                           int64_t kv_head, const Visible& visible, float scale, Buffers& buf) {
  const int64_t chunk_blocks = std::max<int64_t>(1, kKeyChunk / block_size);
  const int64_t chunk_keys = chunk_blocks * block_size, pairs = head_dim / 2;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  // AMX's inner dimension goes 16 pairs at a time: Q K^T's is the head's (64 and 128 fit),
  // P V's the chunk's keys, padded with zero weights and values to a multiple of 16 pairs.
  const bool amx = rows >= kTile && pairs % kTile == 0 && amx_ready();
  const TileScope tiles(amx);
  const auto product = amx ? gemm_nn_amx : gemm_nn_bf16;
  const auto padded = [amx](int64_t n) { return amx ? (n + kTile - 1) / kTile * kTile : n; };
#else
  const auto product = gemm_nn_bf16;
  const auto padded = [](int64_t n) { return n; };
#endif
  buf.query_pairs.resize(rows * pairs);
  buf.key_pairs.resize(pairs * chunk_keys);
  buf.value_pairs.resize(padded(chunk_keys / 2) * head_dim);
  buf.score_pairs.resize(rows * padded(chunk_keys / 2));
  uint16_t* query16 = reinterpret_cast<uint16_t*>(buf.query_pairs.data());
  const float inverse_scale = 1.0f / scale;
  for (int64_t i = 0; i < rows * head_dim; ++i) query16[i] = bf16_bits(buf.query[i] * inverse_scale);
  const uint16_t* pool16 = reinterpret_cast<const uint16_t*>(pool);
  std::vector<const uint16_t*> key_rows(chunk_keys), value_rows(chunk_keys);
  for (int64_t chunk = first_block; chunk < end_block; chunk += chunk_blocks) {
    const int64_t blocks = std::min(chunk_blocks, end_block - chunk);
    const int64_t keys = blocks * block_size, key_start = chunk * block_size;
    const int64_t weight_pairs = padded(keys / 2);
    for (int64_t b = 0; b < blocks; ++b) {
      const uint16_t* slots = pool16 + table[chunk + b] * block_size * slot_stride;
      for (int64_t j = 0; j < block_size; ++j) {
        key_rows[b * block_size + j] = slots + j * slot_stride + kv_head * head_dim;
        value_rows[b * block_size + j] = slots + j * slot_stride + (kv_heads + kv_head) * head_dim;
      }
    }
    // Values as [keys / 2][head_dim] words of (key 2j's value, key 2j + 1's).
    for (int64_t j = 0; j < keys / 2; ++j) {
      const uint16_t* even = value_rows[2 * j];
      const uint16_t* odd = value_rows[2 * j + 1];
      uint32_t* vd = buf.value_pairs.data() + j * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d)
        vd[d] = static_cast<uint32_t>(even[d]) | (static_cast<uint32_t>(odd[d]) << 16);
    }
    std::fill(buf.value_pairs.data() + keys / 2 * head_dim,
              buf.value_pairs.data() + weight_pairs * head_dim, 0u);
    // Keys transposed as [pairs][keys] words, 16 keys at a time (as the float tile): 16 x 16
    // words in registers where both fit, word by word at the edges.
    for (int64_t first = 0; first < keys; first += 16) {
      const int64_t group = std::min<int64_t>(16, keys - first);
      int64_t p = 0;
      if (group == 16)
        for (; p + 16 <= pairs; p += 16)
          transpose_words16(key_rows.data() + first, 2 * p, buf.key_pairs.data() + p * keys + first,
                            keys);
      for (; p < pairs; ++p) {
        uint32_t* kd = buf.key_pairs.data() + p * keys + first;
        for (int64_t j = 0; j < group; ++j) std::memcpy(kd + j, key_rows[first + j] + 2 * p, 4);
      }
    }
    float* scores = buf.scores.data();
    product(rows, keys, pairs, buf.query_pairs.data(), pairs, buf.key_pairs.data(), keys,
            scores, keys, false);
#pragma omp simd
    for (int64_t i = 0; i < rows * keys; ++i) scores[i] *= scale;
    online_softmax_chunk(rows, keys, key_start, head_dim, visible, scores, buf);
    for (int64_t r = 0; r < rows; ++r) {
      uint16_t* weights16 = reinterpret_cast<uint16_t*>(buf.score_pairs.data() + r * weight_pairs);
      const float* s = scores + r * keys;
#pragma omp simd
      for (int64_t j = 0; j < keys; ++j) weights16[j] = bf16_bits(s[j]);
      std::fill(weights16 + keys, weights16 + 2 * weight_pairs, uint16_t{0});
    }
    product(rows, head_dim, weight_pairs, buf.score_pairs.data(), weight_pairs,
            buf.value_pairs.data(), head_dim, buf.acc.data(), head_dim, true);
  }
}
#endif

// The key tile's transposition, 8 keys x 8 dimensions at a time in registers: each key's 8
// values loaded as one vector, the 8 x 8 block transposed by shuffles (GCC's generic
// vectors: AVX2 or AVX-512 instructions, whichever the build targets), each dimension's 8
// keys stored as one vector. One element at a time, the copy was a load and a store per
// float. A group's last keys (fewer than 8) and dimensions past the last multiple of 8 go
// element by element.
typedef float Vec8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t Lanes8 __attribute__((vector_size(32)));

template <typename scalar_t>
inline Vec8 load8(const scalar_t* src) {
  Vec8 v;
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(&v, src, sizeof v);
  } else {
    for (int i = 0; i < 8; ++i) v[i] = to_float(src[i]);
  }
  return v;
}

// out[i] = column i of the 8 x 8 block whose rows are r[0..7].
inline void transpose8(const Vec8 (&r)[8], Vec8 (&out)[8]) {
  const Lanes8 low{0, 8, 1, 9, 4, 12, 5, 13}, high{2, 10, 3, 11, 6, 14, 7, 15};
  const Lanes8 low_pairs{0, 1, 8, 9, 4, 5, 12, 13}, high_pairs{2, 3, 10, 11, 6, 7, 14, 15};
  const Lanes8 low_halves{0, 1, 2, 3, 8, 9, 10, 11}, high_halves{4, 5, 6, 7, 12, 13, 14, 15};
  Vec8 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = __builtin_shuffle(r[i], r[i + 1], low);       // rows i, i+1: columns 0 1 | 4 5
    t[i + 1] = __builtin_shuffle(r[i], r[i + 1], high);  // columns 2 3 | 6 7
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = __builtin_shuffle(t[i], t[i + 2], low_pairs);  // rows i..i+3: column 0 | 4
    u[i + 1] = __builtin_shuffle(t[i], t[i + 2], high_pairs);      // column 1 | 5
    u[i + 2] = __builtin_shuffle(t[i + 1], t[i + 3], low_pairs);   // column 2 | 6
    u[i + 3] = __builtin_shuffle(t[i + 1], t[i + 3], high_pairs);  // column 3 | 7
  }
  for (int k = 0; k < 4; ++k) {
    out[k] = __builtin_shuffle(u[k], u[k + 4], low_halves);
    out[k + 4] = __builtin_shuffle(u[k], u[k + 4], high_halves);
  }
}

// dst[d * ld + j] = rows[j][d] for `count` keys (at most 16) and head_dim dimensions.
template <typename scalar_t>
inline void transpose_keys(const scalar_t* const* rows, int64_t count, int64_t head_dim,
                           float* dst, int64_t ld) {
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    int64_t d = 0;
    for (; d + 8 <= head_dim; d += 8) {
      Vec8 r[8], columns[8];
      for (int i = 0; i < 8; ++i) r[i] = load8(rows[j + i] + d);
      transpose8(r, columns);
      for (int i = 0; i < 8; ++i) std::memcpy(dst + (d + i) * ld + j, &columns[i], sizeof(Vec8));
    }
    for (; d < head_dim; ++d)
      for (int64_t i = 0; i < 8; ++i) dst[d * ld + j + i] = to_float(rows[j + i][d]);
  }
  if (j < count)
    for (int64_t d = 0; d < head_dim; ++d)
      for (int64_t i = j; i < count; ++i) dst[d * ld + i] = to_float(rows[i][d]);
}

// Many rows (prefill tiles, shared prefixes): keys a chunk of whole blocks at a time into a
// float tile that stays in cache, both products as GEMMs on it. Blocks [first_block,
// end_block) of `table`; visible(r, key_start, keys) gives the chunk's keys [low, high)
// that row r may see. buf.query holds the rows' queries times `scale`.
template <typename scalar_t, typename Visible>
void attend_rows_gemm(int64_t rows, const scalar_t* pool, int64_t block_size,
                      int64_t slot_stride, int64_t kv_heads, int64_t head_dim,
                      const int64_t* table, int64_t first_block, int64_t end_block,
                      int64_t kv_head, const Visible& visible, float scale, Buffers& buf) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (head_dim % 2 == 0 && block_size % 2 == 0) {
      attend_rows_gemm_bf16(rows, pool, block_size, slot_stride, kv_heads, head_dim, table,
                            first_block, end_block, kv_head, visible, scale, buf);
      return;
    }
  }
#endif
  const int64_t chunk_blocks = std::max<int64_t>(1, kKeyChunk / block_size);
  buf.keys.resize(chunk_blocks * block_size * head_dim);
  buf.values.resize(chunk_blocks * block_size * head_dim);
  std::vector<const scalar_t*> key_rows(chunk_blocks * block_size);
  for (int64_t chunk = first_block; chunk < end_block; chunk += chunk_blocks) {
    const int64_t blocks = std::min(chunk_blocks, end_block - chunk);
    const int64_t keys = blocks * block_size, key_start = chunk * block_size;
    for (int64_t b = 0; b < blocks; ++b) {
      const scalar_t* slots = pool + table[chunk + b] * block_size * slot_stride;
      for (int64_t j = 0; j < block_size; ++j) {
        const scalar_t* v = slots + j * slot_stride + (kv_heads + kv_head) * head_dim;
        key_rows[b * block_size + j] = slots + j * slot_stride + kv_head * head_dim;
        float* vd = buf.values.data() + (b * block_size + j) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) vd[d] = to_float(v[d]);
      }
    }
    // Keys transposed ([head_dim][keys]) so both products are plain A . B GEMMs; 16 keys
    // at a time, so their rows stay in L1 while each dimension's 16 values are written as
    // one cache line (a key at a time wrote head_dim lines per key).
    for (int64_t first = 0; first < keys; first += 16) {
      const int64_t group = std::min<int64_t>(16, keys - first);
      transpose_keys(key_rows.data() + first, group, head_dim, buf.keys.data() + first, keys);
    }
    float* scores = buf.scores.data();
    gemm_nn(rows, keys, head_dim, buf.query.data(), head_dim, buf.keys.data(), keys, scores, keys,
            false);
    online_softmax_chunk(rows, keys, key_start, head_dim, visible, scores, buf);
    gemm_nn(rows, head_dim, keys, scores, keys, buf.values.data(), head_dim, buf.acc.data(),
            head_dim, true);
  }
}

// Per new token and query head, the softmax state after a shared prefix: the unnormalized
// output, then the running max and sum (kStateExtra floats).
constexpr int64_t kStateExtra = 2;
// Rows per shared-prefix work item: enough that each converted key chunk serves many rows,
// few enough that the scores ([rows, kKeyChunk] floats) stay in L2.
constexpr int64_t kPrefixRows = 256;

// A shared prefix ("cascade" attention): sequences whose block tables start with the same
// `blocks` blocks, every key of which all their new tokens see. One work item per (prefix,
// KV head, tile of the prefix's new tokens) reads each of those blocks once for all the
// tile's query rows (token-major, then the heads of the group), whichever sequences the
// tokens belong to, as GEMMs, and leaves each row's state in `states` ([T, heads, head_dim +
// kStateExtra]); each sequence's own items go on from there.
template <typename scalar_t>
void attend_shared_prefix(const int64_t* tokens, int64_t num_tokens, int64_t blocks,
                          const scalar_t* q, int64_t q_token_stride, int64_t q_head_stride,
                          const scalar_t* pool, int64_t block_size, int64_t slot_stride,
                          int64_t kv_heads, int64_t head_dim, const int64_t* table,
                          int64_t group, int64_t kv_head, float scale, float* states,
                          Buffers& buf) {
  const int64_t rows = num_tokens * group;
  const int64_t chunk_blocks = std::max<int64_t>(1, kKeyChunk / block_size);
  buf.query.resize(rows * head_dim);
  buf.acc.assign(rows * head_dim, 0.0f);
  buf.row_max.assign(rows, kMasked);
  buf.row_sum.assign(rows, 0.0f);
  buf.scores.resize(rows * chunk_blocks * block_size);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = kv_head * group + r % group;
    const scalar_t* src = q + tokens[r / group] * q_token_stride + head * q_head_stride;
    float* dst = buf.query.data() + r * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = to_float(src[d]) * scale;
  }
  const auto all_visible = [](int64_t, int64_t, int64_t keys) {
    return std::pair<int64_t, int64_t>(0, keys);
  };
  attend_rows_gemm<scalar_t>(rows, pool, block_size, slot_stride, kv_heads, head_dim, table, 0,
                             blocks, kv_head, all_visible, scale, buf);
  const int64_t heads = kv_heads * group, state_size = head_dim + kStateExtra;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = kv_head * group + r % group;
    float* state = states + (tokens[r / group] * heads + head) * state_size;
    std::copy_n(buf.acc.data() + r * head_dim, head_dim, state);
    state[head_dim] = buf.row_max[r];
    state[head_dim + 1] = buf.row_sum[r];
  }
}

constexpr int64_t kPrefetchSlots = 2;

// One decode (a single new token at `position`), all its heads in one work item: the
// slots are walked in order, each slot's K (then V) heads read in one contiguous run for
// every query head, where a per-KV-head item would touch each slot's page once per head.
// `state`: the softmax state after a shared prefix ([heads, head_dim + kStateExtra]) and
// the blocks it covered, or null and 0.
template <typename scalar_t, int64_t kHeadDim>
void attend_decode(const scalar_t* q, int64_t q_head_stride, const scalar_t* pool,
                   int64_t block_size, int64_t slot_stride, int64_t kv_heads, int64_t dynamic_dim,
                   const int64_t* table, int64_t position, int64_t group, int64_t window,
                   float scale, scalar_t* out, const float* state, int64_t state_blocks,
                   Buffers& buf) {
  // A compile-time head size (the common ones) lets the dot products unroll fully.
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : dynamic_dim;
  const int64_t heads = kv_heads * group;
  buf.query.resize(heads * head_dim);
  buf.acc.assign(heads * head_dim, 0.0f);
  buf.row_max.assign(heads, kMasked);
  buf.row_sum.assign(heads, 0.0f);
  buf.scores.resize(heads * block_size);
  for (int64_t h = 0; h < heads; ++h) {
    const scalar_t* src = q + h * q_head_stride;
    float* dst = buf.query.data() + h * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = to_float(src[d]) * scale;
    if (state != nullptr) {
      const float* own = state + h * (head_dim + kStateExtra);
      std::copy_n(own, head_dim, buf.acc.data() + h * head_dim);
      buf.row_max[h] = own[head_dim];
      buf.row_sum[h] = own[head_dim + 1];
    }
  }
  const int64_t lowest_key = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
  float* scores = buf.scores.data();
  const int64_t last_block = position / block_size;
  const int64_t slot_bytes = slot_stride * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t block = std::max(state_blocks, lowest_key / block_size); block <= last_block;
       ++block) {
    const scalar_t* slots = pool + table[block] * block_size * slot_stride;
    const scalar_t* next_slots =
        block < last_block ? pool + table[block + 1] * block_size * slot_stride : nullptr;
    const int64_t block_start = block * block_size;
    const int64_t low = std::max<int64_t>(0, lowest_key - block_start);
    const int64_t high = std::min<int64_t>(block_size, position + 1 - block_start);
    for (int64_t j = low; j < high; ++j) {
      const scalar_t* slot = slots + j * slot_stride;
      // One core's bandwidth is bounded by its outstanding misses, and each slot starts a
      // new page where the hardware prefetcher stops: ask for the slot after next now.
      const int64_t ahead = j + kPrefetchSlots;
      const char* upcoming = reinterpret_cast<const char*>(
          ahead < block_size ? slots + ahead * slot_stride
          : next_slots != nullptr ? next_slots + (ahead - block_size) * slot_stride
                                  : nullptr);
      if (upcoming != nullptr)
        for (int64_t byte = 0; byte < slot_bytes; byte += 64) __builtin_prefetch(upcoming + byte);
      for (int64_t h = 0; h < heads; ++h) {
        const float* qh = buf.query.data() + h * head_dim;
        const scalar_t* k = slot + (h / group) * head_dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * to_float(k[d]);
        scores[h * block_size + j] = dot;
      }
    }
    for (int64_t h = 0; h < heads; ++h)
      online_softmax_step(scores + h * block_size, low, high, buf.row_max[h], buf.row_sum[h],
                          buf.acc.data() + h * head_dim, head_dim);
    for (int64_t j = low; j < high; ++j) {
      const scalar_t* values = slots + j * slot_stride + kv_heads * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        const float p = scores[h * block_size + j];
        const scalar_t* v = values + (h / group) * head_dim;
        float* a = buf.acc.data() + h * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] += p * to_float(v[d]);
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inverse = 1.0f / buf.row_sum[h];
    const float* a = buf.acc.data() + h * head_dim;
    scalar_t* dst = out + h * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(a[d] * inverse);
  }
}

#if defined(__AVX512F__)
// Sixteen lanes of a stored head as floats (a bf16 is a float's top half: a shift).
inline __m512 load16(const float* src) { return _mm512_loadu_ps(src); }
inline __m512 load16(const c10::BFloat16* src) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Lane j of the result: the sum of v[j]'s sixteen lanes. A tree of shuffles that halves the
// vectors at each level (46 instructions), where sixteen separate reductions take about
// 130: a decode's dot products, one per (slot, query head), are each reduced across lanes.
inline __m512 lane_sums16(const __m512 (&v)[16]) {
  __m512 halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i)  // 128-bit lanes 0-1 partials of v[2i], 2-3 of v[2i + 1]
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane m: four partials of v[4i + m]
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // lane m: two partials of v[8i + m], two of v[8i + 4 + m]
    eighths[i] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0x44),
                               _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0xEE));
  // Lane 4m + e: the sum of v[4e + m]; put lane j's sum at j.
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(eighths[0], eighths[1], 0x88),
                                    _mm512_shuffle_ps(eighths[0], eighths[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}

// One query head's dot product with one slot's key, left as sixteen partial sums. In bf16
// (on CPUs with AVX512-BF16) the query stays in bf16 as words of two neighbours and each
// product of two bf16 values is exact in float32, so the result differs from converting
// both sides first only in the order of the sums; the scale is applied to the scores.
template <int64_t kHeadDim>
inline __m512 partial_dot(const float* query, const float* key) {
  __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(query), _mm512_loadu_ps(key));
  for (int64_t i = 16; i < kHeadDim; i += 16)
    sum = _mm512_fmadd_ps(_mm512_loadu_ps(query + i), _mm512_loadu_ps(key + i), sum);
  return sum;
}
#if defined(__AVX512BF16__)
template <int64_t kHeadDim>
inline __m512 partial_dot(const uint32_t* query, const c10::BFloat16* key) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < kHeadDim; i += 32)
    sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(query + i / 2),
                           (__m512bh)_mm512_loadu_si512(key + i));
  return sum;
}
#endif

// The decode of attend_decode below, written out for AVX-512 where the head size is a
// multiple of 32: per slot each query head's product is left as sixteen partial sums, and
// each 16 slots' sums are reduced together (lane_sums16); the values are converted once
// for the up to kRows query heads of a KV head that take them, with those heads' outputs
// in registers across the block's slots.
template <typename scalar_t, int64_t kHeadDim>
void attend_decode_vectors(const scalar_t* q, int64_t q_head_stride, const scalar_t* pool,
                           int64_t block_size, int64_t slot_stride, int64_t kv_heads,
                           const int64_t* table, int64_t position, int64_t group,
                           int64_t window, float scale, scalar_t* out, const float* state,
                           int64_t state_blocks, Buffers& buf) {
  constexpr int64_t kVectors = kHeadDim / 16;
  constexpr int64_t kRows = std::max<int64_t>(1, 16 / kVectors);  // 16 accumulators
#if defined(__AVX512BF16__)
  constexpr bool kPairs = std::is_same_v<scalar_t, c10::BFloat16>;
#else
  constexpr bool kPairs = false;
#endif
  const int64_t heads = kv_heads * group;
  buf.query.resize(heads * kHeadDim);
  buf.query_pairs.resize(heads * kHeadDim / 2);
  buf.acc.assign(heads * kHeadDim, 0.0f);
  buf.row_max.assign(heads, kMasked);
  buf.row_sum.assign(heads, 0.0f);
  buf.scores.resize(heads * block_size);
  buf.keys.assign(heads * 16 * 16, 0.0f);  // per head: 16 slots' partial sums
  for (int64_t h = 0; h < heads; ++h) {
    const scalar_t* src = q + h * q_head_stride;
    if constexpr (kPairs)
      std::memcpy(buf.query_pairs.data() + h * kHeadDim / 2, src, kHeadDim * sizeof(scalar_t));
    else
      for (int64_t d = 0; d < kHeadDim; ++d) buf.query[h * kHeadDim + d] = to_float(src[d]) * scale;
    if (state != nullptr) {
      const float* own = state + h * (kHeadDim + kStateExtra);
      std::copy_n(own, kHeadDim, buf.acc.data() + h * kHeadDim);
      buf.row_max[h] = own[kHeadDim];
      buf.row_sum[h] = own[kHeadDim + 1];
    }
  }
  const __m512 score_scale = _mm512_set1_ps(kPairs ? scale : 1.0f);
  const int64_t lowest_key = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
  float* scores = buf.scores.data();
  float* partials = buf.keys.data();
  const int64_t last_block = position / block_size;
  const int64_t slot_bytes = slot_stride * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t block = std::max(state_blocks, lowest_key / block_size); block <= last_block;
       ++block) {
    const scalar_t* slots = pool + table[block] * block_size * slot_stride;
    const scalar_t* next_slots =
        block < last_block ? pool + table[block + 1] * block_size * slot_stride : nullptr;
    const int64_t block_start = block * block_size;
    const int64_t low = std::max<int64_t>(0, lowest_key - block_start);
    const int64_t high = std::min<int64_t>(block_size, position + 1 - block_start);
    for (int64_t first = low; first < high; first += 16) {
      const int64_t count = std::min<int64_t>(16, high - first);
      for (int64_t j = first; j < first + count; ++j) {
        const scalar_t* slot = slots + j * slot_stride;
        const int64_t ahead = j + kPrefetchSlots;
        const char* upcoming = reinterpret_cast<const char*>(
            ahead < block_size ? slots + ahead * slot_stride
            : next_slots != nullptr ? next_slots + (ahead - block_size) * slot_stride
                                    : nullptr);
        if (upcoming != nullptr)
          for (int64_t byte = 0; byte < slot_bytes; byte += 64) __builtin_prefetch(upcoming + byte);
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* key = slot + (h / group) * kHeadDim;
          __m512 partial;
          if constexpr (kPairs)
            partial = partial_dot<kHeadDim>(buf.query_pairs.data() + h * kHeadDim / 2, key);
          else
            partial = partial_dot<kHeadDim>(buf.query.data() + h * kHeadDim, key);
          _mm512_storeu_ps(partials + (h * 16 + j - first) * 16, partial);
        }
      }
      const __mmask16 lanes = first_lanes(count);
      for (int64_t h = 0; h < heads; ++h) {
        __m512 v[16];
        for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_ps(partials + (h * 16 + i) * 16);
        _mm512_mask_storeu_ps(scores + h * block_size + first, lanes,
                              _mm512_mul_ps(lane_sums16(v), score_scale));
      }
    }
    for (int64_t h = 0; h < heads; ++h)
      online_softmax_step(scores + h * block_size, low, high, buf.row_max[h], buf.row_sum[h],
                          buf.acc.data() + h * kHeadDim, kHeadDim);
    for (int64_t kv_head = 0; kv_head < kv_heads; ++kv_head) {
      for (int64_t first_row = 0; first_row < group; first_row += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, group - first_row);
        const int64_t head = kv_head * group + first_row;
        __m512 acc[kRows][kVectors];
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t i = 0; i < kVectors; ++i)
            acc[r][i] = _mm512_loadu_ps(buf.acc.data() + (head + r) * kHeadDim + 16 * i);
        for (int64_t j = low; j < high; ++j) {
          const scalar_t* value = slots + j * slot_stride + (kv_heads + kv_head) * kHeadDim;
          __m512 v[kVectors];
          for (int64_t i = 0; i < kVectors; ++i) v[i] = load16(value + 16 * i);
          for (int64_t r = 0; r < rows; ++r) {
            const __m512 weight = _mm512_set1_ps(scores[(head + r) * block_size + j]);
            for (int64_t i = 0; i < kVectors; ++i) acc[r][i] = _mm512_fmadd_ps(weight, v[i], acc[r][i]);
          }
        }
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t i = 0; i < kVectors; ++i)
            _mm512_storeu_ps(buf.acc.data() + (head + r) * kHeadDim + 16 * i, acc[r][i]);
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inverse = 1.0f / buf.row_sum[h];
    const float* a = buf.acc.data() + h * kHeadDim;
    scalar_t* dst = out + h * kHeadDim;
    for (int64_t d = 0; d < kHeadDim; ++d) dst[d] = static_cast<scalar_t>(a[d] * inverse);
  }
}
#endif

template <typename scalar_t>
void attend_tile(const scalar_t* q, int64_t q_token_stride, int64_t q_head_stride,
                 const scalar_t* pool, int64_t block_size, int64_t slot_stride,
                 int64_t kv_heads, int64_t head_dim, const int64_t* table,
                 int64_t first_position, int64_t num_queries, int64_t group, int64_t kv_head,
                 int64_t window, float scale, scalar_t* out, int64_t out_token_stride,
                 const float* state, int64_t state_blocks, Buffers& buf) {
  const int64_t rows = num_queries * group;
  const int64_t chunk_blocks = std::max<int64_t>(1, kKeyChunk / block_size);
  const int64_t chunk_keys = chunk_blocks * block_size;
  buf.query.resize(rows * head_dim);
  buf.acc.assign(rows * head_dim, 0.0f);
  buf.row_max.assign(rows, kMasked);
  buf.row_sum.assign(rows, 0.0f);
  buf.scores.resize(rows * std::max(chunk_keys, block_size));
  // Row r is query token r / group, head kv_head * group + r % group; scaled once here.
  // `state`: the tile's first token's softmax states after a shared prefix ([tokens, heads,
  // head_dim + kStateExtra]) covering `state_blocks` blocks, or null and 0.
  const int64_t heads = kv_heads * group;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = kv_head * group + r % group;
    const scalar_t* src = q + (r / group) * q_token_stride + head * q_head_stride;
    float* dst = buf.query.data() + r * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = to_float(src[d]) * scale;
    if (state != nullptr) {
      const float* own = state + ((r / group) * heads + head) * (head_dim + kStateExtra);
      std::copy_n(own, head_dim, buf.acc.data() + r * head_dim);
      buf.row_max[r] = own[head_dim];
      buf.row_sum[r] = own[head_dim + 1];
    }
  }
  if (rows <= kMaxDirectRows) {
    attend_rows_direct<scalar_t>(buf.query.data(), rows, group, pool, block_size, slot_stride,
                                 kv_heads, head_dim, table, first_position, state_blocks,
                                 kv_head, window, buf.acc.data(), buf.row_max.data(),
                                 buf.row_sum.data(), buf.scores.data());
  } else {
    // Row r is token first_position + r / group: causal, and within the window if any.
    const auto visible = [&](int64_t r, int64_t key_start, int64_t keys) {
      const int64_t position = first_position + r / group;
      const int64_t low = (window > 0 ? position - window + 1 : 0) - key_start;
      return std::pair<int64_t, int64_t>(std::max<int64_t>(0, low),
                                         std::min<int64_t>(keys, position + 1 - key_start));
    };
    const int64_t last_position = first_position + num_queries - 1;
    const int64_t lowest_key =
        window > 0 ? std::max<int64_t>(0, first_position - window + 1) : 0;
    attend_rows_gemm<scalar_t>(rows, pool, block_size, slot_stride, kv_heads, head_dim, table,
                               std::max(state_blocks, lowest_key / block_size),
                               last_position / block_size + 1, kv_head, visible, scale, buf);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inverse = 1.0f / buf.row_sum[r];
    const float* a = buf.acc.data() + r * head_dim;
    scalar_t* dst = out + (r / group) * out_token_stride + (kv_head * group + r % group) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(a[d] * inverse);
  }
}

struct SharedPrefix {
  std::vector<int64_t> members;  // sequences (rows of `sequences`)
  int64_t blocks;                // leading table entries they share, all keys visible to all
  std::vector<int64_t> tokens;   // the members' new tokens (indices into q)
};

// Sequences whose tables begin with the same blocks, grouped by their first block: each
// group shares the longest run of leading blocks common to all its members, up to the last
// block that every new token of every member sees whole (those before each member's first
// new token, its own block included when that token ends it). Groups of one, or sharing no
// whole block, are left to the per-sequence items.
std::vector<SharedPrefix> shared_prefixes(const int64_t* seq, int64_t num_sequences,
                                          const at::Tensor& tables, int64_t block_size) {
  const int64_t width = tables.size(1);
  const int64_t* table = tables.data_ptr<int64_t>();
  std::map<int64_t, std::vector<int64_t>> by_first_block;
  for (int64_t n = 0; n < num_sequences; ++n)
    if (seq[n * 3] + 1 >= block_size)
      by_first_block[table[n * width]].push_back(n);
  std::vector<SharedPrefix> prefixes;
  for (auto& [block, members] : by_first_block) {
    if (members.size() < 2) continue;
    const int64_t* lead = table + members[0] * width;
    int64_t blocks = width;
    for (int64_t n : members) {
      blocks = std::min(blocks, (seq[n * 3] + 1) / block_size);  // whole blocks before its token
      const int64_t* own = table + n * width;
      int64_t common = 0;
      while (common < blocks && own[common] == lead[common]) ++common;
      blocks = common;
    }
    if (blocks == 0) continue;
    std::vector<int64_t> tokens;
    for (int64_t n : members)
      for (int64_t t = 0; t < seq[n * 3 + 1]; ++t) tokens.push_back(seq[n * 3 + 2] + t);
    prefixes.push_back({std::move(members), blocks, std::move(tokens)});
  }
  return prefixes;
}

// Work items taken one at a time from a shared counter by each of ATen's threads (per
// thread buffers reused by all of its items). Their costs differ: a causal prefill's later
// tiles see more keys, so contiguous shares (as at::parallel_for splits a range) of one
// 1,088-token prompt's items leave one of two threads about three times the other's work.
template <typename Body>
void for_each_item(int64_t count, const Body& body) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), count);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Buffers buffers;
    for (int64_t item = next++; item < count; item = next++) body(item, buffers);
  });
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
  // Work items, listed once so threads split them evenly: a decode's whole token, or one
  // (query tile, KV head) of a longer run of new tokens (kv_head -1: all heads, a decode).
  // Sequence-major: consecutive items read the other heads of the same slots, which are
  // then in cache (measured 2-4x faster than head-major, even with shared prefixes).
  std::vector<int64_t> item_sequence, item_tile, item_kv_head;
  for (int64_t n = 0; n < num_sequences; ++n) {
    TORCH_CHECK(seq[n * 3 + 1] > 0 && seq[n * 3] >= 0, "bad sequence row");
    TORCH_CHECK((seq[n * 3] + seq[n * 3 + 1] - 1) / block_size < width, "block table too short");
    for (int64_t t = 0; t < seq[n * 3 + 1]; t += kQueryTile) {
      const bool decode = seq[n * 3 + 1] == 1;
      for (int64_t h = decode ? -1 : 0; h < (decode ? 0 : kv_heads); ++h) {
        item_sequence.push_back(n);
        item_tile.push_back(t);
        item_kv_head.push_back(h);
      }
    }
  }
  const std::vector<SharedPrefix> prefixes =
      window > 0 ? std::vector<SharedPrefix>()
                 : shared_prefixes(seq, num_sequences, tables, block_size);
  std::vector<int64_t> prefix_blocks(num_sequences, 0);
  // Shared-prefix work items: (prefix, first of its tokens in the item), then the KV head.
  const int64_t prefix_tile = std::max<int64_t>(1, kPrefixRows / group);
  std::vector<std::pair<int64_t, int64_t>> prefix_tiles;
  for (int64_t p = 0; p < static_cast<int64_t>(prefixes.size()); ++p) {
    for (int64_t n : prefixes[p].members) prefix_blocks[n] = prefixes[p].blocks;
    for (int64_t t = 0; t < static_cast<int64_t>(prefixes[p].tokens.size()); t += prefix_tile)
      prefix_tiles.emplace_back(p, t);
  }
  const int64_t token_state = heads * (head_dim + kStateExtra);
  std::vector<float> states(prefixes.empty() ? 0 : q.size(0) * token_state);
  const int64_t num_items = static_cast<int64_t>(item_sequence.size());
  const int64_t num_prefix_items = static_cast<int64_t>(prefix_tiles.size()) * kv_heads;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    const scalar_t* q_data = q.data_ptr<scalar_t>();
    const scalar_t* pool_data = pool.data_ptr<scalar_t>();
    scalar_t* out_data = out.data_ptr<scalar_t>();
    const int64_t* table_data = tables.data_ptr<int64_t>();
    if (num_prefix_items > 0) {
      for_each_item(num_prefix_items, [&](int64_t item, Buffers& buffers) {
        const auto [p, first_token] = prefix_tiles[item / kv_heads];
        const SharedPrefix& prefix = prefixes[p];
        const int64_t count = std::min<int64_t>(
            prefix_tile, static_cast<int64_t>(prefix.tokens.size()) - first_token);
        attend_shared_prefix<scalar_t>(
            prefix.tokens.data() + first_token, count, prefix.blocks, q_data, q.stride(0),
            q.stride(1), pool_data, block_size, pool.stride(1), kv_heads, head_dim,
            table_data + prefix.members[0] * width, group, item % kv_heads,
            static_cast<float>(scale), states.data(), buffers);
      });
    }
    for_each_item(num_items, [&](int64_t item, Buffers& buffers) {
      const int64_t n = item_sequence[item], tile = item_tile[item], kv_head = item_kv_head[item];
      const int64_t start = seq[n * 3], num_new = seq[n * 3 + 1], first = seq[n * 3 + 2];
      const int64_t count = std::min(kQueryTile, num_new - tile);
      const float* prefix_state =
          prefix_blocks[n] > 0 ? states.data() + (first + tile) * token_state : nullptr;
      if (kv_head < 0) {
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
          if (head_dim == 64 || head_dim == 128) {
            const auto decode = head_dim == 64 ? attend_decode_vectors<scalar_t, 64>
                                               : attend_decode_vectors<scalar_t, 128>;
            decode(q_data + first * q.stride(0), q.stride(1), pool_data, block_size,
                   pool.stride(1), kv_heads, table_data + n * width, start, group, window,
                   static_cast<float>(scale), out_data + first * heads * head_dim,
                   prefix_state, prefix_blocks[n], buffers);
            return;
          }
        }
#endif
        const auto decode = head_dim == 64    ? attend_decode<scalar_t, 64>
                            : head_dim == 128 ? attend_decode<scalar_t, 128>
                                              : attend_decode<scalar_t, 0>;
        decode(q_data + first * q.stride(0), q.stride(1), pool_data, block_size,
               pool.stride(1), kv_heads, head_dim, table_data + n * width, start, group,
               window, static_cast<float>(scale), out_data + first * heads * head_dim,
               prefix_state, prefix_blocks[n], buffers);
        return;
      }
      attend_tile<scalar_t>(q_data + (first + tile) * q.stride(0), q.stride(0), q.stride(1),
                            pool_data, block_size, pool.stride(1), kv_heads, head_dim,
                            table_data + n * width, start + tile, count, group, kv_head,
                            window, static_cast<float>(scale),
                            out_data + (first + tile) * heads * head_dim, heads * head_dim,
                            prefix_state, prefix_blocks[n], buffers);
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

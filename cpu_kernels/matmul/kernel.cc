// y[M, N] = (x[M, K] . w[N, K]^T) (* scale[N]): float32 activations times "out_in" weights
// that are float32, or int8 with one float32 scale per output row; for XLA:CPU through the
// XLA FFI (AVX2 + FMA). w may be one layer of stacked weights [L, N, K], read in place (a
// layer scan passes the whole stack and the index rather than a sliced copy).
//
// XLA:CPU runs these products of a decode step (few rows of x against a large weight) well
// below the machine's rates, and has no fast int8 path at all: converting int8 weights inside
// a dot ran several times slower than float32 here. This kernel:
// - up to 3 rows of x: streams each weight row once, 32 values at a time, into accumulators
//   per row of x (memory-bound: int8 reads a quarter of float32's bytes). Against int8
//   weights these rows of x are rounded to int16 (one scale per row: a relative error of at
//   most 1.5e-5 of the row's largest value, far below the int8 weights' own) and multiplied
//   in integers;
// - more rows: x is transposed once to x^T [K, M'] (M' = M rounded up to 8, zero rows), and
//   each block of NR weight rows times 8 MV rows of x (MV = 1-4: 32 rows x 3 weight rows,
//   24 x 4, 16 x 6, 8 x 8) is an outer product per k: broadcasts of w[n, k] against MV vectors
//   of x^T[k, m], FMAs into NR x MV accumulators held in registers. The weight rows are read in
//   place (int8 rows are first converted to a float buffer that stays in L2), so neither
//   layout needs packing. Against 16-row blocks only, blocks of 24 and 32 rows were 5-9%
//   faster over the default model's shapes at 8-32 rows (interleaved in one process).
// - int4 weights in groups (two 4-bit values a byte, a scale and a bias per group of inputs;
//   pallas_kernels/int4_matmul/reference.py): up to 4 rows stream the packed weight, each run
//   of 32 values dequantized exactly in registers (or, with int8_activations, multiplied in
//   integers against x rounded to int8 per run, llama.cpp's approach); more rows dequantize
//   the tile's weight rows to float32 in L2 for the outer-product path. Where the CPU has
//   AVX-512F (asked for by the caller, checked here), the exact streaming path looks each
//   run's values up in a 16-entry table per group instead (StreamRowInt4Avx512).
// Tiles of output columns are shared out over XLA's intra-op threads (common.h).
//
// Each output of the outer-product path is one FMA chain over k = 0 .. K-1 in order, whatever
// the number of rows or the block that holds the row; the streaming path for up to 3 rows sums
// 32 interleaved chains instead. With `fixed_order` (the engine's batch-invariant mode) every
// row count takes the outer-product path (int8 weights converted to float32 likewise), so a
// row's result does not depend on the rows beside it.
//
// GCC keeps arrays of vectors in registers only if the loops over them are fully unrolled
// (otherwise it stores every accumulator each iteration: a third of the FMA rate, measured);
// hence the unroll pragmas.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Up to 3 rows of x: claims of a quarter of the weight rows (output columns), at least
// kTile: each thread then streams long contiguous runs of the weight, which the hardware
// prefetchers follow best (16-row claims: 1.05-1.1x the time at 1-2 rows).
constexpr int64_t kTile = 16, kStreamClaims = 4;
constexpr int64_t kOuterTile = 48;  // the same for more rows: 8 outer-product blocks
// A grouped product streams the weight for groups of up to 8 rows (a decode step's few rows per
// expert), where the outer-product path would pad them to 8 and transpose them.
constexpr int kMaxStreamRows = 8;
// Claims of a large weight streamed by up to 3 rows (an LM head): 64 rows each (the default
// model's int8 head, one row: 1.2-1.8 against 2.3 ms with 16-row claims; quarters of it were
// no faster in float32 and 1.03-1.04x the time in int8).
constexpr int64_t kStreamColumns = 64, kStreamMinColumns = 16384;

inline __m256 Load8(const int8_t* p) {  // 8 x int8 -> 8 x float
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <typename W>
struct Problem {
  const float* x;  // [M, K]
  const W* w;  // [N, K]
  const float* scale;  // [N], or nullptr for float32 weights
  float* y;  // [M, N]
  int64_t m, n, k;
  // int8 weights with up to 3 rows: x rounded to int16, x ~= xq * x_scale per row.
  const int16_t* xq = nullptr;  // [M, K]
  const float* x_scale = nullptr;  // [M]
  bool fixed_order = false;  // every row count through the outer-product path

  // Rows up to which the product streams the weight (grouped products: up to kMaxStreamRows).
  int64_t stream_rows = 3;

  bool Streams() const { return m <= stream_rows && !fixed_order; }

  // Grouped products: row i of the product goes to row y_rows[i] of y (nullptr: row i).
  const int32_t* y_rows = nullptr;

  // int4 weights (W = uint8_t: two 4-bit values a byte, pallas_kernels/int4_matmul/reference.py):
  // W = q * scale + bias per group of `group` inputs; scale and bias [N, K / group], each
  // float32 or float16.
  const void* group_scale = nullptr;
  const void* group_bias = nullptr;
  bool scale_f16 = false, bias_f16 = false;
  int64_t group = 0;
  // Streaming rows against int4 weights with int8 activations: each row's sum over each group
  // [M, K / group], and x rounded to int8 per run of 32 [M, K] with its scales [M, K / 32].
  const float* x_sums = nullptr;
  const int8_t* x8 = nullptr;
  const float* x8_scale = nullptr;
  // Streaming int4 rows through the AVX-512 path (StreamRowInt4Avx512).
  bool avx512 = false;

  void Store(int64_t row, int64_t col, float value) const {
    const int64_t out = y_rows == nullptr ? row : y_rows[row];
    y[out * n + col] = scale == nullptr ? value : value * scale[col];
  }
};

// Rows [0, MR) of x times float32 weight row `col`: Q accumulators per row (4 up to 3 rows;
// 2, then 1, for the 4-8 rows of a grouped product's small groups, within the 16 registers).
template <int MR>
void StreamRow(const Problem<float>& p, int64_t col) {
  constexpr int Q = MR <= 3 ? 4 : MR <= 6 ? 2 : 1;
  __m256 acc[MR][Q];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int q = 0; q < Q; ++q) acc[i][q] = _mm256_setzero_ps();
  const float* w = p.w + col * p.k;
  const int64_t k32 = p.k & ~int64_t{31};
  // No software prefetch: the row is one sequential stream, which the hardware prefetchers
  // follow; prefetching 1-4 KB ahead as well took 1.05-1.13x the time.
  for (int64_t kk = 0; kk < k32; kk += 32) {
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const __m256 wv = _mm256_loadu_ps(w + kk + 8 * q);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i)
        acc[i][q % Q] =
            _mm256_fmadd_ps(_mm256_loadu_ps(p.x + i * p.k + kk + 8 * q), wv, acc[i][q % Q]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    __m256 total = acc[i][0];
    if constexpr (Q == 4) {
      total = _mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]),
                            _mm256_add_ps(acc[i][2], acc[i][3]));
    } else if constexpr (Q == 2) {
      total = _mm256_add_ps(acc[i][0], acc[i][1]);
    }
    float s = jaxinfer::Sum(total);
    for (int64_t kk = k32; kk < p.k; ++kk) s += p.x[i * p.k + kk] * w[kk];
    p.Store(i, col, s);
  }
}

// Rows [0, MR) of x, rounded to int16, times int8 weight row `col`, in integers: one
// sign-extension and one multiply-add per 16 weights instead of conversions to float and
// FMAs, which made the float path compute-bound (11 GB/s of weights per core) below what
// memory delivers. The int32 sums are flushed to float every 2048 values of K (no overflow:
// each of the 8 lanes sums 2048 / 8 products, and 256 * 127 * 32767 < 2^31).
template <int MR>
void StreamRowInt16(const Problem<int8_t>& p, int64_t col) {
  constexpr int64_t kFlush = 2048;
  float total[MR] = {};
  const int8_t* w = p.w + col * p.k;
  const int64_t k32 = p.k & ~int64_t{31};
  for (int64_t start = 0; start < k32; start += kFlush) {
    const int64_t stop = std::min(k32, start + kFlush);
    __m256i acc[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_si256();
    for (int64_t kk = start; kk < stop; kk += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kk) + 1024, _MM_HINT_T0);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kk));
      const __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
      const __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const int16_t* x = p.xq + i * p.k + kk;
        const __m256i x_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
        const __m256i x_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(lo, x_lo));
        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(hi, x_hi));
      }
    }
    for (int i = 0; i < MR; ++i) total[i] += jaxinfer::Sum(_mm256_cvtepi32_ps(acc[i]));
  }
  for (int i = 0; i < MR; ++i) {
    float tail = 0.0f;
    for (int64_t kk = k32; kk < p.k; ++kk) tail += p.x[i * p.k + kk] * static_cast<float>(w[kk]);
    p.Store(i, col, total[i] * p.x_scale[i] + tail);
  }
}

// count values of a float32 or float16 array from `offset`, as float32.
inline void GroupFloats(const void* data, bool f16, int64_t offset, int64_t count, float* out) {
  if (!f16) {
    std::copy_n(static_cast<const float*>(data) + offset, count, out);
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(data) + offset;
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    _mm256_storeu_ps(out + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  }
  for (; i < count; ++i) out[i] = _cvtsh_ss(h[i]);
}

// The 32 weights of one packed run (16 bytes) dequantized exactly (one FMA q * scale + bias),
// as 4 vectors of 8 floats, values 8v .. 8v + 7. Bytes j .. j + 7 zero-extended to 32 bits hold
// values j .. j + 7 in their low nibbles and j + 16 .. j + 23 in their high ones.
__attribute__((always_inline)) inline void Dequantize32(const uint8_t* run, __m256 s, __m256 b,
                                                        __m256 (&v)[4]) {
  const __m256i mask = _mm256_set1_epi32(0x0F);
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(run)));
  const __m256i b1 =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(run + 8)));
  v[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, mask)), s, b);
  v[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, mask)), s, b);
  v[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), s, b);
  v[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), s, b);
}

using jaxinfer::Dot;  // sum_g a[g] * b[g]

// Rows [m0, m0 + MR) of x (float32) times int4 weight row `col`: each run of 32 weights
// dequantized exactly in registers (never to memory), FMAs into Q accumulators per row.
template <int MR>
void StreamRowInt4(const Problem<uint8_t>& p, int64_t col, int64_t m0, const float* scale,
                   const float* bias) {
  constexpr int Q = MR <= 2 ? 4 : 2;
  const int64_t groups = p.k / p.group, runs = p.group / 32;
  const uint8_t* w = p.w + col * (p.k / 2);
  const float* x = p.x + m0 * p.k;
  __m256 acc[MR][Q];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int q = 0; q < Q; ++q) acc[i][q] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 s = _mm256_set1_ps(scale[g]), b = _mm256_set1_ps(bias[g]);
    for (int64_t r = 0; r < runs; ++r) {
      const int64_t kk = (g * runs + r) * 32;
      __m256 v[4];
      Dequantize32(w + kk / 2, s, b, v);
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q)
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i)
          acc[i][q % Q] =
              _mm256_fmadd_ps(_mm256_loadu_ps(x + i * p.k + kk + 8 * q), v[q], acc[i][q % Q]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    __m256 sum = _mm256_add_ps(acc[i][0], acc[i][1]);
    if constexpr (Q == 4) sum = _mm256_add_ps(sum, _mm256_add_ps(acc[i][2], acc[i][3]));
    p.Store(m0 + i, col, jaxinfer::Sum(sum));
  }
}

// The same with x rounded to int8 per run of 32 (llama.cpp's approach): each run's product
// of the unsigned 4-bit values and the int8 values in integers (two multiply-adds for 32),
// converted once and scaled by the group's scale times the run's scale of x. The bias term
// uses x's exact sums.
template <int MR>
void StreamRowInt4Int8(const Problem<uint8_t>& p, int64_t col, int64_t m0, const float* scale,
                       const float* bias) {
  constexpr int A = MR == 1 ? 4 : 2;  // accumulators per row (independent FMA chains)
  const int64_t groups = p.k / p.group, runs = p.group / 32, all_runs = p.k / 32;
  const uint8_t* w = p.w + col * (p.k / 2);
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 total[MR][A];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int a = 0; a < A; ++a) total[i][a] = _mm256_setzero_ps();
  for (int64_t b = 0; b < all_runs; b += A) {
#pragma GCC unroll 4
    for (int a = 0; a < A; ++a) {
      if (b + a >= all_runs) break;
      const int64_t run = b + a;
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + run * 16));
      const __m128i lo = _mm_and_si128(bytes, mask);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
      const __m256i wv = _mm256_set_m128i(hi, lo);  // values 0 .. 31 in order
      const float s = scale[run / runs];
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        const __m256i xv = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(p.x8 + (m0 + i) * p.k + run * 32));
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones);
        const __m256 d = _mm256_set1_ps(s * p.x8_scale[(m0 + i) * all_runs + run]);
        total[i][a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, total[i][a]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    __m256 sum = total[i][0];
#pragma GCC unroll 4
    for (int a = 1; a < A; ++a) sum = _mm256_add_ps(sum, total[i][a]);
    const float* sums = p.x_sums + (m0 + i) * groups;
    p.Store(m0 + i, col, jaxinfer::Sum(sum) + Dot(bias, sums, groups));
  }
}

// AVX-512 (used only where the CPU has it: the caller asks, Int4Shape checks). A group's 16
// possible weights q * scale + bias (the same FMA as Dequantize32) are one vector, and each
// run of 32 weights is two lookups in it (vpermps reads the low 4 bits of each index): bytes
// zero-extended to 16 lanes index values 0 .. 15, shifted right by 4 values 16 .. 31. About a
// third of the AVX2 path's instructions per run.
#define JAXINFER_AVX512 __attribute__((target("avx512f"), always_inline)) inline

// Bytes ahead of the run being read that the AVX-512 path prefetches (the weight rows that
// follow this one: a tile's rows are contiguous). Without it the loads of the weight held the
// loop up (most samples on the first lookup); 256-2048 bytes all helped, 1024 about most.
constexpr int64_t kInt4Prefetch = 1024;

JAXINFER_AVX512 __m512 Int4Table(float scale, float bias) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_fmadd_ps(iota, _mm512_set1_ps(scale), _mm512_set1_ps(bias));
}

// The run at `w` (16 bytes) times rows [0, MR) of x at `x` (row stride k), into acc[i][0..1].
template <int MR>
JAXINFER_AVX512 void Int4Run512(const uint8_t* w, const float* x, int64_t k, __m512 table,
                                __m512 (&acc)[MR][2]) {
  const __m512i index =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  const __m512 lo = _mm512_permutexvar_ps(index, table);
  const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(index, 4), table);
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    acc[i][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * k), lo, acc[i][0]);
    acc[i][1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * k + 16), hi, acc[i][1]);
  }
}

// StreamRowInt4 with AVX-512: runs in pairs, each of a pair into its own accumulators (two
// independent FMA chains per row and run: four per row in flight).
template <int MR>
__attribute__((target("avx512f"))) void StreamRowInt4Avx512(const Problem<uint8_t>& p,
                                                            int64_t col, int64_t m0,
                                                            const float* scale,
                                                            const float* bias) {
  const int64_t runs = p.group / 32, all_runs = p.k / 32;
  const uint8_t* w = p.w + col * (p.k / 2);
  const float* x = p.x + m0 * p.k;
  __m512 even[MR][2], odd[MR][2];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    even[i][0] = even[i][1] = odd[i][0] = odd[i][1] = _mm512_setzero_ps();
  }
  int64_t group = 0, left = runs;  // the run's group, and its runs from this one on
  __m512 table = Int4Table(scale[0], bias[0]);
  int64_t r = 0;
  for (; r + 2 <= all_runs; r += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(w + r * 16) + kInt4Prefetch, _MM_HINT_T0);
    Int4Run512<MR>(w + r * 16, x + r * 32, p.k, table, even);
    if (--left == 0) left = runs, ++group, table = Int4Table(scale[group], bias[group]);
    Int4Run512<MR>(w + r * 16 + 16, x + r * 32 + 32, p.k, table, odd);
    if (--left == 0 && r + 2 < all_runs) {
      left = runs, ++group, table = Int4Table(scale[group], bias[group]);
    }
  }
  if (r < all_runs) Int4Run512<MR>(w + r * 16, x + r * 32, p.k, table, even);
  for (int i = 0; i < MR; ++i) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(even[i][0], even[i][1]),
                                     _mm512_add_ps(odd[i][0], odd[i][1]));
    p.Store(m0 + i, col, _mm512_reduce_add_ps(sum));
  }
}

// Weight rows [col0, col1) times every row of x (at most kInt4StreamRows), with AVX-512: one
// call for a claim's columns, each column's scales and biases converted to float32 in turn.
template <int MR>
__attribute__((target("avx512f"))) void Int4Columns512(const Problem<uint8_t>& p, int64_t col0,
                                                       int64_t col1, int64_t m0, float* params) {
  const int64_t groups = p.k / p.group;
  for (int64_t col = col0; col < col1; ++col) {
    GroupFloats(p.group_scale, p.scale_f16, col * groups, groups, params);
    GroupFloats(p.group_bias, p.bias_f16, col * groups, groups, params + groups);
    StreamRowInt4Avx512<MR>(p, col, m0, params, params + groups);
  }
}

void StreamColumnsInt4Avx512(const Problem<uint8_t>& p, int64_t col0, int64_t col1) {
  const int64_t groups = p.k / p.group;
  std::vector<float> params(2 * groups);
  for (int64_t m0 = 0; m0 < p.m; m0 += 4) {
    const int64_t rows = std::min<int64_t>(4, p.m - m0);
    if (rows == 4) Int4Columns512<4>(p, col0, col1, m0, params.data());
    if (rows == 3) Int4Columns512<3>(p, col0, col1, m0, params.data());
    if (rows == 2) Int4Columns512<2>(p, col0, col1, m0, params.data());
    if (rows == 1) Int4Columns512<1>(p, col0, col1, m0, params.data());
  }
}

// Rows [0, m) of x (m <= kMaxStreamRows) times int4 weight row `col`, 4 rows at a time.
inline void StreamRowsInt4(const Problem<uint8_t>& p, int64_t col) {
  const int64_t groups = p.k / p.group;
  constexpr int64_t kStackGroups = 512;
  float stack[2 * kStackGroups];  // the row's scales, then its biases
  std::vector<float> heap(groups > kStackGroups ? 2 * groups : 0);
  float* scale = groups > kStackGroups ? heap.data() : stack;
  float* bias = scale + groups;
  GroupFloats(p.group_scale, p.scale_f16, col * groups, groups, scale);
  GroupFloats(p.group_bias, p.bias_f16, col * groups, groups, bias);
  for (int64_t m0 = 0; m0 < p.m; m0 += 4) {
    const int64_t rows = std::min<int64_t>(4, p.m - m0);
    if (p.x8 != nullptr) {
      if (rows == 4) StreamRowInt4Int8<4>(p, col, m0, scale, bias);
      if (rows == 3) StreamRowInt4Int8<3>(p, col, m0, scale, bias);
      if (rows == 2) StreamRowInt4Int8<2>(p, col, m0, scale, bias);
      if (rows == 1) StreamRowInt4Int8<1>(p, col, m0, scale, bias);
    } else {
      if (rows == 4) StreamRowInt4<4>(p, col, m0, scale, bias);
      if (rows == 3) StreamRowInt4<3>(p, col, m0, scale, bias);
      if (rows == 2) StreamRowInt4<2>(p, col, m0, scale, bias);
      if (rows == 1) StreamRowInt4<1>(p, col, m0, scale, bias);
    }
  }
}

// int4 weight rows [col0, col0 + count) dequantized to float32 rows of K in `out` (exactly:
// one FMA q * scale + bias per value).
inline void DequantizeInt4Rows(const Problem<uint8_t>& p, int64_t col0, int64_t count,
                               float* out) {
  const int64_t groups = p.k / p.group, runs = p.group / 32;
  std::vector<float> params(2 * groups);
  for (int64_t j = 0; j < count; ++j) {
    const int64_t col = col0 + j;
    GroupFloats(p.group_scale, p.scale_f16, col * groups, groups, params.data());
    GroupFloats(p.group_bias, p.bias_f16, col * groups, groups, params.data() + groups);
    const uint8_t* w = p.w + col * (p.k / 2);
    float* row = out + j * p.k;
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 s = _mm256_set1_ps(params[g]), b = _mm256_set1_ps(params[groups + g]);
      for (int64_t r = 0; r < runs; ++r) {
        const int64_t kk = (g * runs + r) * 32;
        __m256 v[4];
        Dequantize32(w + kk / 2, s, b, v);
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) _mm256_storeu_ps(row + kk + 8 * q, v[q]);
      }
    }
  }
}

// Per row of x [M, K]: its sums over each group of `group` [M, K / group], and x rounded to
// int8 per run of 32 (max |x| / 127 per run) with the runs' scales [M, K / 32].
void PrepareInt4Rows(const float* x, int64_t m, int64_t k, int64_t group, float* sums,
                     int8_t* x8, float* x8_scale) {
  const int64_t groups = k / group;
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * k;
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t j = 0; j < group; ++j) s += row[g * group + j];
      sums[i * groups + g] = s;
    }
    for (int64_t r = 0; r < k / 32; ++r) {
      float largest = 0.0f;
      for (int64_t j = 0; j < 32; ++j) largest = std::max(largest, std::abs(row[r * 32 + j]));
      const float d = largest / 127.0f;
      const float inverse = d > 0.0f ? 1.0f / d : 0.0f;
      x8_scale[i * (k / 32) + r] = d;
      for (int64_t j = 0; j < 32; ++j) {
        x8[i * k + r * 32 + j] = static_cast<int8_t>(std::lrintf(row[r * 32 + j] * inverse));
      }
    }
  }
}

// Rounds rows of x to int16 with one scale per row (max |x| / 32767).
void RoundRows(const float* x, int64_t m, int64_t k, int16_t* xq, float* scale) {
  for (int64_t i = 0; i < m; ++i) {
    float largest = 0.0f;
    for (int64_t j = 0; j < k; ++j) largest = std::max(largest, std::abs(x[i * k + j]));
    scale[i] = largest > 0.0f ? largest / 32767.0f : 1.0f;
    const float inverse = 1.0f / scale[i];
    for (int64_t j = 0; j < k; ++j) {
      xq[i * k + j] = static_cast<int16_t>(std::lrintf(x[i * k + j] * inverse));
    }
  }
}

// x [M, K] -> xt [K, mp] (mp >= M, a multiple of 8; rows M.. are zero), by 8 x 8 blocks.
// With `rows`, row i of the input is x's row rows[i] (a gather, for grouped products).
void Transpose(const float* x, int64_t m, int64_t k, float* xt, int64_t mp,
               const int32_t* rows = nullptr) {
  const auto row = [x, k, rows](int64_t i) { return x + (rows == nullptr ? i : rows[i]) * k; };
  const int64_t m8 = m & ~int64_t{7}, k8 = k & ~int64_t{7};
  for (int64_t i = 0; i < m8; i += 8) {
    const float* in[8];
    for (int a = 0; a < 8; ++a) in[a] = row(i + a);
    for (int64_t j = 0; j < k8; j += 8) {
      __m256 r[8];
#pragma GCC unroll 8
      for (int a = 0; a < 8; ++a) r[a] = _mm256_loadu_ps(in[a] + j);
      __m256 t[8];
#pragma GCC unroll 4
      for (int a = 0; a < 8; a += 2) {
        t[a] = _mm256_unpacklo_ps(r[a], r[a + 1]);
        t[a + 1] = _mm256_unpackhi_ps(r[a], r[a + 1]);
      }
      __m256 u[8];
#pragma GCC unroll 4
      for (int a = 0; a < 8; a += 4) {
        u[a] = _mm256_shuffle_ps(t[a], t[a + 2], 0x44);
        u[a + 1] = _mm256_shuffle_ps(t[a], t[a + 2], 0xEE);
        u[a + 2] = _mm256_shuffle_ps(t[a + 1], t[a + 3], 0x44);
        u[a + 3] = _mm256_shuffle_ps(t[a + 1], t[a + 3], 0xEE);
      }
#pragma GCC unroll 4
      for (int a = 0; a < 4; ++a) {
        _mm256_storeu_ps(xt + (j + a) * mp + i, _mm256_permute2f128_ps(u[a], u[a + 4], 0x20));
        _mm256_storeu_ps(xt + (j + a + 4) * mp + i,
                         _mm256_permute2f128_ps(u[a], u[a + 4], 0x31));
      }
    }
    for (int64_t j = k8; j < k; ++j)
      for (int64_t a = 0; a < 8; ++a) xt[j * mp + i + a] = in[a][j];
  }
  for (int64_t i = m8; i < m; ++i) {
    const float* in = row(i);
    for (int64_t j = 0; j < k; ++j) xt[j * mp + i] = in[j];
  }
  for (int64_t j = 0; j < k; ++j)
    for (int64_t i = m; i < mp; ++i) xt[j * mp + i] = 0.0f;
}

// y[m0 + i, col0 + j] for i < min(8 MV, m - m0), j < NR: the outer products of the weight
// rows w[j] (K floats each) and the columns m0.. of x^T, summed over k.
// One step k of a block: acc[j][v] += w[j][k] * x^T[k, 8v : 8v + 8] (`x` = x^T's row k).
template <int NR, int MV>
__attribute__((always_inline)) inline void OuterStep(__m256 (&acc)[NR][MV], const float* x,
                                                     const float* const (&w)[NR], int64_t kk) {
  if constexpr (NR * MV + MV + 1 > 16) {
    // x's MV vectors, the accumulators and a broadcast would need more than the 16 vector
    // registers (GCC then reloads x^T's vectors from memory for every FMA): hold the NR
    // broadcasts instead and load x^T's vectors one at a time. 32 rows: 0.84x the time.
    __m256 b[NR];
#pragma GCC unroll 12
    for (int j = 0; j < NR; ++j) b[j] = _mm256_broadcast_ss(w[j] + kk);
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) {
      const __m256 xv = _mm256_loadu_ps(x + 8 * v);
#pragma GCC unroll 12
      for (int j = 0; j < NR; ++j) acc[j][v] = _mm256_fmadd_ps(b[j], xv, acc[j][v]);
    }
  } else {
    __m256 xv[MV];
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) xv[v] = _mm256_loadu_ps(x + 8 * v);
#pragma GCC unroll 12
    for (int j = 0; j < NR; ++j) {
      const __m256 b = _mm256_broadcast_ss(w[j] + kk);
#pragma GCC unroll 4
      for (int v = 0; v < MV; ++v) acc[j][v] = _mm256_fmadd_ps(b, xv[v], acc[j][v]);
    }
  }
}

template <int NR, int MV, typename W>
void OuterBlock(const Problem<W>& p, const float* xt, int64_t mp, const float* const* w,
                int64_t col0, int64_t m0) {
  __m256 acc[NR][MV];
#pragma GCC unroll 12
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) acc[j][v] = _mm256_setzero_ps();
  // Locals, so the loop keeps them in registers rather than reloading them through `p`.
  const int64_t k = p.k;
  const float* weights[NR];
#pragma GCC unroll 12
  for (int j = 0; j < NR; ++j) weights[j] = w[j];
  // While the first block of rows of x runs, fetch the next weight block (the rows after
  // these, contiguous for float32 weights) one cache line per 2 steps: the interleaved row
  // streams alone read 11-15 GB/s here, 10-20% slower than with this (a prefetch past the
  // end of the array is harmless: prefetches never fault).
  const char* next = reinterpret_cast<const char*>(weights[NR - 1] + k);
  const int64_t prefetch_steps =
      std::is_same_v<W, float> && m0 == 0 ? std::min(k, NR * k / 8) & ~int64_t{1} : 0;
  const float* x = xt + m0;
  int64_t kk = 0;
  for (; kk < prefetch_steps; kk += 2, x += 2 * mp) {
    _mm_prefetch(next + kk * 32, _MM_HINT_T0);
    OuterStep<NR, MV>(acc, x, weights, kk);
    OuterStep<NR, MV>(acc, x + mp, weights, kk + 1);
  }
  for (; kk < k; ++kk, x += mp) OuterStep<NR, MV>(acc, x, weights, kk);
  alignas(32) float out[NR][8 * MV];
#pragma GCC unroll 12
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) _mm256_store_ps(out[j] + 8 * v, acc[j][v]);
  const int64_t rows = std::min<int64_t>(8 * MV, p.m - m0);
  for (int64_t i = 0; i < rows; ++i)
    for (int j = 0; j < NR; ++j) p.Store(m0 + i, col0 + j, out[j][i]);
}

// Weight rows per outer-product block for MV vectors of rows of x: 12 accumulators, except
// 8 for one vector, where 12 weight rows' pointers did not fit the 16 general registers (GCC
// reloaded them from the stack every step; 8 rows: 0.92x the time at 4-8 rows of x).
template <int MV>
constexpr int kOuterColumns = MV == 1 ? 8 : 12 / MV;

template <int NR, int MV, typename W>
void OuterRest(const Problem<W>& p, const float* xt, int64_t mp, const float* const* w,
               int64_t rest, int64_t col0, int64_t m0) {
  if constexpr (NR > 0) {
    if (rest == NR) return OuterBlock<NR, MV>(p, xt, mp, w, col0, m0);
    return OuterRest<NR - 1, MV>(p, xt, mp, w, rest, col0, m0);
  }
}

// Rows [m0, m0 + 8 MV) of x for the weight rows w[0 .. count) (output columns col0..).
template <int MV, typename W>
void OuterTile(const Problem<W>& p, const float* xt, int64_t mp, const float* const* w,
               int64_t count, int64_t col0, int64_t m0) {
  constexpr int nr = kOuterColumns<MV>;
  int64_t j = 0;
  for (; j + nr <= count; j += nr) OuterBlock<nr, MV>(p, xt, mp, w + j, col0 + j, m0);
  if (j < count) OuterRest<nr - 1, MV>(p, xt, mp, w + j, count - j, col0 + j, m0);
}

// Output columns [col0, col0 + count) (count <= kOuterTile) for every row of x, from x^T.
// Blocks of up to 32 rows of x are the outer loop, so the tile's weight rows (at most 48 x K
// floats) stay in L2 while each block of x^T is used from L1 or L2.
template <typename W>
void OuterColumns(const Problem<W>& p, const float* xt, int64_t mp, int64_t col0,
                  int64_t count) {
  const float* w[kOuterTile];
  if constexpr (std::is_same_v<W, int8_t>) {
    thread_local std::vector<float> buffer;  // the tile's weight rows as float32
    buffer.resize(kOuterTile * p.k);
    const int64_t k8 = p.k & ~int64_t{7};
    for (int64_t j = 0; j < count; ++j) {
      const int8_t* row = p.w + (col0 + j) * p.k;
      float* out = buffer.data() + j * p.k;
      for (int64_t kk = 0; kk < k8; kk += 8) _mm256_storeu_ps(out + kk, Load8(row + kk));
      for (int64_t kk = k8; kk < p.k; ++kk) out[kk] = static_cast<float>(row[kk]);
      w[j] = out;
    }
  } else if constexpr (std::is_same_v<W, uint8_t>) {
    thread_local std::vector<float> buffer;  // the tile's weight rows, dequantized
    buffer.resize(kOuterTile * p.k);
    DequantizeInt4Rows(p, col0, count, buffer.data());
    for (int64_t j = 0; j < count; ++j) w[j] = buffer.data() + j * p.k;
  } else {
    for (int64_t j = 0; j < count; ++j) w[j] = p.w + (col0 + j) * p.k;
  }
  for (int64_t m0 = 0; m0 < p.m;) {
    const int64_t rest = p.m - m0;
    if (rest > 24) {
      OuterTile<4>(p, xt, mp, w, count, col0, m0);
      m0 += 32;
    } else if (rest > 16) {
      OuterTile<3>(p, xt, mp, w, count, col0, m0);
      m0 += 24;
    } else if (rest > 8) {
      OuterTile<2>(p, xt, mp, w, count, col0, m0);
      m0 += 16;
    } else {
      OuterTile<1>(p, xt, mp, w, count, col0, m0);
      m0 += 8;
    }
  }
}

// Rows [0, m) of x (m <= kMaxStreamRows) times weight row `col`, streaming.
template <int MR = 1, typename W>
void StreamRows(const Problem<W>& p, int64_t col) {
  if constexpr (MR <= kMaxStreamRows) {
    if (p.m != MR) return StreamRows<MR + 1>(p, col);
    if constexpr (std::is_same_v<W, int8_t>) {
      StreamRowInt16<MR>(p, col);
    } else if constexpr (std::is_same_v<W, uint8_t>) {
      StreamRowsInt4(p, col);
    } else {
      StreamRow<MR>(p, col);
    }
  }
}

// Output columns [col0, col1) for every row of x (x^T: `xt`, when there are more than 3 rows).
template <typename W>
void Columns(const Problem<W>& p, const float* xt, int64_t mp, int64_t col0, int64_t col1) {
  if (p.Streams()) {
    if constexpr (std::is_same_v<W, uint8_t>) {
      if (p.avx512 && p.x8 == nullptr) return StreamColumnsInt4Avx512(p, col0, col1);
    }
    for (int64_t col = col0; col < col1; ++col) {
      StreamRows(p, col);
    }
    return;
  }
  OuterColumns(p, xt, mp, col0, col1 - col0);
}

template <typename W>
ffi::Error Run(ffi::ThreadPool& pool, const Problem<W>& p) {
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  int64_t columns = kTile;
  std::vector<float> xt;
  int64_t mp = 0;
  if (p.Streams()) {
    columns = p.n >= kStreamMinColumns ? kStreamColumns
                                       : std::max(kTile, (p.n + kStreamClaims - 1) / kStreamClaims);
  } else {
    columns = kOuterTile;
    mp = (p.m + 7) & ~int64_t{7};
    xt.resize(p.k * mp + 16);
  }
  // x^T starts on a cache line: its rows' vectors are loaded without splitting lines.
  float* xt_data =
      reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(xt.data()) + 63) & ~uintptr_t{63});
  if (mp > 0) Transpose(p.x, p.m, p.k, xt_data, mp);
  jaxinfer::ParallelFor(pool, (p.n + columns - 1) / columns, [&p, xt_data, mp, columns](int64_t t) {
    Columns(p, xt_data, mp, t * columns, std::min(p.n, (t + 1) * columns));
  });
  return ffi::Error::Success();
}

// Checks the shapes and sets p.m, p.n; x [..., K], w [..., K], y [M, N].
// Checks the shapes and sets p.m, p.n and p.w; x [..., K], w [..., K] holding L >= 1
// stacked weights of y's N rows each (one layer of a stacked model), y [M, N]; the product
// uses weight `layer`, read in place.
template <typename W, typename XBuffer, typename WBuffer, typename YBuffer>
ffi::Error Shape(Problem<W>& p, const XBuffer& x, const WBuffer& w, const YBuffer& y,
                 int64_t layer) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  if (x_dims.size() < 1 || w_dims.size() < 1 || x_dims.back() != w_dims.back()) {
    return ffi::Error::InvalidArgument("matmul: x and w must share their last axis");
  }
  p.k = w_dims.back();
  p.m = p.k == 0 ? 0 : static_cast<int64_t>(x.element_count()) / p.k;
  p.n = p.m == 0 ? 0 : static_cast<int64_t>(y.element_count()) / p.m;
  const int64_t weight = p.n * p.k;
  if (p.m == 0 || weight == 0) return ffi::Error::Success();  // nothing to compute
  if (static_cast<int64_t>(y.element_count()) != p.m * p.n ||
      static_cast<int64_t>(w.element_count()) % weight != 0) {
    return ffi::Error::InvalidArgument("matmul: output size mismatch");
  }
  if (layer < 0 || layer >= static_cast<int64_t>(w.element_count()) / weight) {
    return ffi::Error::InvalidArgument("matmul: layer out of range");
  }
  p.w += layer * weight;
  return ffi::Error::Success();
}

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                      ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> layer,
                      bool fixed_order, ffi::ResultBuffer<ffi::F32> y) {
  Problem<int8_t> p{x.typed_data(), w.typed_data(), scale.typed_data(), y->typed_data()};
  p.fixed_order = fixed_order;
  if (ffi::Error error = Shape(p, x, w, *y, layer.typed_data()[0]); error.failure()) {
    return error;
  }
  if (static_cast<int64_t>(scale.element_count()) != p.n) {
    return ffi::Error::InvalidArgument("matmul: scale must have one value per output row");
  }
  std::vector<int16_t> xq;
  float x_scale[3];
  if (p.Streams()) {
    xq.resize(p.m * p.k);
    RoundRows(p.x, p.m, p.k, xq.data(), x_scale);
    p.xq = xq.data();
    p.x_scale = x_scale;
  }
  return Run(pool, p);
}

ffi::Error F32Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::Buffer<ffi::S32> layer, bool fixed_order,
                     ffi::ResultBuffer<ffi::F32> y) {
  Problem<float> p{x.typed_data(), w.typed_data(), nullptr, y->typed_data()};
  p.fixed_order = fixed_order;
  if (ffi::Error error = Shape(p, x, w, *y, layer.typed_data()[0]); error.failure()) {
    return error;
  }
  return Run(pool, p);
}

// Rows of x up to which int4 products stream the weight (more: dequantized tiles through the
// outer-product path).
constexpr int64_t kInt4StreamRows = 4;

// Checks an int4 product's shapes and points p at layer `layer`: x [M, K], qs [L, N, K / 2]
// (L >= 1 stacked layers), scale and bias [L, N, K / G] (G a multiple of 32 dividing K), each
// float32 or float16, y [M, N].
ffi::Error Int4Shape(Problem<uint8_t>& p, const ffi::Buffer<ffi::F32>& x,
                     const ffi::Buffer<ffi::U8>& qs, const ffi::AnyBuffer& scale,
                     const ffi::AnyBuffer& bias, int64_t y_count, int64_t layer) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return ffi::Error::InvalidArgument("int4 matmul: x must be [M, K]");
  p.m = x_dims[0], p.k = x_dims[1];
  if (p.k % 32 != 0) return ffi::Error::InvalidArgument("int4 matmul: K must be a multiple of 32");
  p.n = p.m == 0 ? 0 : y_count / p.m;
  if (p.m == 0 || p.n == 0 || p.k == 0) return ffi::Error::Success();
  const auto is_float = [](const ffi::AnyBuffer& b) {
    return b.element_type() == ffi::DataType::F32 || b.element_type() == ffi::DataType::F16;
  };
  const int64_t weight = p.n * p.k / 2;
  const int64_t layers = static_cast<int64_t>(qs.element_count()) / weight;
  const int64_t params = static_cast<int64_t>(scale.element_count());
  if (y_count != p.m * p.n || layers < 1 ||
      static_cast<int64_t>(qs.element_count()) != layers * weight || !is_float(scale) ||
      !is_float(bias) || params % (layers * p.n) != 0 ||
      static_cast<int64_t>(bias.element_count()) != params) {
    return ffi::Error::InvalidArgument(
        "int4 matmul: qs [L, N, K / 2], scale and bias [L, N, K / G] float32 or float16");
  }
  const int64_t groups = params / (layers * p.n);
  if (groups == 0 || p.k % groups != 0 || (p.k / groups) % 32 != 0) {
    return ffi::Error::InvalidArgument("int4 matmul: the group size must be a multiple of 32");
  }
  if (layer < 0 || layer >= layers) {
    return ffi::Error::InvalidArgument("int4 matmul: layer out of range");
  }
  p.group = p.k / groups;
  p.w += layer * weight;
  p.scale_f16 = scale.element_type() == ffi::DataType::F16;
  p.bias_f16 = bias.element_type() == ffi::DataType::F16;
  const int64_t bytes = p.scale_f16 ? 2 : 4, bias_bytes = p.bias_f16 ? 2 : 4;
  p.group_scale = static_cast<const char*>(scale.untyped_data()) + layer * p.n * groups * bytes;
  p.group_bias = static_cast<const char*>(bias.untyped_data()) + layer * p.n * groups * bias_bytes;
  return ffi::Error::Success();
}

// The AVX-512 path where asked for, refused on a CPU without it (the CPU asked once).
ffi::Error Int4Isa(bool avx512) {
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  if (avx512 && !supported) {
    return ffi::Error::InvalidArgument("int4 matmul: avx512 asked for on a CPU without AVX-512F");
  }
  return ffi::Error::Success();
}

// Buffers for the rows of x a streaming int4 product reads (Problem::x_sums, x8, x8_scale).
struct Int4Rows {
  std::vector<float> sums, x8_scale;
  std::vector<int8_t> x8;

  // Only the int8-activation path reads them (the float path dequantizes the weights).
  void Prepare(Problem<uint8_t>& p, bool int8_activations) {
    if (!int8_activations) return;
    sums.resize(p.m * (p.k / p.group));
    x8.resize(p.m * p.k);
    x8_scale.resize(p.m * (p.k / 32));
    PrepareInt4Rows(p.x, p.m, p.k, p.group, sums.data(), x8.data(), x8_scale.data());
    p.x_sums = sums.data(), p.x8 = x8.data(), p.x8_scale = x8_scale.data();
  }
};

ffi::Error Int4Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> qs,
                      ffi::AnyBuffer scale, ffi::AnyBuffer bias, ffi::Buffer<ffi::S32> layer,
                      bool fixed_order, bool int8_activations, bool avx512,
                      ffi::ResultBuffer<ffi::F32> y) {
  if (ffi::Error error = Int4Isa(avx512); error.failure()) return error;
  Problem<uint8_t> p{x.typed_data(), qs.typed_data(), nullptr, y->typed_data()};
  p.fixed_order = fixed_order;
  p.avx512 = avx512;
  p.stream_rows = kInt4StreamRows;
  if (ffi::Error error =
          Int4Shape(p, x, qs, scale, bias, y->element_count(), layer.typed_data()[0]);
      error.failure()) {
    return error;
  }
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  Int4Rows rows;
  if (p.Streams()) rows.Prepare(p, int8_activations);
  return Run(pool, p);
}

// int4 experts' group parameters (Problem's fields, for expert 0; the others follow).
struct Int4Groups {
  const char* scale = nullptr;
  const char* bias = nullptr;
  bool scale_f16 = false, bias_f16 = false;
  int64_t group = 0;
  bool int8_activations = false;
  bool avx512 = false;
};

// Grouped products (the experts of a mixture-of-experts layer): rows of the product sorted by
// group, group g's rows [offset_g, offset_g + size_g) times its own weight w[g] [N, K]. Row r
// of the product reads x's row x_rows[r] (a gather: x holds each token once) and is written to
// y's row y_rows[r] (a scatter back to the tokens' order); without them, row r itself. Rows
// after the last group are zero. Each group is the problem above over its rows (its own path
// by its row count). Preparing each group's rows (transposed, or gathered and rounded) and
// then the tiles of output columns of every group are shared out over the threads, so a
// decode step's few rows per expert still keep every thread busy.
template <typename W>
ffi::Error RunGrouped(ffi::ThreadPool& pool, const float* x, int64_t x_count, const W* w,
                      const float* scale, const int32_t* sizes, int64_t groups,
                      const int32_t* x_rows, const int32_t* y_rows, int64_t m, int64_t n,
                      int64_t k, bool fixed_order, float* y, const Int4Groups& int4 = {}) {
  constexpr bool kInt4 = std::is_same_v<W, uint8_t>;
  const int64_t weight_size = kInt4 ? n * k / 2 : n * k;  // one expert's, in W's
  const int64_t params = kInt4 ? n * (k / int4.group) : 0;  // one expert's scales
  std::vector<Problem<W>> problems;
  std::vector<int64_t> starts;  // each problem's first row of the product
  std::vector<int64_t> first_task{0};  // each problem's first tile in the task list
  std::vector<int64_t> columns;
  int64_t row = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t size = sizes[g];
    if (size < 0 || row + size > m) {
      return ffi::Error::InvalidArgument("grouped matmul: group sizes must sum to at most M");
    }
    if (size == 0) continue;
    Problem<W> p{x + row * k, w + g * weight_size, scale == nullptr ? nullptr : scale + g * n,
                 y_rows == nullptr ? y + row * n : y};
    p.m = size, p.n = n, p.k = k, p.fixed_order = fixed_order;
    p.stream_rows = kMaxStreamRows;
    if constexpr (kInt4) {
      p.group = int4.group;
      p.scale_f16 = int4.scale_f16, p.bias_f16 = int4.bias_f16;
      p.group_scale = int4.scale + g * params * (int4.scale_f16 ? 2 : 4);
      p.group_bias = int4.bias + g * params * (int4.bias_f16 ? 2 : 4);
      p.avx512 = int4.avx512;
    }
    if (y_rows != nullptr) p.y_rows = y_rows + row;
    const int64_t c = p.Streams() ? std::max(kTile, (n + kStreamClaims - 1) / kStreamClaims)
                                  : kOuterTile;
    problems.push_back(p);
    starts.push_back(row);
    columns.push_back(c);
    first_task.push_back(first_task.back() + (n + c - 1) / c);
    row += size;
  }
  if (x_rows != nullptr) {
    for (int64_t r = 0; r < row; ++r) {
      if (x_rows[r] < 0 || x_rows[r] >= x_count) {
        return ffi::Error::InvalidArgument("grouped matmul: x_rows out of range");
      }
    }
  }
  if (y_rows != nullptr) {
    for (int64_t r = 0; r < m; ++r) {
      if (y_rows[r] < 0 || y_rows[r] >= m) {
        return ffi::Error::InvalidArgument("grouped matmul: y_rows out of range");
      }
    }
    for (int64_t r = row; r < m; ++r) std::fill(y + y_rows[r] * n, y + (y_rows[r] + 1) * n, 0.0f);
  } else {
    std::fill(y + row * n, y + m * n, 0.0f);
  }
  // Per problem: x^T for the outer-product path; for streaming, its rows gathered (x_rows)
  // and, for int8 weights, rounded to int16.
  const size_t count = problems.size();
  std::vector<std::vector<float>> buffers(count);
  std::vector<std::vector<int16_t>> rounded(count);
  std::vector<std::array<float, kMaxStreamRows>> row_scales(count);
  std::vector<Int4Rows> int4_rows(kInt4 ? count : 0);
  std::vector<float*> xt(count, nullptr);
  std::vector<int64_t> mp(count, 0);
  jaxinfer::ParallelFor(pool, static_cast<int64_t>(count), [&](int64_t i) {
    Problem<W>& p = problems[i];
    const int32_t* rows = x_rows == nullptr ? nullptr : x_rows + starts[i];
    if (!p.Streams()) {
      mp[i] = (p.m + 7) & ~int64_t{7};
      buffers[i].resize(p.k * mp[i] + 16);
      xt[i] = reinterpret_cast<float*>(
          (reinterpret_cast<uintptr_t>(buffers[i].data()) + 63) & ~uintptr_t{63});
      Transpose(rows == nullptr ? p.x : x, p.m, p.k, xt[i], mp[i], rows);
      return;
    }
    if (rows != nullptr) {
      buffers[i].resize(p.m * p.k);
      for (int64_t r = 0; r < p.m; ++r) {
        std::copy(x + rows[r] * k, x + (rows[r] + 1) * k, buffers[i].data() + r * k);
      }
      p.x = buffers[i].data();
    }
    if constexpr (std::is_same_v<W, int8_t>) {
      rounded[i].resize(p.m * p.k);
      RoundRows(p.x, p.m, p.k, rounded[i].data(), row_scales[i].data());
      p.xq = rounded[i].data();
      p.x_scale = row_scales[i].data();
    }
    if constexpr (kInt4) int4_rows[i].Prepare(p, int4.int8_activations);
  });
  jaxinfer::ParallelFor(pool, first_task.back(), [&](int64_t t) {
    const size_t i =
        std::upper_bound(first_task.begin(), first_task.end(), t) - first_task.begin() - 1;
    const int64_t col0 = (t - first_task[i]) * columns[i];
    Columns(problems[i], xt[i], mp[i], col0, std::min(n, col0 + columns[i]));
  });
  return ffi::Error::Success();
}

// Checks a grouped product's shapes: x [X, K], w [L, G, N, K] (L >= 1 stacked layers, the
// product uses layer `layer`), sizes [G], x_rows and y_rows [M] or empty, y [M, N] (M = X
// without x_rows); sets m, n, k and the layer's offset.
template <typename XBuffer, typename WBuffer, typename RowBuffer, typename YBuffer>
ffi::Error GroupedShape(const XBuffer& x, const WBuffer& w, int64_t groups,
                        const RowBuffer& x_rows, const RowBuffer& y_rows, const YBuffer& y,
                        int64_t layer, int64_t& m, int64_t& n, int64_t& k, int64_t& offset) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const auto y_dims = y.dimensions();
  if (x_dims.size() != 2 || w_dims.size() < 3 || y_dims.size() != 2 ||
      x_dims.back() != w_dims.back()) {
    return ffi::Error::InvalidArgument("grouped matmul: x [X, K], w [.., G, N, K], y [M, N]");
  }
  m = y_dims[0], k = x_dims[1], n = w_dims[w_dims.size() - 2];
  const int64_t x_count = static_cast<int64_t>(x_rows.element_count());
  const int64_t y_count = static_cast<int64_t>(y_rows.element_count());
  if (w_dims[w_dims.size() - 3] != groups || y_dims[1] != n || (x_count != 0 && x_count != m) ||
      (x_count == 0 && x_dims[0] != m) || (y_count != 0 && y_count != m)) {
    return ffi::Error::InvalidArgument("grouped matmul: mismatched groups, rows or outputs");
  }
  const int64_t weight = groups * n * k;
  const int64_t layers = weight == 0 ? 0 : static_cast<int64_t>(w.element_count()) / weight;
  if (weight > 0 && (layer < 0 || layer >= layers)) {
    return ffi::Error::InvalidArgument("grouped matmul: layer out of range");
  }
  offset = layer * weight;
  return ffi::Error::Success();
}

const int32_t* RowsOrNull(const ffi::Buffer<ffi::S32>& rows) {
  return rows.element_count() == 0 ? nullptr : rows.typed_data();
}

ffi::Error F32GroupedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> sizes,
                            ffi::Buffer<ffi::S32> x_rows, ffi::Buffer<ffi::S32> y_rows,
                            ffi::Buffer<ffi::S32> layer, bool fixed_order,
                            ffi::ResultBuffer<ffi::F32> y) {
  int64_t m, n, k, offset;
  const int64_t groups = sizes.element_count();
  if (ffi::Error e = GroupedShape(x, w, groups, x_rows, y_rows, *y, layer.typed_data()[0], m, n,
                                  k, offset);
      e.failure()) {
    return e;
  }
  return RunGrouped<float>(pool, x.typed_data(), x.dimensions()[0], w.typed_data() + offset,
                           nullptr, sizes.typed_data(), groups, RowsOrNull(x_rows),
                           RowsOrNull(y_rows), m, n, k, fixed_order, y->typed_data());
}

ffi::Error Int8GroupedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> scale,
                             ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::S32> x_rows,
                             ffi::Buffer<ffi::S32> y_rows, ffi::Buffer<ffi::S32> layer,
                             bool fixed_order, ffi::ResultBuffer<ffi::F32> y) {
  int64_t m, n, k, offset;
  const int64_t groups = sizes.element_count();
  if (ffi::Error e = GroupedShape(x, w, groups, x_rows, y_rows, *y, layer.typed_data()[0], m, n,
                                  k, offset);
      e.failure()) {
    return e;
  }
  if (static_cast<int64_t>(scale.element_count()) != groups * n) {
    return ffi::Error::InvalidArgument("grouped matmul: scale must be [G, N]");
  }
  return RunGrouped<int8_t>(pool, x.typed_data(), x.dimensions()[0], w.typed_data() + offset,
                            scale.typed_data(), sizes.typed_data(), groups, RowsOrNull(x_rows),
                            RowsOrNull(y_rows), m, n, k, fixed_order, y->typed_data());
}

// int4 experts: x [X, K], qs [L, G, N, K / 2], scale and bias [L, G, N, K / S] (S the group
// size, a multiple of 32), float32 or float16 each; otherwise as F32GroupedMatmul.
ffi::Error Int4GroupedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::U8> qs, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                             ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::S32> x_rows,
                             ffi::Buffer<ffi::S32> y_rows, ffi::Buffer<ffi::S32> layer,
                             bool fixed_order, bool int8_activations, bool avx512,
                             ffi::ResultBuffer<ffi::F32> y) {
  if (ffi::Error error = Int4Isa(avx512); error.failure()) return error;
  const auto x_dims = x.dimensions();
  const auto q_dims = qs.dimensions();
  const auto y_dims = y->dimensions();
  const int64_t groups = sizes.element_count();
  if (x_dims.size() != 2 || q_dims.size() < 3 || y_dims.size() != 2 ||
      x_dims[1] != 2 * q_dims.back() || q_dims[q_dims.size() - 3] != groups ||
      y_dims[1] != q_dims[q_dims.size() - 2]) {
    return ffi::Error::InvalidArgument(
        "grouped int4 matmul: x [X, K], qs [.., G, N, K / 2], y [M, N]");
  }
  const int64_t m = y_dims[0], k = x_dims[1], n = y_dims[1];
  const int64_t x_count = static_cast<int64_t>(x_rows.element_count());
  const int64_t y_count = static_cast<int64_t>(y_rows.element_count());
  if ((x_count != 0 && x_count != m) || (x_count == 0 && x_dims[0] != m) ||
      (y_count != 0 && y_count != m)) {
    return ffi::Error::InvalidArgument("grouped int4 matmul: mismatched rows");
  }
  const int64_t weight = groups * n * k / 2;
  const int64_t layers = weight == 0 ? 0 : static_cast<int64_t>(qs.element_count()) / weight;
  const int64_t params = static_cast<int64_t>(scale.element_count());
  const auto is_float = [](const ffi::AnyBuffer& b) {
    return b.element_type() == ffi::DataType::F32 || b.element_type() == ffi::DataType::F16;
  };
  if (weight == 0 || m == 0) {
    std::fill(y->typed_data(), y->typed_data() + m * n, 0.0f);
    return ffi::Error::Success();
  }
  if (k % 32 != 0 || !is_float(scale) || !is_float(bias) ||
      static_cast<int64_t>(bias.element_count()) != params || params % (layers * groups * n) ||
      params == 0) {
    return ffi::Error::InvalidArgument(
        "grouped int4 matmul: scale and bias [L, G, N, K / S], float32 or float16");
  }
  const int64_t per_row = params / (layers * groups * n);
  const int64_t index = layer.typed_data()[0];
  if (k % per_row != 0 || (k / per_row) % 32 != 0 || index < 0 || index >= layers) {
    return ffi::Error::InvalidArgument(
        "grouped int4 matmul: the group size must be a multiple of 32; layer in range");
  }
  Int4Groups int4;
  int4.group = k / per_row;
  int4.scale_f16 = scale.element_type() == ffi::DataType::F16;
  int4.bias_f16 = bias.element_type() == ffi::DataType::F16;
  const int64_t layer_params = groups * n * per_row;
  int4.scale = static_cast<const char*>(scale.untyped_data()) +
               index * layer_params * (int4.scale_f16 ? 2 : 4);
  int4.bias = static_cast<const char*>(bias.untyped_data()) +
              index * layer_params * (int4.bias_f16 ? 2 : 4);
  int4.int8_activations = int8_activations;
  int4.avx512 = avx512;
  return RunGrouped<uint8_t>(pool, x.typed_data(), x_dims[0], qs.typed_data() + index * weight,
                             nullptr, sizes.typed_data(), groups, RowsOrNull(x_rows),
                             RowsOrNull(y_rows), m, n, k, fixed_order, y->typed_data(), int4);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferInt4GroupedMatmul, Int4GroupedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [X, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // qs [L, G, N, K / 2]
                                  .Arg<ffi::AnyBuffer>()         // scale [L, G, N, K / S]
                                  .Arg<ffi::AnyBuffer>()         // bias
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group sizes [G]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // x_rows [M] or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // y_rows [M] or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Attr<bool>("fixed_order")
                                  .Attr<bool>("int8_activations")
                                  .Attr<bool>("avx512")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferF32GroupedMatmul, F32GroupedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [X, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [L, G, N, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group sizes [G]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // x_rows [M] or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // y_rows [M] or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Attr<bool>("fixed_order")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferInt8GroupedMatmul, Int8GroupedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [X, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // w [L, G, N, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [G, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group sizes [G]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // x_rows [M] or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // y_rows [M] or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Attr<bool>("fixed_order")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // w [..., K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Attr<bool>("fixed_order")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferInt4Matmul, Int4Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // qs [..., N, K / 2]
                                  .Arg<ffi::AnyBuffer>()         // scale [..., N, K / G]
                                  .Arg<ffi::AnyBuffer>()         // bias [..., N, K / G]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Attr<bool>("fixed_order")
                                  .Attr<bool>("int8_activations")
                                  .Attr<bool>("avx512")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferF32Matmul, F32Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [..., K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Attr<bool>("fixed_order")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
);

// Whether this CPU runs the kernels (they are compiled for AVX2 and FMA).
extern "C" int jaxinfer_matmul_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

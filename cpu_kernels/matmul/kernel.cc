// y[M, N] = (x[M, K] . w[N, K]^T) (* scale[N]): float32 activations times "out_in" weights
// that are float32, or int8 with one float32 scale per output row; for XLA:CPU through the
// XLA FFI (AVX2 + FMA).
//
// XLA:CPU runs these products of a decode step (few rows of x against a large weight) well
// below the machine's rates, and has no fast int8 path at all: converting int8 weights inside
// a dot ran several times slower than float32 here. This kernel:
// - up to 3 rows of x: streams each weight row once, 32 values at a time, into accumulators
//   per row of x (memory-bound: int8 reads a quarter of float32's bytes). Against int8
//   weights these rows of x are rounded to int16 (one scale per row: a relative error of at
//   most 1.5e-5 of the row's largest value, far below the int8 weights' own) and multiplied
//   in integers;
// - more rows: takes a tile of 16 weight rows as float32 (int8 is converted once into a
//   buffer that stays in cache) and multiplies it into 3 x 4 blocks of (rows of x) x (rows of
//   w), each a dot product along K.
// Tiles of 16 output columns are shared out over XLA's intra-op threads (common.h).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 16;  // weight rows (output columns) per claimed unit of work
// Claims of a large weight streamed by up to 3 rows (an LM head): longer sequential runs per
// claim read faster here (the default model's int8 head, one row: 1.2-1.8 against 2.3 ms);
// smaller weights keep 16-row claims, which split them more evenly over the threads.
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

  void Store(int64_t row, int64_t col, float value) const {
    y[row * n + col] = scale == nullptr ? value : value * scale[col];
  }
};

// Rows [0, MR) of x times float32 weight row `col`.
template <int MR>
void StreamRow(const Problem<float>& p, int64_t col) {
  __m256 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < 4; ++q) acc[i][q] = _mm256_setzero_ps();
  const float* w = p.w + col * p.k;
  const int64_t k32 = p.k & ~int64_t{31};
  for (int64_t kk = 0; kk < k32; kk += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + kk) + 1024, _MM_HINT_T0);
    for (int q = 0; q < 4; ++q) {
      const __m256 wv = _mm256_loadu_ps(w + kk + 8 * q);
      for (int i = 0; i < MR; ++i)
        acc[i][q] = _mm256_fmadd_ps(_mm256_loadu_ps(p.x + i * p.k + kk + 8 * q), wv, acc[i][q]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    float s = jaxinfer::Sum(_mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]),
                                _mm256_add_ps(acc[i][2], acc[i][3])));
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
    for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_si256();
    for (int64_t kk = start; kk < stop; kk += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kk) + 1024, _MM_HINT_T0);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kk));
      const __m256i lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
      const __m256i hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
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

// Rows [m0, m0 + MR) of x times tile rows [j0, j0 + NR) of `tile` [rows, K] (float32), whose
// row 0 is weight row `col0`.
template <int MR, int NR, typename W>
void TileBlock(const Problem<W>& p, const float* tile, int64_t col0, int64_t m0, int64_t j0) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t k8 = p.k & ~int64_t{7};
  for (int64_t kk = 0; kk < k8; kk += 8) {
    __m256 w[NR];
    for (int j = 0; j < NR; ++j) w[j] = _mm256_loadu_ps(tile + (j0 + j) * p.k + kk);
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_loadu_ps(p.x + (m0 + i) * p.k + kk);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(x, w[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = jaxinfer::Sum(acc[i][j]);
      for (int64_t kk = k8; kk < p.k; ++kk)
        s += p.x[(m0 + i) * p.k + kk] * tile[(j0 + j) * p.k + kk];
      p.Store(m0 + i, col0 + j0 + j, s);
    }
}

template <int MR, typename W>
void TileRows(const Problem<W>& p, const float* tile, int64_t col0, int64_t rows, int64_t m0) {
  int64_t j = 0;
  for (; j + 4 <= rows; j += 4) TileBlock<MR, 4>(p, tile, col0, m0, j);
  for (; j < rows; ++j) TileBlock<MR, 1>(p, tile, col0, m0, j);
}

// The weight rows [col0, col0 + rows) as float32: the weights themselves, or int8 converted
// into a per-thread buffer.
inline const float* AsFloat(const float* w, int64_t count) { return w; }

inline const float* AsFloat(const int8_t* w, int64_t count) {
  thread_local std::vector<float> buffer;
  buffer.resize(count);
  float* out = buffer.data();
  const int64_t c8 = count & ~int64_t{7};
  for (int64_t i = 0; i < c8; i += 8) _mm256_storeu_ps(out + i, Load8(w + i));
  for (int64_t i = c8; i < count; ++i) out[i] = static_cast<float>(w[i]);
  return out;
}

// Output columns [col0, col1) for every row of x.
template <typename W>
void Columns(const Problem<W>& p, int64_t col0, int64_t col1) {
  if (p.m <= 3) {
    for (int64_t col = col0; col < col1; ++col) {
      if constexpr (std::is_same_v<W, int8_t>) {
        if (p.m == 1) StreamRowInt16<1>(p, col);
        if (p.m == 2) StreamRowInt16<2>(p, col);
        if (p.m == 3) StreamRowInt16<3>(p, col);
      } else {
        if (p.m == 1) StreamRow<1>(p, col);
        if (p.m == 2) StreamRow<2>(p, col);
        if (p.m == 3) StreamRow<3>(p, col);
      }
    }
    return;
  }
  const int64_t rows = col1 - col0;
  const float* tile = AsFloat(p.w + col0 * p.k, rows * p.k);
  int64_t m = 0;
  for (; m + 3 <= p.m; m += 3) TileRows<3>(p, tile, col0, rows, m);
  if (p.m - m == 2) TileRows<2>(p, tile, col0, rows, m);
  if (p.m - m == 1) TileRows<1>(p, tile, col0, rows, m);
}

template <typename W>
ffi::Error Run(ffi::ThreadPool& pool, const Problem<W>& p) {
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  const int64_t columns = p.m <= 3 && p.n >= kStreamMinColumns ? kStreamColumns : kTile;
  jaxinfer::ParallelFor(pool, (p.n + columns - 1) / columns, [&p, columns](int64_t t) {
    Columns(p, t * columns, std::min(p.n, (t + 1) * columns));
  });
  return ffi::Error::Success();
}

// Checks the shapes and sets p.m, p.n; x [..., K], w [..., K], y [M, N].
template <typename W, typename XBuffer, typename WBuffer, typename YBuffer>
ffi::Error Shape(Problem<W>& p, const XBuffer& x, const WBuffer& w, const YBuffer& y) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  if (x_dims.size() < 1 || w_dims.size() < 1 || x_dims.back() != w_dims.back()) {
    return ffi::Error::InvalidArgument("matmul: x and w must share their last axis");
  }
  p.k = w_dims.back();
  p.m = p.k == 0 ? 0 : static_cast<int64_t>(x.element_count()) / p.k;
  p.n = p.k == 0 ? 0 : static_cast<int64_t>(w.element_count()) / p.k;
  if (static_cast<int64_t>(y.element_count()) != p.m * p.n) {
    return ffi::Error::InvalidArgument("matmul: output size mismatch");
  }
  return ffi::Error::Success();
}

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                      ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  Problem<int8_t> p{x.typed_data(), w.typed_data(), scale.typed_data(), y->typed_data()};
  if (ffi::Error error = Shape(p, x, w, *y); error.failure()) return error;
  if (static_cast<int64_t>(scale.element_count()) != p.n) {
    return ffi::Error::InvalidArgument("matmul: scale must have one value per output row");
  }
  std::vector<int16_t> xq;
  float x_scale[3];
  if (p.m <= 3) {
    xq.resize(p.m * p.k);
    RoundRows(p.x, p.m, p.k, xq.data(), x_scale);
    p.xq = xq.data();
    p.x_scale = x_scale;
  }
  return Run(pool, p);
}

ffi::Error F32Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> y) {
  Problem<float> p{x.typed_data(), w.typed_data(), nullptr, y->typed_data()};
  if (ffi::Error error = Shape(p, x, w, *y); error.failure()) return error;
  return Run(pool, p);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // w [..., K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [N]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferF32Matmul, F32Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [..., K]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
);

// Whether this CPU runs the kernels (they are compiled for AVX2 and FMA).
extern "C" int jaxinfer_matmul_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// y[M, N] = (x[M, K] . w[N, K]^T) * scale[N]: float32 activations times int8 weights with one
// float32 scale per output row, for XLA:CPU through the XLA FFI (AVX2 + FMA).
//
// XLA:CPU has no fast path for this product: converting int8 weights inside a dot, or an int8
// dot, ran several times slower than the float32 product here. This kernel reads each weight
// once as int8 (a quarter of float32's bytes, which is what bounds a decode step with few
// rows) and converts it in registers:
// - up to 3 rows: each group of 4 weight rows is converted 8 values at a time and multiplied
//   into every row's accumulators directly;
// - more rows: a tile of 16 weight rows is converted once into a float32 buffer (in L2) and
//   multiplied into 3 x 4 blocks of (rows of x) x (rows of w).
// Tiles of output columns are claimed from an atomic counter by the calling thread and by
// tasks on XLA's intra-op thread pool, so a task that starts late finds nothing left to do
// and the caller never waits on work nobody has started.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 16;  // weight rows (output columns) per claimed unit of work

inline __m256 LoadInt8(const int8_t* p) {  // 8 x int8 -> 8 x float
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float Sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

struct Problem {
  const float* x;  // [M, K]
  const int8_t* w;  // [N, K]
  const float* scale;  // [N]
  float* y;  // [M, N]
  int64_t m, n, k;
};

// Rows [m0, m0 + MR) of x times weight rows [n0, n0 + NR), weights converted in registers.
template <int MR, int NR>
void DirectBlock(const Problem& p, int64_t m0, int64_t n0) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t k8 = p.k & ~int64_t{7};
  for (int64_t kk = 0; kk < k8; kk += 8) {
    __m256 w[NR];
    for (int j = 0; j < NR; ++j) w[j] = LoadInt8(p.w + (n0 + j) * p.k + kk);
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_loadu_ps(p.x + (m0 + i) * p.k + kk);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(x, w[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = Sum(acc[i][j]);
      for (int64_t kk = k8; kk < p.k; ++kk)
        s += p.x[(m0 + i) * p.k + kk] * static_cast<float>(p.w[(n0 + j) * p.k + kk]);
      p.y[(m0 + i) * p.n + n0 + j] = s * p.scale[n0 + j];
    }
}

// Rows [m0, m0 + MR) of x times NR rows of an already converted float tile `wf` [rows, K]
// whose first row is weight row `n_base`; `j0` is the first tile row used.
template <int MR, int NR>
void TileBlock(const Problem& p, const float* wf, int64_t n_base, int64_t m0, int64_t j0) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t k8 = p.k & ~int64_t{7};
  for (int64_t kk = 0; kk < k8; kk += 8) {
    __m256 w[NR];
    for (int j = 0; j < NR; ++j) w[j] = _mm256_loadu_ps(wf + (j0 + j) * p.k + kk);
    for (int i = 0; i < MR; ++i) {
      const __m256 x = _mm256_loadu_ps(p.x + (m0 + i) * p.k + kk);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(x, w[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = Sum(acc[i][j]);
      for (int64_t kk = k8; kk < p.k; ++kk) s += p.x[(m0 + i) * p.k + kk] * wf[(j0 + j) * p.k + kk];
      const int64_t n = n_base + j0 + j;
      p.y[(m0 + i) * p.n + n] = s * p.scale[n];
    }
}


// 32 int8 -> 4 x 8 floats.
inline void Load32(const int8_t* p, __m256 out[4]) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

// Rows [0, MR) of x times weight row n: one weight row streamed 32 values at a time, with
// four accumulators per row of x so that no FMA waits on the one before it.
template <int MR>
void DirectRow(const Problem& p, int64_t n) {
  __m256 acc[MR][4];
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < 4; ++q) acc[i][q] = _mm256_setzero_ps();
  const int8_t* w = p.w + n * p.k;
  const int64_t k32 = p.k & ~int64_t{31};
  for (int64_t kk = 0; kk < k32; kk += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + kk) + 1024, _MM_HINT_T0);
    __m256 wv[4];
    Load32(w + kk, wv);
    for (int i = 0; i < MR; ++i)
      for (int q = 0; q < 4; ++q)
        acc[i][q] = _mm256_fmadd_ps(_mm256_loadu_ps(p.x + i * p.k + kk + 8 * q), wv[q], acc[i][q]);
  }
  for (int i = 0; i < MR; ++i) {
    float s = Sum(_mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]), _mm256_add_ps(acc[i][2], acc[i][3])));
    for (int64_t kk = k32; kk < p.k; ++kk) s += p.x[i * p.k + kk] * static_cast<float>(w[kk]);
    p.y[i * p.n + n] = s * p.scale[n];
  }
}

template <int MR>
void DirectRows(const Problem& p, int64_t m0, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) DirectRow<MR>(p, n);
}

template <int MR>
void TileRows(const Problem& p, const float* wf, int64_t n0, int64_t rows, int64_t m0) {
  int64_t j = 0;
  for (; j + 4 <= rows; j += 4) TileBlock<MR, 4>(p, wf, n0, m0, j);
  for (; j < rows; ++j) TileBlock<MR, 1>(p, wf, n0, m0, j);
}

// Output columns [n0, n1) for every row of x.
void Columns(const Problem& p, int64_t n0, int64_t n1) {
  if (p.m <= 3) {
    if (p.m == 1) DirectRows<1>(p, 0, n0, n1);
    if (p.m == 2) DirectRows<2>(p, 0, n0, n1);
    if (p.m == 3) DirectRows<3>(p, 0, n0, n1);
    return;
  }
  thread_local std::vector<float> buffer;
  const int64_t rows = n1 - n0;
  buffer.resize(rows * p.k);
  float* wf = buffer.data();
  const int8_t* src = p.w + n0 * p.k;
  const int64_t count = rows * p.k, c8 = count & ~int64_t{7};
  for (int64_t i = 0; i < c8; i += 8) _mm256_storeu_ps(wf + i, LoadInt8(src + i));
  for (int64_t i = c8; i < count; ++i) wf[i] = static_cast<float>(src[i]);
  int64_t m = 0;
  for (; m + 3 <= p.m; m += 3) TileRows<3>(p, wf, n0, rows, m);
  if (p.m - m == 2) TileRows<2>(p, wf, n0, rows, m);
  if (p.m - m == 1) TileRows<1>(p, wf, n0, rows, m);
}

struct Claims {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Claims tiles until none are left; returns after the last one it claimed.
void Work(const Problem& p, Claims& claims, int64_t tiles) {
  for (int64_t t; (t = claims.next.fetch_add(1, std::memory_order_relaxed)) < tiles;) {
    Columns(p, t * kTile, std::min(p.n, (t + 1) * kTile));
    claims.done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> scale,
                          ffi::ResultBuffer<ffi::F32> y) {
  const auto w_dims = w.dimensions();
  const auto x_dims = x.dimensions();
  if (w_dims.size() < 1 || x_dims.size() < 1) {
    return ffi::Error::InvalidArgument("int8_matmul: x and w need at least one axis");
  }
  const int64_t k = w_dims.back();
  if (x_dims.back() != k) {
    return ffi::Error::InvalidArgument("int8_matmul: x and w differ in their last axis");
  }
  Problem p{x.typed_data(), w.typed_data(), scale.typed_data(), y->typed_data(), 0, 0, k};
  p.m = k == 0 ? 0 : static_cast<int64_t>(x.element_count()) / k;
  p.n = k == 0 ? 0 : static_cast<int64_t>(w.element_count()) / k;
  if (static_cast<int64_t>(scale.element_count()) != p.n ||
      static_cast<int64_t>(y->element_count()) != p.m * p.n) {
    return ffi::Error::InvalidArgument("int8_matmul: scale or output size mismatch");
  }
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  const int64_t tiles = (p.n + kTile - 1) / kTile;
  auto claims = std::make_shared<Claims>();
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, tiles - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    // A helper that starts after the work is done claims nothing and touches no buffer.
    pool.Schedule([p, claims, tiles] { Work(p, *claims, tiles); });
  }
  Work(p, *claims, tiles);
  for (int spins = 0; claims->done.load(std::memory_order_acquire) < tiles; ++spins) {
    if (spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferInt8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // w [..., K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale [N]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
);

// Whether this CPU runs the kernel (it is compiled for AVX2 and FMA).
extern "C" int jaxinfer_int8_matmul_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

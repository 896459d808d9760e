// y[M, N] = x[M, K] . W[N, K]^T for weights kept in llama.cpp's block formats, for XLA:CPU
// through the XLA FFI (AVX2 + FMA). K is split into blocks of 32 values:
// - Q4_1: W[n, 32 b + j] = d[n, b] * q + m[n, b], q the 4-bit value j of the block (bytes
//   `qs` hold values j and j + 16 in their low and high nibbles);
// - Q8_0: W[n, 32 b + j] = d[n, b] * q, q the int8 value j.
// Each block is dequantized in registers to exactly the float32 values the gguf package gives
// (a float32 multiply, then for Q4_1 an add: d is a float16 value, so d * q is exact in float32
// and a fused multiply-add rounds the same once), and summed the way the
// float32 kernel (cpu_kernels/matmul) sums a weight row streamed against up to 3 rows of x:
// four accumulators per row of x over steps of 32 values, added pairwise at the end. So for
// those rows the products are bit-identical to the float32 kernel's on the dequantized weights,
// while reading 0.75 (Q4_1) or 1.125 (Q8_0) bytes per weight instead of 4: a decode step of
// a few tokens is bound by reading the weights.
// More rows of x are taken 3 at a time (each block is then dequantized once per 3 rows).
//
// Weights may be one layer of stacked weights [L, N, ...], read in place at index `layer`.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;
// Claims of output columns: a quarter of the weight (each thread streams long contiguous
// runs), at least 16 columns; 64 columns for a large weight (an LM head), as the float32 kernel.
constexpr int64_t kMinClaim = 16, kClaims = 4, kLargeClaim = 64, kLargeColumns = 16384;

enum class Format { kQ4_1, kQ8_0 };

struct Problem {
  const float* x;  // [M, K]
  const uint8_t* qs;  // Q4_1: [N, K / 2] nibbles; Q8_0: [N, K] int8
  const float* scales;  // Q4_1: [N, K / 32, 2] (d, m); Q8_0: [N, K / 32] (d)
  float* y;  // [M, N]
  int64_t m, n, k;
};

// The 32 weights of one block, exactly dequantized, in 4 vectors of 8 (values 8q .. 8q + 7).
template <Format F>
__attribute__((always_inline)) inline void Dequantize(const uint8_t* qs, const float* scales,
                                                      __m256 (&w)[4]) {
  if constexpr (F == Format::kQ4_1) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);  // values 0 .. 15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);  // values 16 .. 31
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    const __m256 d = _mm256_broadcast_ss(scales), m = _mm256_broadcast_ss(scales + 1);
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) w[q] = _mm256_fmadd_ps(w[q], d, m);
  } else {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    const __m128i lo = _mm256_castsi256_si128(bytes), hi = _mm256_extracti128_si256(bytes, 1);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    const __m256 d = _mm256_broadcast_ss(scales);
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) w[q] = _mm256_mul_ps(w[q], d);
  }
}

// Values 8q .. 8q + 7 of one block alone, read from memory: for 2 rows of x, whose 8
// accumulators and a whole dequantized block made GCC spill accumulators (30-layer FFN scan:
// 0.48-0.55x the float32 kernel's time this way against 0.77x). For 3 rows this way was
// slower still (0.96x against 0.70-0.79x): the whole block stays.
template <Format F>
__attribute__((always_inline)) inline __m256 DequantizeVector(const uint8_t* qs,
                                                              const float* scales, int q) {
  if constexpr (F == Format::kQ4_1) {
    __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * (q & 1)));
    if (q >= 2) bytes = _mm_srli_epi16(bytes, 4);
    const __m128i values = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(values)),
                           _mm256_broadcast_ss(scales), _mm256_broadcast_ss(scales + 1));
  } else {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * q));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)),
                         _mm256_broadcast_ss(scales));
  }
}

template <Format F>
constexpr int64_t kBlockBytes = F == Format::kQ4_1 ? kBlock / 2 : kBlock;
template <Format F>
constexpr int64_t kBlockScales = F == Format::kQ4_1 ? 2 : 1;

// Rows [m0, m0 + MR) of x times weight row `col`.
template <Format F, int MR>
void StreamRow(const Problem& p, int64_t col, int64_t m0) {
  __m256 acc[MR][4];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) acc[i][q] = _mm256_setzero_ps();
  const int64_t blocks = p.k / kBlock;
  const uint8_t* qs = p.qs + col * blocks * kBlockBytes<F>;
  const float* scales = p.scales + col * blocks * kBlockScales<F>;
  const float* x = p.x + m0 * p.k;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = qs + b * kBlockBytes<F>;
    const float* block_scales = scales + b * kBlockScales<F>;
    __m256 w[4];
    if constexpr (MR != 2) Dequantize<F>(block, block_scales, w);
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      if constexpr (MR == 2) w[q] = DequantizeVector<F>(block, block_scales, q);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i)
        acc[i][q] =
            _mm256_fmadd_ps(_mm256_loadu_ps(x + i * p.k + b * kBlock + 8 * q), w[q], acc[i][q]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    p.y[(m0 + i) * p.n + col] = jaxinfer::Sum(_mm256_add_ps(
        _mm256_add_ps(acc[i][0], acc[i][1]), _mm256_add_ps(acc[i][2], acc[i][3])));
  }
}

template <Format F>
void Column(const Problem& p, int64_t col) {
  int64_t m0 = 0;
  for (; m0 + 3 <= p.m; m0 += 3) StreamRow<F, 3>(p, col, m0);
  if (p.m - m0 == 2) StreamRow<F, 2>(p, col, m0);
  if (p.m - m0 == 1) StreamRow<F, 1>(p, col, m0);
}

template <Format F>
ffi::Error Run(ffi::ThreadPool& pool, const Problem& p) {
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  const int64_t columns =
      p.n >= kLargeColumns ? kLargeClaim : std::max(kMinClaim, (p.n + kClaims - 1) / kClaims);
  jaxinfer::ParallelFor(pool, (p.n + columns - 1) / columns, [&p, columns](int64_t t) {
    const int64_t stop = std::min(p.n, (t + 1) * columns);
    for (int64_t col = t * columns; col < stop; ++col) Column<F>(p, col);
  });
  return ffi::Error::Success();
}

// Checks the shapes (x [M, K], y [M, N] of y_count values, weights holding L >= 1 stacked layers of N rows) and
// points p at layer `layer`'s blocks.
template <Format F, typename QBuffer>
ffi::Error Shape(Problem& p, const ffi::Buffer<ffi::F32>& x, const QBuffer& qs,
                 const ffi::Buffer<ffi::F32>& scales, int64_t y_count, int64_t layer) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return ffi::Error::InvalidArgument("gguf_matmul: x must be [M, K]");
  p.m = x_dims[0];
  p.k = x_dims[1];
  if (p.k % kBlock != 0) {
    return ffi::Error::InvalidArgument("gguf_matmul: K must be a multiple of 32");
  }
  p.n = p.m == 0 ? 0 : y_count / p.m;
  if (p.m == 0 || p.n == 0 || p.k == 0) return ffi::Error::Success();
  const int64_t blocks = p.n * (p.k / kBlock);  // one layer's
  const int64_t layers = static_cast<int64_t>(qs.element_count()) / (blocks * kBlockBytes<F>);
  if (y_count != p.m * p.n || layers < 1 ||
      static_cast<int64_t>(qs.element_count()) != layers * blocks * kBlockBytes<F> ||
      static_cast<int64_t>(scales.element_count()) != layers * blocks * kBlockScales<F>) {
    return ffi::Error::InvalidArgument("gguf_matmul: weight blocks do not match x and y");
  }
  if (layer < 0 || layer >= layers) {
    return ffi::Error::InvalidArgument("gguf_matmul: layer out of range");
  }
  p.qs += layer * blocks * kBlockBytes<F>;
  p.scales += layer * blocks * kBlockScales<F>;
  return ffi::Error::Success();
}

ffi::Error Q4_1Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> qs,
                      ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> layer,
                      ffi::ResultBuffer<ffi::F32> y) {
  Problem p{x.typed_data(), qs.typed_data(), scales.typed_data(), y->typed_data()};
  if (ffi::Error error = Shape<Format::kQ4_1>(p, x, qs, scales, y->element_count(),
                                                    layer.typed_data()[0]);
      error.failure()) {
    return error;
  }
  return Run<Format::kQ4_1>(pool, p);
}

ffi::Error Q8_0Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> qs,
                      ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> layer,
                      ffi::ResultBuffer<ffi::F32> y) {
  Problem p{x.typed_data(), reinterpret_cast<const uint8_t*>(qs.typed_data()),
            scales.typed_data(), y->typed_data()};
  if (ffi::Error error = Shape<Format::kQ8_0>(p, x, qs, scales, y->element_count(),
                                                    layer.typed_data()[0]);
      error.failure()) {
    return error;
  }
  return Run<Format::kQ8_0>(pool, p);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferQ4_1Matmul, Q4_1Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // qs [..., N, K / 2]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [..., N, K / 32, 2]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferQ8_0Matmul, Q8_0Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // qs [..., N, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [..., N, K / 32]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
);

// Whether this CPU runs the kernel (it is compiled for AVX2 and FMA).
extern "C" int jaxinfer_gguf_matmul_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// y[M, N] = x[M, K] . W[N, K]^T for weights kept in llama.cpp's block formats exactly as a GGUF
// file stores them (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K: reference.py has the
// layouts), for XLA:CPU through the XLA FFI (AVX2 + FMA + F16C; AVX-512 VNNI where present).
//
// A weight is one layer's bytes `data[layer]` (u8[L, B]: the layers of a weight kind stacked,
// each padded to the longest) and a table of segments `table[layer]` (i32[L, S, 3]: format,
// rows, byte offset in the layer): runs of whole rows in one format, in output order. A fused
// projection whose parts differ in format (Q4_K_M keeps some V rows in Q6_K beside Q4_K Q and
// K) is one weight of several segments; a layer scan passes the whole stack and the index, so
// nothing is sliced or copied per layer. A MoE layer's experts are G weights per layer
// (data[layer * G + g]), each group of rows of x times its own (GGUFGroupedMatmul).
//
// Two ways to take the activations:
// - exact: each group of 32 weights is dequantized in registers to exactly the float32
//   values gguf's own dequantizer gives (every product of a float16 scale and a small integer
//   is exact in float32; where gguf rounds a product, this rounds the same product once), then
//   multiplied with float32 x by FMAs, up to 3 rows of x per pass over the weight row (Q4_K
//   on the AVX2 path reads each value from its own dword, x laid out to match: LaneWeights);
// - int8 activations (llama.cpp's): x is rounded to int8 once per call, per 32 values for the
//   32-value formats (Q8_0-style: a float scale and the block's sum) and per 256 values for
//   the k-quants (Q8_K-style: a float scale and sums per 16), and each group is an integer dot
//   product (vpmaddubsw of unsigned weight values by signed x, vpmaddwd by the group's integer
//   scale); a k-quant's sums stay integer over its 256 values, its minimums are the x sums
//   times the weight's minimums. Up to 4 rows of x per pass over the weight row.
// In both, a weight row is read from memory once per call and from L1 for further passes, so
// one row of x (a decode step) is bound by reading the blocks and many rows (prefill, a large
// batch) by the multiply-adds. Claims of output rows are shared out over XLA's intra-op
// threads (common.h). On a CPU with AVX-512 VNNI (the caller's `avx512_vnni`, checked here)
// the k-quants' integer products take the 512-bit paths below IntegerStream.
//
// The loader may lay runs of every format but Q5_1 and Q5_K out 16 rows at a time for the int8
// mode on AVX-512 VNNI (formats kQ4_0X16 ... kQ6_KX16; interleaved.h has their layouts and
// paths).
//
// GCC keeps arrays of vectors in registers only if the loops over them are fully unrolled;
// hence the unroll pragmas.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Formats by their GGML type numbers (gguf.GGMLQuantizationType).
enum Format : int32_t {
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  // Not GGML types: rows interleaved 16 at a time by the loader (interleaved.h).
  kQ4_0X16 = 102,
  kQ4_1X16 = 103,
  kQ5_0X16 = 106,
  kQ8_0X16 = 108,
  kQ4_KX16 = 112,
  kQ6_KX16 = 114,
};

inline bool Interleaved(int32_t f) {
  return f == kQ4_0X16 || f == kQ4_1X16 || f == kQ5_0X16 || f == kQ8_0X16 || f == kQ4_KX16 ||
         f == kQ6_KX16;
}

template <int F>
constexpr bool kSuper = F == kQ4_K || F == kQ5_K || F == kQ6_K;  // 256 values a block
template <int F>
constexpr int64_t kValues = kSuper<F> ? 256 : 32;
template <int F>
constexpr int64_t kBytes = F == kQ4_0   ? 18
                           : F == kQ4_1 ? 20
                           : F == kQ5_0 ? 22
                           : F == kQ5_1 ? 24
                           : F == kQ8_0 ? 34
                           : F == kQ4_K ? 144
                           : F == kQ5_K ? 176
                                        : 210;

int64_t BlockValues(int32_t f) {
  return f == kQ4_K || f == kQ5_K || f == kQ6_K || f == kQ4_KX16 || f == kQ6_KX16 ? 256 : 32;
}
int64_t BlockBytes(int32_t f) {
  switch (f) {
    case kQ4_0: return kBytes<kQ4_0>;
    case kQ4_1: return kBytes<kQ4_1>;
    case kQ5_0: return kBytes<kQ5_0>;
    case kQ5_1: return kBytes<kQ5_1>;
    case kQ8_0: return kBytes<kQ8_0>;
    case kQ4_K: return kBytes<kQ4_K>;
    case kQ5_K: return kBytes<kQ5_K>;
    case kQ6_K: return kBytes<kQ6_K>;
    case kQ4_0X16: return kBytes<kQ4_0>;  // a row's share of an interleaved tile (interleaved.h)
    case kQ4_1X16: return kBytes<kQ4_1>;
    case kQ5_0X16: return kBytes<kQ5_0>;
    case kQ8_0X16: return kBytes<kQ8_0>;
    case kQ4_KX16: return 148;
    case kQ6_KX16: return 210;
    default: return 0;
  }
}

inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 16 bytes of nibbles (value j in the low nibble of byte j, value j + 16 in its high nibble)
// -> 32 values, in order.
inline __m256i Nibbles(const uint8_t* qs) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask),
                          _mm_and_si128(bytes, mask));
}

// Bit j of 4 bytes -> byte j = 0x10 where set (the fifth bit of Q5_0 / Q5_1 value j).
inline __m256i FifthBits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// Q4_K / Q5_K: the 8 groups' 6-bit scales (bytes 0-7) and minimums (bytes 8-15) of the 12
// packed bytes (llama.cpp's get_scale_min_k4, four groups at a time).
inline void KScales(const uint8_t* packed, uint8_t (&out)[16]) {
  uint32_t u[4];
  std::memcpy(u, packed, 12);
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  u[3] = ((u[2] >> 4) & kLow4) | (((u[1] >> 6) & kLow2) << 4);
  const uint32_t mins = u[1] & kLow6;
  u[1] = (u[2] & kLow4) | (((u[0] >> 6) & kLow2) << 4);
  u[2] = mins;
  u[0] &= kLow6;
  std::memcpy(out, u, 16);
}

// One block (or superblock) of a weight row, decoded for its groups of 32:
// - v(g): the group's 32 values as bytes, unsigned (0 .. 63), but for Q8_0 signed;
// - exact: value = fma(q, scale, offset) with q = v - bias (bias: 8, 16, 32 or 0), scale
//   per half of 16 values (equal halves but for Q6_K);
// - integer: weight = d * sc(g) * v + mn terms (see the int8 paths).
template <int F>
struct Block {
  const uint8_t* p;
  float d = 0, dmin = 0;
  uint8_t k_scales[16];  // Q4_K / Q5_K: sc[8], m[8]
  __m256i high;  // Q5_0 / Q5_1 fifth bits; Q5_K: the 32 qh bytes
  // The exact mode's float scales and offsets, formed for the whole block at once (each the
  // same single rounding of the same product as one at a time): Q4_K / Q5_K d sc[g] and
  // -(dmin m[g]) per group; Q6_K d scale per 16 values.
  alignas(32) float exact_scale[16];
  alignas(32) float exact_offset[8];

  explicit Block(const uint8_t* block) : p(block) {
    if constexpr (F == kQ4_0 || F == kQ5_0 || F == kQ8_0) {
      d = Half(p);
    } else if constexpr (F == kQ4_1 || F == kQ5_1) {
      d = Half(p);
      dmin = Half(p + 2);  // m
    } else if constexpr (F == kQ4_K || F == kQ5_K) {
      d = Half(p);
      dmin = Half(p + 2);
      KScales(p + 4, k_scales);
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(k_scales));
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
      const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
      _mm256_store_ps(exact_scale, _mm256_mul_ps(_mm256_set1_ps(d), sc));
      _mm256_store_ps(exact_offset, _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(dmin), mn),
                                                  _mm256_set1_ps(-0.0f)));
    } else {
      d = Half(p + 208);
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));
      const __m256 dv = _mm256_set1_ps(d);
      const __m256 low = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
      const __m256 high = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
      _mm256_store_ps(exact_scale, _mm256_mul_ps(dv, low));
      _mm256_store_ps(exact_scale + 8, _mm256_mul_ps(dv, high));
    }
    if constexpr (F == kQ5_0) high = FifthBits(p + 2);
    if constexpr (F == kQ5_1) high = FifthBits(p + 4);
    if constexpr (F == kQ5_K) high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  }

  __m256i v(int g) const {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    if constexpr (F == kQ4_0) return Nibbles(p + 2);
    if constexpr (F == kQ4_1) return Nibbles(p + 4);
    if constexpr (F == kQ5_0) return _mm256_or_si256(Nibbles(p + 6), high);
    if constexpr (F == kQ5_1) return _mm256_or_si256(Nibbles(p + 8), high);
    if constexpr (F == kQ8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
    if constexpr (F == kQ4_K || F == kQ5_K) {
      // 4 chunks of 32 bytes: group 2c in the low nibbles of chunk c, group 2c + 1 in the high.
      const uint8_t* chunk = p + (F == kQ4_K ? 16 : 48) + 32 * (g >> 1);
      __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
      if (g & 1) bytes = _mm256_srli_epi16(bytes, 4);
      __m256i q = _mm256_and_si256(bytes, mask);
      if constexpr (F == kQ5_K) {
        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(high, g), _mm256_set1_epi8(1));
        q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
      }
      return q;
    }
    if constexpr (F == kQ6_K) {
      // group g = 4 h + i: low 4 bits from ql[64 h + 32 (i & 1) + l] (nibble i >> 1), high 2
      // bits from qh[32 h + l] (bits 2 i, 2 i + 1).
      const int h = g >> 2, i = g & 3;
      __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32 * (i & 1)));
      if (i >> 1) low = _mm256_srli_epi16(low, 4);
      __m256i top = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
      top = _mm256_and_si256(_mm256_srli_epi16(top, 2 * i), _mm256_set1_epi8(3));
      return _mm256_or_si256(_mm256_and_si256(low, mask), _mm256_slli_epi16(top, 4));
    }
  }

  // exact: q = v - bias, and the scale of half h (0, 1) and the offset of group g.
  static constexpr int kBias = F == kQ4_0 ? 8 : F == kQ5_0 ? 16 : F == kQ6_K ? 32 : 0;
  float scale(int g, int h) const {
    if constexpr (F == kQ4_K || F == kQ5_K) return exact_scale[g];
    if constexpr (F == kQ6_K) return exact_scale[2 * g + h];
    return d;
  }
  // The 32-value formats with unsigned values v (Q8_0's signed ones offset by 128):
  // weight = d v + unsigned_offset().
  float unsigned_offset() const {
    return F == kQ4_1 || F == kQ5_1 ? dmin
           : F == kQ4_0             ? -8.0f * d
           : F == kQ5_0             ? -16.0f * d
                                    : -128.0f * d;
  }
  float offset(int g) const {
    if constexpr (F == kQ4_K || F == kQ5_K) return exact_offset[g];
    if constexpr (F == kQ4_1 || F == kQ5_1) return dmin;
    return -0.0f;  // adds nothing, not even the sign of a zero product (d (q - bias) = -0.0)
  }
};

// The 32 exact weights of group g in 4 vectors of 8.
template <int F>
__attribute__((always_inline)) inline void Dequantize(const Block<F>& b, int g, __m256 (&w)[4]) {
  __m256i q = b.v(g);
  if constexpr (Block<F>::kBias != 0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(Block<F>::kBias));
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m256 offset = _mm256_set1_ps(b.offset(g));
  const __m256 s0 = _mm256_set1_ps(b.scale(g, 0)), s1 = _mm256_set1_ps(b.scale(g, 1));
  w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), s0, offset);
  w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), s0,
                         offset);
  w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), s1, offset);
  w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), s1,
                         offset);
}

// ---------------------------------------------------------------------------------------------
// x rounded to int8 (the int8-activation mode), once per call.

struct QuantizedX {
  // Per 32 values (32-value formats): q, the scale, scale * (sum of q), and that sum.
  std::vector<int8_t> q32;
  std::vector<float> d32, s32;
  std::vector<int32_t> i32;
  // Per 256 values (k-quants): q, the scale, and the sums of q per 16 values.
  std::vector<int8_t> q256;
  std::vector<float> d256;
  std::vector<int16_t> sums16;
  // The AVX-512 many-row path's copies, rows padded to m_pad (a multiple of 8, zero rows
  // in q256 and here): d256t[b][row], and sums_t[b][p][row] = the sums of values
  // 32 p .. 32 p + 15 and 32 p + 16 .. 32 p + 31 of superblock b as an int16 pair.
  int64_t m_pad = 0;
  std::vector<float> d256t;
  std::vector<int32_t> sums_t;
  // The same for the 32-value formats (rows padded to a multiple of 16; q32 gets 32 bytes
  // more, read against an odd last block's zero values): d32t[b][row], s32t[b][row].
  int64_t m_pad32 = 0;
  std::vector<float> d32t, s32t;
  // Interleaved Q4_K (interleaved.h): x's sums per 32 values as int16 pairs, [row][b][4].
  std::vector<int32_t> pairs32;
};

// Rounds n values (a multiple of 32) to int8 with one scale: q = round(x / d), d = max|x| / 127.
// Writes q and the sums of each 16 values; returns d.
inline float RoundBlock(const float* x, int64_t n, int8_t* q, int16_t* sums16) {
  __m256 amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < n; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float d = _mm_cvtss_f32(m) / 127.0f;
  const __m256 inverse = _mm256_set1_ps(d > 0 ? 1.0f / d : 0.0f);
  for (int64_t i = 0; i < n; i += 32) {
    __m256i v[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), inverse));
    }
    if (sums16 != nullptr) {
#pragma GCC unroll 2
      for (int j = 0; j < 2; ++j) {
        const __m256i s = _mm256_add_epi32(v[2 * j], v[2 * j + 1]);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        t = _mm_hadd_epi32(t, t);
        t = _mm_hadd_epi32(t, t);
        sums16[(i >> 4) + j] = static_cast<int16_t>(_mm_cvtsi128_si32(t));
      }
    }
    const __m256i packed = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), packed);
  }
  return d;
}

void QuantizeRow(const float* x, int64_t k, bool blocks32, bool blocks256, int64_t row,
                 QuantizedX& out) {
  if (blocks32) {
    int16_t sums[2];
    for (int64_t b = 0; b < k / 32; ++b) {
      const int64_t at = row * k + 32 * b;
      const float d = RoundBlock(x + 32 * b, 32, out.q32.data() + at, sums);
      out.d32[at / 32] = d;
      out.s32[at / 32] = d * static_cast<float>(sums[0] + sums[1]);
      out.i32[at / 32] = sums[0] + sums[1];
    }
  }
  if (blocks256) {
    for (int64_t b = 0; b < k / 256; ++b) {
      const int64_t at = row * k + 256 * b;
      out.d256[at / 256] = RoundBlock(x + 256 * b, 256, out.q256.data() + at,
                                      out.sums16.data() + at / 16);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Weight row `w` (K / values blocks) times MR rows of x from row m0, into y[m0 .. m0+MR, col].

struct Rows {
  const float* x;  // [M, K]
  const QuantizedX* qx;
  float* y;  // [M, N]
  int64_t m, n, k;
  const float* x_lanes = nullptr;  // [M, K] x in LaneOrder, where the exact Q4_K stream runs
};

// The exact mode's Q4_K rows streamed for few rows of x (ExactRows in lanes) take each value
// of a 32-byte chunk from its own dword (a shift and a mask, no byte shuffles), so dword lane
// i of the t-th vector holds value 4 i + t: x is laid out to match once per call, per group
// of 32: lanes[32 g + 8 t + i] = x[32 g + 4 i + t].
void LaneOrder(const float* x, int64_t m, int64_t k, std::vector<float>& lanes) {
  lanes.resize(m * k);
  for (int64_t row = 0; row < m; ++row) {
    for (int64_t g = 0; g < k; g += 32) {
      const float* from = x + row * k + g;
      float* to = lanes.data() + row * k + g;
      for (int t = 0; t < 4; ++t)
        for (int i = 0; i < 8; ++i) to[8 * t + i] = from[4 * i + t];
    }
  }
}

// Q4_K group g's exact weights in LaneOrder: w[t] lane i is value 4 i + t (the same value,
// fma(q, d sc, -(dmin m)), as Dequantize's), taken from the dword that holds its byte.
__attribute__((always_inline)) inline void LaneWeights(const Block<kQ4_K>& b, int g,
                                                       __m256 (&w)[4]) {
  // Group 2c in the low nibbles of chunk c, group 2c + 1 in the high ones.
  const __m256i raw =
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.p + 16 + 32 * (g >> 1)));
  const __m256 scale = _mm256_broadcast_ss(&b.exact_scale[g]);
  const __m256 offset = _mm256_broadcast_ss(&b.exact_offset[g]);
  const __m256i low4 = _mm256_set1_epi32(0x0F);
#pragma GCC unroll 4
  for (int t = 0; t < 4; ++t) {
    const __m256i q = _mm256_and_si256(_mm256_srli_epi32(raw, 8 * t + 4 * (g & 1)), low4);
    w[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), scale, offset);
  }
}

// kInLanes (Q4_K only): the weights from dwords (LaneWeights) against x in LaneOrder.
template <int F, int MR, bool kInLanes = false>
void ExactRows(const Rows& r, const uint8_t* w, int64_t col, int64_t m0) {
  static_assert(!kInLanes || F == kQ4_K);
  __m256 acc[MR][4];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) acc[i][q] = _mm256_setzero_ps();
  const float* x = (kInLanes ? r.x_lanes : r.x) + m0 * r.k;
  for (int64_t b = 0; b < r.k / kValues<F>; ++b) {
    const Block<F> block(w + b * kBytes<F>);
#pragma GCC unroll 8
    for (int g = 0; g < kValues<F> / 32; ++g) {
      __m256 wv[4];
      if constexpr (kInLanes) {
        LaneWeights(block, g, wv);
      } else {
        Dequantize<F>(block, g, wv);
      }
      const float* xg = x + b * kValues<F> + 32 * g;
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q)
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i)
          acc[i][q] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + i * r.k + 8 * q), wv[q], acc[i][q]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    r.y[(m0 + i) * r.n + col] = jaxinfer::Sum(_mm256_add_ps(
        _mm256_add_ps(acc[i][0], acc[i][1]), _mm256_add_ps(acc[i][2], acc[i][3])));
  }
}

// The 16 int16 sums of unsigned weight bytes v by signed x bytes, in pairs.
inline __m256i Products(__m256i v, const int8_t* x) {
  return _mm256_maddubs_epi16(v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

// A block's integer scales as int16 vectors, one per group, lined up with vpmaddubsw's 16
// pair sums (values 0-15 in the low 128 bits, 16-31 in the high), and the weights of the sums
// of x per 16 values that its minimums take.
template <int F>
struct IntegerScales {
  __m256i group[kValues<F> / 32];
  __m256i mins;  // int16[16] against x's sums per 16 (k-quants)
  float min_d;  // the minimums' float factor (k-quants)
  float mn;  // 32-value formats: w = d v + mn (Q8_0: not used, its v signed here)

  explicit IntegerScales(const Block<F>& block) {
    if constexpr (F == kQ6_K) {
      const __m256i s = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block.p + 192)));  // sc[0 .. 15]
      mins = s;
      min_d = -32.0f * block.d;
      // group g: sc[2 g] (low half), sc[2 g + 1] (high half)
      const __m256i low = _mm256_permute2x128_si256(s, s, 0x00);  // sc 0-7 in both halves
      const __m256i high = _mm256_permute2x128_si256(s, s, 0x11);  // sc 8-15
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const int word = (2 * g) & 7;
        const __m256i pick = _mm256_setr_epi8(
            2 * word, 2 * word + 1, 2 * word, 2 * word + 1, 2 * word, 2 * word + 1, 2 * word,
            2 * word + 1, 2 * word, 2 * word + 1, 2 * word, 2 * word + 1, 2 * word, 2 * word + 1,
            2 * word, 2 * word + 1, 2 * word + 2, 2 * word + 3, 2 * word + 2, 2 * word + 3,
            2 * word + 2, 2 * word + 3, 2 * word + 2, 2 * word + 3, 2 * word + 2, 2 * word + 3,
            2 * word + 2, 2 * word + 3, 2 * word + 2, 2 * word + 3, 2 * word + 2, 2 * word + 3);
        group[g] = _mm256_shuffle_epi8(g < 4 ? low : high, pick);
      }
    } else if constexpr (kSuper<F>) {
      const __m256i sc = _mm256_broadcastsi128_si256(
          _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block.k_scales))));
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {  // word g of sc, everywhere
        group[g] = _mm256_shuffle_epi8(sc, _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * g)));
      }
      const __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block.k_scales + 8));
      mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
      min_d = -block.dmin;
    } else {
      group[0] = _mm256_set1_epi16(1);
      mn = block.unsigned_offset();
    }
  }
};

// Rows of x per pass over a weight row: each block is decoded once per chunk.
constexpr int kChunk = 16;

// Rows [i0, i0 + MR) of the chunk from row m0 against one decoded block b.
template <int F, int MR>
__attribute__((always_inline)) inline void IntegerTile(const Rows& r, const Block<F>& block,
                                                       const __m256i (&v)[kValues<F> / 32],
                                                       const IntegerScales<F>& s, int64_t b,
                                                       int64_t m0, int i0, __m256* acc,
                                                       float* mins) {
  const QuantizedX& qx = *r.qx;
  if constexpr (!kSuper<F>) {
    // d dx (v . qx) + mn dx sum(qx); Q8_0's signed weights: |w| . sign(qx, w)
    __m256i v_abs = v[0];
    if constexpr (F == kQ8_0) v_abs = _mm256_sign_epi8(v[0], v[0]);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const int64_t at = (m0 + i0 + i) * r.k + 32 * b;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.q32.data() + at));
      const __m256i p = _mm256_maddubs_epi16(v_abs, F == kQ8_0 ? _mm256_sign_epi8(xv, v[0]) : xv);
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, s.group[0]));
      acc[i0 + i] = _mm256_fmadd_ps(dot, _mm256_set1_ps(block.d * qx.d32[at / 32]), acc[i0 + i]);
      if constexpr (F != kQ8_0) mins[i0 + i] += s.mn * qx.s32[at / 32];
    }
  } else {
    __m256i isum[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
    const int8_t* x0 = qx.q256.data() + (m0 + i0) * r.k + 256 * b;
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x0 + i * r.k + 32 * g));
        isum[i] = _mm256_add_epi32(isum[i],
                                   _mm256_madd_epi16(_mm256_maddubs_epi16(v[g], xv), s.group[g]));
      }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const int64_t row = m0 + i0 + i;
      const float dx = qx.d256[(row * r.k) / 256 + b];
      const __m256i sums = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(qx.sums16.data() + (row * r.k) / 16 + 16 * b));
      const __m256 min_dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s.mins, sums));
      __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_set1_ps(block.d * dx),
                                 acc[i0 + i]);
      acc[i0 + i] = _mm256_fmadd_ps(min_dot, _mm256_set1_ps(s.min_d * dx), a);
    }
  }
}

template <int F>
void IntegerColumn(const Rows& r, const uint8_t* w, int64_t col) {
  for (int64_t m0 = 0; m0 < r.m; m0 += kChunk) {
    const int rows = static_cast<int>(std::min<int64_t>(kChunk, r.m - m0));
    __m256 acc[kChunk];
    float mins[kChunk];
    for (int i = 0; i < rows; ++i) {
      acc[i] = _mm256_setzero_ps();
      mins[i] = 0.0f;
    }
    for (int64_t b = 0; b < r.k / kValues<F>; ++b) {
      const Block<F> block(w + b * kBytes<F>);
      __m256i v[kValues<F> / 32];
#pragma GCC unroll 8
      for (int g = 0; g < kValues<F> / 32; ++g) v[g] = block.v(g);
      const IntegerScales<F> s(block);
      int i = 0;
      for (; i + 4 <= rows; i += 4) IntegerTile<F, 4>(r, block, v, s, b, m0, i, acc, mins);
      switch (rows - i) {
        case 3: IntegerTile<F, 3>(r, block, v, s, b, m0, i, acc, mins); break;
        case 2: IntegerTile<F, 2>(r, block, v, s, b, m0, i, acc, mins); break;
        case 1: IntegerTile<F, 1>(r, block, v, s, b, m0, i, acc, mins); break;
      }
    }
    for (int i = 0; i < rows; ++i) r.y[(m0 + i) * r.n + col] = jaxinfer::Sum(acc[i]) + mins[i];
  }
}

// Up to 4 rows of x (decode steps): the weight row streamed once with every accumulator in
// registers, each group's values and scale formed in registers as it is used (the chunked
// path above keeps a block's decoded groups for many rows instead).
constexpr int64_t kPrefetch = 1024;  // bytes ahead of the weight row being read

template <int F, int MR>
void IntegerStream(const Rows& r, const uint8_t* w, int64_t col, int64_t m0) {
  const QuantizedX& qx = *r.qx;
  __m256 acc[MR];
  float mins[MR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    acc[i] = _mm256_setzero_ps();
    mins[i] = 0.0f;
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (!kSuper<F>) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t* x0 = qx.q32.data() + m0 * r.k;
    const float* dx0 = qx.d32.data() + m0 * r.k / 32;
    const float* sx0 = qx.s32.data() + m0 * r.k / 32;
    const int64_t blocks = r.k / 32;
    for (int64_t b = 0; b < blocks; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(w + b * kBytes<F> + kPrefetch), _MM_HINT_T0);
      const Block<F> block(w + b * kBytes<F>);
      const __m256i v = block.v(0);
      __m256i v_abs = v;
      if constexpr (F == kQ8_0) v_abs = _mm256_sign_epi8(v, v);
      const float mn = block.unsigned_offset();
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x0 + i * r.k + 32 * b));
        if constexpr (F == kQ8_0) xv = _mm256_sign_epi8(xv, v);
        const __m256 dot =
            _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(v_abs, xv), ones));
        acc[i] = _mm256_fmadd_ps(dot, _mm256_set1_ps(block.d * dx0[i * blocks + b]), acc[i]);
        if constexpr (F != kQ8_0) mins[i] += mn * sx0[i * blocks + b];
      }
    }
  } else {
    const int8_t* x0 = qx.q256.data() + m0 * r.k;
    const float* dx0 = qx.d256.data() + m0 * r.k / 256;
    const int16_t* sums0 = qx.sums16.data() + m0 * r.k / 16;
    const int64_t blocks = r.k / 256;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* p = w + b * kBytes<F>;
      for (int64_t line = 0; line < kBytes<F>; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch + line), _MM_HINT_T0);
      }
      __m256i isum[MR];
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) isum[i] = _mm256_setzero_si256();
      __m256i min_scales;
      float d, min_d;
      if constexpr (F == kQ4_K || F == kQ5_K) {
        uint8_t sm[16];
        KScales(p + 4, sm);
        d = Half(p);
        min_d = -Half(p + 2);
        const __m256i sc = _mm256_broadcastsi128_si256(
            _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm))));
        const __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8));
        min_scales = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
        const uint8_t* qs = p + (F == kQ4_K ? 16 : 48);
        __m256i high;
        if constexpr (F == kQ5_K) high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
          __m256i lo = _mm256_and_si256(bytes, low4);
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
          if constexpr (F == kQ5_K) {
            const __m256i one = _mm256_set1_epi8(1);
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * c), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * c + 1), one), 4));
          }
          const __m256i s_lo = _mm256_shuffle_epi8(sc, _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0404 * c)));
          const __m256i s_hi = _mm256_shuffle_epi8(sc, _mm256_set1_epi16(static_cast<int16_t>(0x0302 + 0x0404 * c)));
#pragma GCC unroll 4
          for (int i = 0; i < MR; ++i) {
            const int8_t* xq = x0 + i * r.k + 256 * b + 64 * c;
            const __m256i a = _mm256_madd_epi16(
                _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq))), s_lo);
            const __m256i h = _mm256_madd_epi16(
                _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32))), s_hi);
            isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(a, h));
          }
        }
      } else {  // Q6_K
        d = Half(p + 208);
        min_d = -32.0f * d;
        const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)));
        min_scales = s;
        const __m256i three = _mm256_set1_epi8(3);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h));
          const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32));
          const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
          // sc 0-7 (h = 0) or 8-15 (h = 1) in both halves; group 4 h + i takes words 2 i, 2 i + 1
          const __m256i half = h == 0 ? _mm256_permute2x128_si256(s, s, 0x00)
                                      : _mm256_permute2x128_si256(s, s, 0x11);
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) {
            const __m256i ql = (i & 1) ? ql1 : ql0;
            const __m256i low = _mm256_and_si256(i >= 2 ? _mm256_srli_epi16(ql, 4) : ql, low4);
            const __m256i top = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * i), three);
            const __m256i v = _mm256_or_si256(low, _mm256_slli_epi16(top, 4));
            const int lo_word = 2 * i, hi_word = 2 * i + 1;
            const __m256i pick = _mm256_set_m128i(
                _mm_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * hi_word)),
                _mm_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * lo_word)));
            const __m256i sc = _mm256_shuffle_epi8(half, pick);
#pragma GCC unroll 4
            for (int r_ = 0; r_ < MR; ++r_) {
              const int8_t* xq = x0 + r_ * r.k + 256 * b + 128 * h + 32 * i;
              isum[r_] = _mm256_add_epi32(
                  isum[r_], _mm256_madd_epi16(_mm256_maddubs_epi16(v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq))), sc));
            }
          }
        }
      }
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        const float dx = dx0[i * blocks + b];
        const __m256i sums = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(sums0 + i * r.k / 16 + 16 * b));
        const __m256 min_dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(min_scales, sums));
        const __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_set1_ps(d * dx), acc[i]);
        acc[i] = _mm256_fmadd_ps(min_dot, _mm256_set1_ps(min_d * dx), a);
      }
    }
  }
  for (int i = 0; i < MR; ++i) r.y[(m0 + i) * r.n + col] = jaxinfer::Sum(acc[i]) + mins[i];
}

// ---------------------------------------------------------------------------------------------
// The k-quants' integer dot products on AVX-512 with VNNI (chosen at run time; a CPU without
// them takes the AVX2 paths above). A superblock is 4 chunks of 64 values, chunk j against
// x[64 j, 64 j + 64): its unsigned values in one zmm, its integer scales as 32 int16 words
// lined up with vpmaddubsw's pair sums, and vpdpwssd multiplies by the scales and accumulates
// in one instruction (the AVX2 path takes vpmaddwd and vpaddd). The 32-value formats stay on
// the AVX2 paths.

#define JAXINFER_VNNI512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define JAXINFER_VNNI512_INLINE \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"), always_inline)) inline

// One k-quant superblock, decoded chunk by chunk.
template <int F>
struct Super512 {
  const uint8_t* p;
  float d, min_d;  // value = d * sc * v + min_d * m (Q6_K: m = sc, min_d = -32 d)
  __m512i scales16;  // the integer scales as int16 words (Q4_K / Q5_K: 8; Q6_K: 16)
  __m256i min_scales;  // int16[16] against x's sums per 16
  __m512i high;  // Q5_K's qh in both halves

  JAXINFER_VNNI512_INLINE explicit Super512(const uint8_t* block) : p(block) {
    if constexpr (F == kQ6_K) {
      d = Half(p + 208);
      min_d = -32.0f * d;
      min_scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)));
      scales16 = _mm512_zextsi256_si512(min_scales);
    } else {
      uint8_t sm[16];
      KScales(p + 4, sm);
      d = Half(p);
      min_d = -Half(p + 2);
      scales16 = _mm512_zextsi128_si512(
          _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm))));
      const __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8));
      min_scales = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
      if constexpr (F == kQ5_K) {
        high = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
      }
    }
  }

  // Chunk j's 64 values, unsigned bytes in x's order.
  JAXINFER_VNNI512_INLINE __m512i values(int j) const {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    if constexpr (F == kQ6_K) {
      // j = 2 h + t: nibble t of ql[64 h .. 64 h + 64) (groups 4 h + 2 t, 4 h + 2 t + 1), the
      // top two bits from qh[32 h + l], bits 4 t (first group) and 4 t + 2 (second).
      const int h = j >> 1, t = j & 1;
      __m512i ql = _mm512_loadu_si512(p + 64 * h);
      if (t) ql = _mm512_srli_epi16(ql, 4);
      const __m512i qh =
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h)));
      const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(4 * t)),
                                               _mm256_set1_epi16(static_cast<int16_t>(4 * t + 2)), 1);
      const __m512i top = _mm512_and_si512(_mm512_srlv_epi16(qh, shift), _mm512_set1_epi8(3));
      return _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_slli_epi16(top, 4));
    } else {
      // chunk j of qs: group 2 j in the low nibbles, 2 j + 1 in the high
      const uint8_t* qs = p + (F == kQ4_K ? 16 : 48) + 32 * j;
      const __m512i bytes =
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs)));
      const __m512i shift =
          _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
      __m512i v = _mm512_and_si512(_mm512_srlv_epi16(bytes, shift), low4);
      if constexpr (F == kQ5_K) {
        const __m512i bit_shift = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(2 * j)),
                                                     _mm256_set1_epi16(static_cast<int16_t>(2 * j + 1)), 1);
        const __m512i bit = _mm512_and_si512(_mm512_srlv_epi16(high, bit_shift), _mm512_set1_epi8(1));
        v = _mm512_or_si512(v, _mm512_slli_epi16(bit, 4));
      }
      return v;
    }
  }

  // Chunk j's scales as 32 int16 words: the scale of each pair of values.
  JAXINFER_VNNI512_INLINE __m512i scales(int j) const {
    if constexpr (F == kQ6_K) {
      // sc[4 j + q] for the words [8 q, 8 q + 8)
      const __m512i index = _mm512_set_epi64(
          0x0003000300030003LL + 0x0004000400040004LL * j, 0x0003000300030003LL + 0x0004000400040004LL * j,
          0x0002000200020002LL + 0x0004000400040004LL * j, 0x0002000200020002LL + 0x0004000400040004LL * j,
          0x0001000100010001LL + 0x0004000400040004LL * j, 0x0001000100010001LL + 0x0004000400040004LL * j,
          0x0000000000000000LL + 0x0004000400040004LL * j, 0x0000000000000000LL + 0x0004000400040004LL * j);
      return _mm512_permutexvar_epi16(index, scales16);
    } else {
      // sc[2 j] for words [0, 16), sc[2 j + 1] for [16, 32)
      return _mm512_permutexvar_epi16(
          _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(2 * j)),
                             _mm256_set1_epi16(static_cast<int16_t>(2 * j + 1)), 1),
          scales16);
    }
  }
};

// Row i's share of a superblock: y += d dx (its integer sum) + min_d dx (scales . x sums).
template <int F>
JAXINFER_VNNI512_INLINE void Finish512(const Super512<F>& s, __m512i isum, float dx,
                                        const int16_t* sums16, __m512& acc, __m256& min_acc) {
  const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums16));
  const __m256i min_dot = _mm256_madd_epi16(s.min_scales, sums);
  if constexpr (F == kQ6_K) {  // min_d = -32 d: one integer sum
    isum = _mm512_sub_epi32(isum, _mm512_zextsi256_si512(_mm256_slli_epi32(min_dot, 5)));
  } else {
    min_acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(min_dot), _mm256_set1_ps(s.min_d * dx), min_acc);
  }
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(s.d * dx), acc);
}

JAXINFER_VNNI512_INLINE float Sum512(__m512 acc, __m256 min_acc) {
  const __m256 folded = _mm256_add_ps(
      _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1)), min_acc);
  return jaxinfer::Sum(folded);
}

// Up to 8 rows of x from m0 (decode steps): the weight row streamed once, every accumulator
// in registers.
template <int F, int MR>
JAXINFER_VNNI512 void IntegerStream512(const Rows& r, const uint8_t* w, int64_t col, int64_t m0) {
  const QuantizedX& qx = *r.qx;
  __m512 acc[MR];
  __m256 min_acc[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    acc[i] = _mm512_setzero_ps();
    min_acc[i] = _mm256_setzero_ps();
  }
  const int8_t* x0 = qx.q256.data() + m0 * r.k;
  const float* dx0 = qx.d256.data() + m0 * r.k / 256;
  const int16_t* sums0 = qx.sums16.data() + m0 * r.k / 16;
  const int64_t blocks = r.k / 256;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = w + b * kBytes<F>;
    for (int64_t line = 0; line < kBytes<F>; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch + line), _MM_HINT_T0);
    }
    const Super512<F> s(p);
    __m512i isum[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) isum[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i v = s.values(j), sc = s.scales(j);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512i xv = _mm512_loadu_si512(x0 + i * r.k + 256 * b + 64 * j);
        isum[i] = _mm512_dpwssd_epi32(isum[i], _mm512_maddubs_epi16(v, xv), sc);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      Finish512<F>(s, isum[i], dx0[i * blocks + b], sums0 + i * r.k / 16 + 16 * b, acc[i],
                   min_acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) r.y[(m0 + i) * r.n + col] = Sum512(acc[i], min_acc[i]);
}

// Lane r of the result: the sum of rows[r]'s 16 lanes (r < MR; MR = 8 fills lanes 0-7).
template <int MR>
JAXINFER_VNNI512_INLINE __m512i SumLanes(const __m512i (&rows)[MR]) {
  // pairs: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] per 128-bit lane
  __m512i pairs[MR / 2];
#pragma GCC unroll 8
  for (int i = 0; i < MR / 2; ++i) {
    pairs[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]),
                                _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]));
  }
  // quads: rows 4 q .. 4 q + 3, each summed within every 128-bit lane
  __m512i quads[MR / 4];
#pragma GCC unroll 4
  for (int q = 0; q < MR / 4; ++q) {
    quads[q] = _mm512_add_epi32(_mm512_unpacklo_epi64(pairs[2 * q], pairs[2 * q + 1]),
                                _mm512_unpackhi_epi64(pairs[2 * q], pairs[2 * q + 1]));
  }
  // across the 128-bit lanes
  const __m512i q01 = _mm512_add_epi32(_mm512_shuffle_i32x4(quads[0], quads[1], 0x88),
                                       _mm512_shuffle_i32x4(quads[0], quads[1], 0xDD));
  if constexpr (MR == 8) {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(q01, q01, 0x88),
                            _mm512_shuffle_i32x4(q01, q01, 0xDD));
  } else {
    const __m512i q23 = _mm512_add_epi32(_mm512_shuffle_i32x4(quads[2], quads[3], 0x88),
                                         _mm512_shuffle_i32x4(quads[2], quads[3], 0xDD));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(q01, q23, 0x88),
                            _mm512_shuffle_i32x4(q01, q23, 0xDD));
  }
}

// Many rows (prefill, large batches): every row of x (in tiles of 16, and one of 8 where the
// rows padded to a multiple of 8 leave it; the padding is zero rows) against one weight row,
// superblock by superblock: each superblock is decoded once for all the tiles, its values and
// scales kept in registers. Per tile the rows' integer sums are summed across lanes together,
// so the float work (x's scales, the minimums against x's sums per 16) is one vector over the
// tile's rows rather than per row.
template <int F, int MR>
JAXINFER_VNNI512_INLINE void RowTile512(const Rows& r, const Super512<F>& s,
                                        const __m512i (&v)[4], const __m512i (&sc)[4],
                                        const int32_t (&min_pairs)[8], int64_t b, int64_t m0,
                                        __m512& acc) {
  const QuantizedX& qx = *r.qx;
  const int64_t mp = qx.m_pad;
  const __mmask16 lanes = MR == 16 ? 0xFFFF : 0x00FF;
  const int8_t* x0 = qx.q256.data() + m0 * r.k + 256 * b;
  __m512i isum[MR];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    isum[i] = _mm512_madd_epi16(_mm512_maddubs_epi16(v[0], _mm512_loadu_si512(x0 + i * r.k)), sc[0]);
  }
#pragma GCC unroll 3
  for (int j = 1; j < 4; ++j) {
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512i xv = _mm512_loadu_si512(x0 + i * r.k + 64 * j);
      isum[i] = _mm512_dpwssd_epi32(isum[i], _mm512_maddubs_epi16(v[j], xv), sc[j]);
    }
  }
  __m512i dot = SumLanes<MR>(isum);
  // the minimums' scales against x's sums per 16, a pair of sums per int32, lanes = rows
  const int32_t* sums = qx.sums_t.data() + (8 * b) * mp + m0;
  __m512i min_dot = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int q = 0; q < 8; ++q) {
    min_dot = _mm512_dpwssd_epi32(min_dot, _mm512_maskz_loadu_epi32(lanes, sums + q * mp),
                                  _mm512_set1_epi32(min_pairs[q]));
  }
  const __m512 dx = _mm512_maskz_loadu_ps(lanes, qx.d256t.data() + b * mp + m0);
  if constexpr (F == kQ6_K) {  // min_d = -32 d: one integer sum
    dot = _mm512_sub_epi32(dot, _mm512_slli_epi32(min_dot, 5));
  } else {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(min_dot), _mm512_mul_ps(dx, _mm512_set1_ps(s.min_d)),
                          acc);
  }
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dx, _mm512_set1_ps(s.d)), acc);
}

constexpr int64_t kRowTiles = 16;  // tiles of 16 rows per pass over a weight row

// Rows [m0, min(m, m0 + 16 kRowTiles)) of x; m0 a multiple of 16.
template <int F>
JAXINFER_VNNI512 void IntegerRows512(const Rows& r, const uint8_t* w, int64_t col, int64_t m0) {
  const int64_t rows = std::min(r.qx->m_pad - m0, 16 * kRowTiles);
  const int64_t tiles16 = rows / 16;
  const bool tail8 = rows % 16 != 0;
  __m512 acc[kRowTiles];
  for (int64_t t = 0; t < tiles16 + tail8; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < r.k / 256; ++b) {
    const Super512<F> s(w + b * kBytes<F>);
    __m512i v[4], sc[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      v[j] = s.values(j);
      sc[j] = s.scales(j);
    }
    alignas(32) int32_t min_pairs[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(min_pairs), s.min_scales);
    for (int64_t t = 0; t < tiles16; ++t) {
      RowTile512<F, 16>(r, s, v, sc, min_pairs, b, m0 + 16 * t, acc[t]);
    }
    if (tail8) RowTile512<F, 8>(r, s, v, sc, min_pairs, b, m0 + 16 * tiles16, acc[tiles16]);
  }
  for (int64_t t = 0; t < tiles16 + tail8; ++t) {
    alignas(64) float out[16];
    _mm512_store_ps(out, acc[t]);
    const int64_t first = m0 + 16 * t;
    for (int i = 0; i < 16 && first + i < r.m; ++i) r.y[(first + i) * r.n + col] = out[i];
  }
}

// The exact mode's steps of 1-3 rows for the 4-bit formats (Q4_0, Q4_1, Q4_K) on AVX-512:
// the 16 values a block's (a Q4_K group's) nibbles can take are computed once into a zmm,
// fma(q - bias, scale, offset) as Dequantize forms them (gguf's values, bit for bit), and each
// weight is looked up by its nibble (vpermps) instead of widened and converted.
template <int F>
constexpr bool kNibbleTable = F == kQ4_0 || F == kQ4_1 || F == kQ4_K;
// Rows up to which the 4-bit formats stream on AVX-512 in the exact mode, all in one pass
// (a short verify step of speculative decoding): past them, the panel path (more rows'
// accumulators spill).
constexpr int64_t kStreamRows512 = 6;

template <int F, int MR>
JAXINFER_VNNI512 void ExactRows512(const Rows& r, const uint8_t* w, int64_t col, int64_t m0) {
  // Two accumulators a row for few rows (the FMAs' latency), one for more (the registers).
  constexpr int kAcc = MR <= 3 ? 2 : 1;
  __m512 acc[MR][kAcc];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 2
    for (int a = 0; a < kAcc; ++a) acc[i][a] = _mm512_setzero_ps();
  const __m512 levels = _mm512_sub_ps(
      _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_ps(static_cast<float>(Block<F>::kBias)));
  const float* x = r.x + m0 * r.k;
  for (int64_t b = 0; b < r.k / kValues<F>; ++b) {
    const Block<F> block(w + b * kBytes<F>);
#pragma GCC unroll 8
    for (int g = 0; g < kValues<F> / 32; ++g) {
      const __m512 table = _mm512_fmadd_ps(levels, _mm512_set1_ps(block.scale(g, 0)),
                                           _mm512_set1_ps(block.offset(g)));
      const __m256i q = block.v(g);
      const __m512 w0 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)), table);
      const __m512 w1 =
          _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)), table);
      const float* xg = x + b * kValues<F> + 32 * g;
#pragma GCC unroll 6
      for (int i = 0; i < MR; ++i) {
        acc[i][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xg + i * r.k), w0, acc[i][0]);
        acc[i][kAcc - 1] =
            _mm512_fmadd_ps(_mm512_loadu_ps(xg + i * r.k + 16), w1, acc[i][kAcc - 1]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    __m512 sum = acc[i][0];
    if constexpr (kAcc == 2) sum = _mm512_add_ps(sum, acc[i][1]);
    r.y[(m0 + i) * r.n + col] = _mm512_reduce_add_ps(sum);
  }
}

// The 32-value formats' many rows (more than kStreamRows32) on AVX-512 VNNI: 16 rows of x (padded with
// zero rows) against one weight row, two blocks per zmm. Each row's products are one vpdpbusd
// per 64 values (unsigned values; Q8_0's signed ones offset by 128, taken back through x's
// sums); the 16 rows' sums are reduced across lanes together down to one 128-bit lane per
// 4 rows and block, so x's scales, the weight's and the offsets against x's sums are a few
// vector operations per two blocks rather than work per row.
template <int F>
JAXINFER_VNNI512_INLINE __m256i Unsigned32(const Block<F>& block) {
  const __m256i v = block.v(0);
  if constexpr (F == kQ8_0) return _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80)));
  return v;
}

// [a(b) rows r..r+3, a(b+1) rows r..r+3, a(b) rows r+4..r+7, a(b+1) rows r+4..r+7] of two
// vectors of 16 rows' values for blocks b (in `even`) and b + 1 (`odd`), r = 8 h.
JAXINFER_VNNI512_INLINE __m512 Arrange(__m512 even, __m512 odd, int h) {
  const __m512 t = h == 0 ? _mm512_shuffle_f32x4(even, odd, 0x44)   // e.L0 e.L1 o.L0 o.L1
                          : _mm512_shuffle_f32x4(even, odd, 0xEE);  // e.L2 e.L3 o.L2 o.L3
  return _mm512_shuffle_f32x4(t, t, 0xD8);  // e.L0 o.L0 e.L1 o.L1
}

template <int F>
JAXINFER_VNNI512 void IntegerRows512Small(const Rows& r, const uint8_t* w, int64_t col,
                                          int64_t m0) {
  const QuantizedX& qx = *r.qx;
  const int64_t blocks = r.k / 32, mp = qx.m_pad32;
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  const int8_t* x0 = qx.q32.data() + m0 * r.k;
  for (int64_t b = 0; b < blocks; b += 2) {
    const bool pair = b + 1 < blocks;
    const Block<F> even(w + b * kBytes<F>);
    const Block<F> odd(w + (pair ? b + 1 : b) * kBytes<F>);
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(Unsigned32<F>(even)),
                                         pair ? Unsigned32<F>(odd) : _mm256_setzero_si256(), 1);
    __m512i isum[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      isum[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v,
                                    _mm512_loadu_si512(x0 + i * r.k + 32 * b));
    }
    __m512i pairs[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      pairs[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(isum[2 * i], isum[2 * i + 1]),
                                  _mm512_unpackhi_epi32(isum[2 * i], isum[2 * i + 1]));
    }
    __m512i quads[4];
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      quads[q] = _mm512_add_epi32(_mm512_unpacklo_epi64(pairs[2 * q], pairs[2 * q + 1]),
                                  _mm512_unpackhi_epi64(pairs[2 * q], pairs[2 * q + 1]));
    }
    const float d_odd = pair ? odd.d : 0.0f, offset_odd = pair ? odd.unsigned_offset() : 0.0f;
    const __m512 d = _mm512_mask_mov_ps(_mm512_set1_ps(even.d), 0xF0F0, _mm512_set1_ps(d_odd));
    const __m512 offset = _mm512_mask_mov_ps(_mm512_set1_ps(even.unsigned_offset()), 0xF0F0,
                                             _mm512_set1_ps(offset_odd));
    const __m512 dx_even = _mm512_loadu_ps(qx.d32t.data() + b * mp + m0);
    const __m512 sx_even = _mm512_loadu_ps(qx.s32t.data() + b * mp + m0);
    const __m512 dx_odd = pair ? _mm512_loadu_ps(qx.d32t.data() + (b + 1) * mp + m0) : _mm512_setzero_ps();
    const __m512 sx_odd = pair ? _mm512_loadu_ps(qx.s32t.data() + (b + 1) * mp + m0) : _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // rows 8 h .. 8 h + 7
      const __m512i dot = _mm512_add_epi32(_mm512_shuffle_i32x4(quads[2 * h], quads[2 * h + 1], 0x88),
                                           _mm512_shuffle_i32x4(quads[2 * h], quads[2 * h + 1], 0xDD));
      const __m512 dx = Arrange(dx_even, dx_odd, h), sx = Arrange(sx_even, sx_odd, h);
      acc[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dx, d), acc[h]);
      acc[h] = _mm512_fmadd_ps(sx, offset, acc[h]);
    }
  }
  // acc[h] = [rows 8h..8h+3 (even blocks), the same (odd), rows 8h+4..8h+7 (even), (odd)]
  alignas(64) float out[2][16];
  _mm512_store_ps(out[0], acc[0]);
  _mm512_store_ps(out[1], acc[1]);
  for (int i = 0; i < 16 && m0 + i < r.m; ++i) {
    const int h = i / 8, q = (i % 8) / 4, j = i % 4;
    r.y[(m0 + i) * r.n + col] = out[h][8 * q + j] + out[h][8 * q + 4 + j];
  }
}

// The 32-value formats on a CPU with AVX-512 VNNI: up to this many rows take the streaming
// path (AVX2 instructions), more the AVX-512 VNNI rows path.
constexpr int64_t kStreamRows32 = 8;

bool Vnni512Supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}

template <int F>
void Integer512(const Rows& r, const uint8_t* w, int64_t col) {
  switch (r.m) {
    case 1: return IntegerStream512<F, 1>(r, w, col, 0);
    case 2: return IntegerStream512<F, 2>(r, w, col, 0);
    case 3: return IntegerStream512<F, 3>(r, w, col, 0);
    case 4: return IntegerStream512<F, 4>(r, w, col, 0);
    case 5: return IntegerStream512<F, 5>(r, w, col, 0);
    case 6: return IntegerStream512<F, 6>(r, w, col, 0);
    case 7: return IntegerStream512<F, 7>(r, w, col, 0);
    case 8: return IntegerStream512<F, 8>(r, w, col, 0);
  }
  for (int64_t m0 = 0; m0 < r.m; m0 += 16 * kRowTiles) IntegerRows512<F>(r, w, col, m0);
}

template <int F>
void Column(const Rows& r, const uint8_t* w, int64_t col, bool integer, bool vnni512) {
  int64_t m0 = 0;
  if constexpr (kSuper<F>) {
    if (integer && vnni512) return Integer512<F>(r, w, col);
  } else {
    if (integer && vnni512) {
      switch (r.m) {
        case 5: return IntegerStream<F, 5>(r, w, col, 0);
        case 6: return IntegerStream<F, 6>(r, w, col, 0);
        case 7: return IntegerStream<F, 7>(r, w, col, 0);
        case 8: return IntegerStream<F, 8>(r, w, col, 0);
      }
      if (r.m > kStreamRows32) {
        for (; m0 < r.m; m0 += 16) IntegerRows512Small<F>(r, w, col, m0);
        return;
      }
    }
  }
  if (integer) {
    switch (r.m) {
      case 1: return IntegerStream<F, 1>(r, w, col, 0);
      case 2: return IntegerStream<F, 2>(r, w, col, 0);
      case 3: return IntegerStream<F, 3>(r, w, col, 0);
      case 4: return IntegerStream<F, 4>(r, w, col, 0);
    }
    return IntegerColumn<F>(r, w, col);
  }
  if constexpr (kNibbleTable<F>) {
    if (vnni512) {
      switch (r.m) {
        case 4: return ExactRows512<F, 4>(r, w, col, 0);
        case 5: return ExactRows512<F, 5>(r, w, col, 0);
        case 6: return ExactRows512<F, 6>(r, w, col, 0);
      }
      for (; m0 + 3 <= r.m; m0 += 3) ExactRows512<F, 3>(r, w, col, m0);
      if (r.m - m0 == 2) ExactRows512<F, 2>(r, w, col, m0);
      if (r.m - m0 == 1) ExactRows512<F, 1>(r, w, col, m0);
      return;
    }
  }
  if constexpr (F == kQ4_K) {
    if (r.x_lanes != nullptr) {
      for (; m0 + 3 <= r.m; m0 += 3) ExactRows<F, 3, true>(r, w, col, m0);
      if (r.m - m0 == 2) ExactRows<F, 2, true>(r, w, col, m0);
      if (r.m - m0 == 1) ExactRows<F, 1, true>(r, w, col, m0);
      return;
    }
  }
  for (; m0 + 3 <= r.m; m0 += 3) ExactRows<F, 3>(r, w, col, m0);
  if (r.m - m0 == 2) ExactRows<F, 2>(r, w, col, m0);
  if (r.m - m0 == 1) ExactRows<F, 1>(r, w, col, m0);
}

template <int F>
void DequantizeRow(const uint8_t* w, int64_t k, float* out);

// The exact mode's many rows (prefill, batches): NC weight rows dequantized once into a float
// panel (exact values, in L1 or L2), then tiles of MR rows of x by the NC weight rows, each
// product an FMA with its own accumulator (MR NC of them in registers), x and the panel read
// once per tile. Steps of fewer rows stream the blocks instead (ExactRows).
constexpr int64_t kPanelRows = 4;  // rows of x from which the panel path is taken
constexpr int kPanel = 3;  // weight rows per panel
constexpr int64_t kPanelChunk = 96;  // rows of x per pass over a panel

template <int MR, int NC>
__attribute__((always_inline)) inline void PanelTile(const Rows& r, const float* panel,
                                                     int64_t m0, int64_t col0) {
  __m256 acc[MR][NC];
#pragma GCC unroll 3
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 3
    for (int c = 0; c < NC; ++c) acc[i][c] = _mm256_setzero_ps();
  const float* x = r.x + m0 * r.k;
  for (int64_t kk = 0; kk < r.k; kk += 8) {
    __m256 w[NC];
#pragma GCC unroll 3
    for (int c = 0; c < NC; ++c) w[c] = _mm256_loadu_ps(panel + c * r.k + kk);
#pragma GCC unroll 3
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * r.k + kk);
#pragma GCC unroll 3
      for (int c = 0; c < NC; ++c) acc[i][c] = _mm256_fmadd_ps(xv, w[c], acc[i][c]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int c = 0; c < NC; ++c) r.y[(m0 + i) * r.n + col0 + c] = jaxinfer::Sum(acc[i][c]);
}

template <int NC>
void PanelRows(const Rows& r, const float* panel, int64_t col0) {
  for (int64_t c0 = 0; c0 < r.m; c0 += kPanelChunk) {
    const int64_t stop = std::min(r.m, c0 + kPanelChunk);
    int64_t m0 = c0;
    for (; m0 + 3 <= stop; m0 += 3) PanelTile<3, NC>(r, panel, m0, col0);
    if (stop - m0 == 2) PanelTile<2, NC>(r, panel, m0, col0);
    if (stop - m0 == 1) PanelTile<1, NC>(r, panel, m0, col0);
  }
}

// The same on AVX-512 (taken with the VNNI paths): 16 floats a vector, tiles of up to 6 rows
// by 4 weight rows (24 accumulators, the 4 weight vectors and one of x in the 32 registers).
// The rows are split into tiles as even as the maximum allows (9 rows: 5 and 4), as a tile of
// one row reads its 4 weight vectors for 4 FMAs and costs most of a full tile.
constexpr int kPanel512 = 4;
constexpr int64_t kPanelTile512 = 6;

template <int MR, int NC>
JAXINFER_VNNI512_INLINE void PanelTile512(const Rows& r, const float* panel, int64_t m0,
                                          int64_t col0) {
  __m512 acc[MR][NC];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_setzero_ps();
  const float* x = r.x + m0 * r.k;
  for (int64_t kk = 0; kk < r.k; kk += 16) {
    __m512 w[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) w[c] = _mm512_loadu_ps(panel + c * r.k + kk);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * r.k + kk);
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_fmadd_ps(xv, w[c], acc[i][c]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int c = 0; c < NC; ++c) r.y[(m0 + i) * r.n + col0 + c] = _mm512_reduce_add_ps(acc[i][c]);
}

template <int NC>
JAXINFER_VNNI512_INLINE void PanelTileRows512(const Rows& r, const float* panel, int64_t m0,
                                              int64_t rows, int64_t col0) {
  switch (rows) {
    case 6: return PanelTile512<6, NC>(r, panel, m0, col0);
    case 5: return PanelTile512<5, NC>(r, panel, m0, col0);
    case 4: return PanelTile512<4, NC>(r, panel, m0, col0);
    case 3: return PanelTile512<3, NC>(r, panel, m0, col0);
    case 2: return PanelTile512<2, NC>(r, panel, m0, col0);
    case 1: return PanelTile512<1, NC>(r, panel, m0, col0);
  }
}

template <int NC>
JAXINFER_VNNI512 void PanelRows512(const Rows& r, const float* panel, int64_t col0) {
  for (int64_t c0 = 0; c0 < r.m; c0 += kPanelChunk) {
    const int64_t rows = std::min(r.m, c0 + kPanelChunk) - c0;
    const int64_t tiles = (rows + kPanelTile512 - 1) / kPanelTile512;
    for (int64_t t = 0, m0 = c0; t < tiles; ++t) {
      const int64_t size = rows / tiles + (t < rows % tiles ? 1 : 0);
      PanelTileRows512<NC>(r, panel, m0, size, col0);
      m0 += size;
    }
  }
}

// Output rows [first, stop) of one segment (format f, rows of `row_bytes` from `data`).
template <int F>
void SegmentRows(const Rows& r, const uint8_t* data, int64_t row_bytes, int64_t first,
                 int64_t stop, int64_t out_first, bool integer, bool vnni512) {
  const bool streams = kNibbleTable<F> && vnni512 && r.m <= kStreamRows512;
  if (!integer && r.m >= kPanelRows && !streams) {
    const int width = vnni512 ? kPanel512 : kPanel;
    std::vector<float> panel(width * r.k);
    for (int64_t row = first; row < stop; row += width) {
      const int count = static_cast<int>(std::min<int64_t>(width, stop - row));
      for (int c = 0; c < count; ++c) {
        DequantizeRow<F>(data + (row + c) * row_bytes, r.k, panel.data() + c * r.k);
      }
      const int64_t col0 = out_first + row;
      if (vnni512) {
        switch (count) {
          case 4: PanelRows512<4>(r, panel.data(), col0); break;
          case 3: PanelRows512<3>(r, panel.data(), col0); break;
          case 2: PanelRows512<2>(r, panel.data(), col0); break;
          case 1: PanelRows512<1>(r, panel.data(), col0); break;
        }
        continue;
      }
      switch (count) {
        case 3: PanelRows<3>(r, panel.data(), col0); break;
        case 2: PanelRows<2>(r, panel.data(), col0); break;
        case 1: PanelRows<1>(r, panel.data(), col0); break;
      }
    }
    return;
  }
  for (int64_t row = first; row < stop; ++row) {
    Column<F>(r, data + row * row_bytes, out_first + row, integer, vnni512);
  }
}

#include "interleaved.h"

void RunSegment(int32_t f, const Rows& r, const uint8_t* data, int64_t row_bytes, int64_t first,
                int64_t stop, int64_t out_first, bool integer, bool vnni512) {
  switch (f) {
    case kQ4_0: return SegmentRows<kQ4_0>(r, data, row_bytes, first, stop, out_first, integer, vnni512);
    case kQ4_1: return SegmentRows<kQ4_1>(r, data, row_bytes, first, stop, out_first, integer, vnni512);
    case kQ5_0: return SegmentRows<kQ5_0>(r, data, row_bytes, first, stop, out_first, integer, vnni512);
    case kQ5_1: return SegmentRows<kQ5_1>(r, data, row_bytes, first, stop, out_first, integer, vnni512);
    case kQ8_0: return SegmentRows<kQ8_0>(r, data, row_bytes, first, stop, out_first, integer, vnni512);
    case kQ4_K: return SegmentRows<kQ4_K>(r, data, row_bytes, first, stop, out_first, integer, vnni512);
    case kQ5_K: return SegmentRows<kQ5_K>(r, data, row_bytes, first, stop, out_first, integer, vnni512);
    case kQ6_K: return SegmentRows<kQ6_K>(r, data, row_bytes, first, stop, out_first, integer, vnni512);
    case kQ4_0X16: return X16SegmentRows<kQ4_0X16>(r, data, row_bytes, first, stop, out_first, integer, vnni512);
    case kQ4_1X16: return X16SegmentRows<kQ4_1X16>(r, data, row_bytes, first, stop, out_first, integer, vnni512);
    case kQ5_0X16: return X16SegmentRows<kQ5_0X16>(r, data, row_bytes, first, stop, out_first, integer, vnni512);
    case kQ8_0X16: return X16SegmentRows<kQ8_0X16>(r, data, row_bytes, first, stop, out_first, integer, vnni512);
    case kQ4_KX16: return X16SegmentRows<kQ4_KX16>(r, data, row_bytes, first, stop, out_first, integer, vnni512);
    case kQ6_KX16: return X16SegmentRows<kQ6_KX16>(r, data, row_bytes, first, stop, out_first, integer, vnni512);
  }
}

struct Segment {
  int32_t format;
  int64_t rows, out_first, row_bytes;
  const uint8_t* data;
};

// The layer's segments, checked against the layer's bytes and the output rows N.
ffi::Error Segments(const ffi::Buffer<ffi::U8>& data, const ffi::Buffer<ffi::S32>& table,
                    int64_t layer, int64_t k, int64_t n, std::vector<Segment>& out) {
  const auto data_dims = data.dimensions();
  const auto table_dims = table.dimensions();
  if (data_dims.size() != 2 || table_dims.size() != 3 || table_dims[2] != 3 ||
      table_dims[0] != data_dims[0]) {
    return ffi::Error::InvalidArgument("gguf_matmul: data u8[L, B] and table i32[L, S, 3]");
  }
  if (layer < 0 || layer >= data_dims[0]) {
    return ffi::Error::InvalidArgument("gguf_matmul: layer out of range");
  }
  const int64_t layer_bytes = data_dims[1];
  const uint8_t* base = data.typed_data() + layer * layer_bytes;
  const int32_t* t = table.typed_data() + layer * table_dims[1] * 3;
  int64_t rows = 0;
  for (int64_t s = 0; s < table_dims[1]; ++s) {
    const int32_t f = t[3 * s], count = t[3 * s + 1], offset = t[3 * s + 2];
    if (count == 0) continue;
    const int64_t bytes = BlockBytes(f);
    if (bytes == 0 || count < 0 || k % BlockValues(f) != 0 ||
        (Interleaved(f) && count % kX16Rows != 0)) {
      return ffi::Error::InvalidArgument(
          "gguf_matmul: a segment's format is not a supported block format, or K is not a "
          "multiple of its block (or an interleaved segment's rows not a multiple of 16)");
    }
    const int64_t row_bytes = k / BlockValues(f) * bytes;
    if (offset < 0 || offset + count * row_bytes > layer_bytes) {
      return ffi::Error::InvalidArgument("gguf_matmul: a segment lies outside the layer's bytes");
    }
    out.push_back({f, count, rows, row_bytes, base + offset});
    rows += count;
  }
  if (rows != n) {
    return ffi::Error::InvalidArgument("gguf_matmul: the segments' rows do not sum to N");
  }
  return ffi::Error::Success();
}


// Whether a call streams Q4_K rows exactly on the AVX2 path (ExactRows in lanes), which reads
// x in LaneOrder.
bool TakesLanes(const std::vector<Segment>& segments, int64_t m, bool int8_activations,
                bool avx512_vnni) {
  if (int8_activations || avx512_vnni || m >= kPanelRows) return false;
  for (const Segment& s : segments) {
    if (s.format == kQ4_K) return true;
  }
  return false;
}

// Claims of output rows: a quarter of a segment's rows per thread-sized share (long runs for
// the prefetchers), at least 8, at most 64 (an LM head).
constexpr int64_t kMinClaim = 8, kMaxClaim = 64;

// x's rows [m, k] rounded to int8 as the segments' formats take them (the int8 mode), with the
// copies the AVX-512 VNNI many-row paths read.
void QuantizeX(ffi::ThreadPool& pool, const float* xs, int64_t m, int64_t k,
               const std::vector<Segment>& segments, bool avx512_vnni, QuantizedX& qx) {
  bool blocks32 = false, blocks256 = false;
  for (const Segment& s : segments) (BlockValues(s.format) == 256 ? blocks256 : blocks32) = true;
  // Interleaved Q4_K takes x's sums per 32 in pairs; the file's formats' many-row paths
  // (the only ones on AVX-512 VNNI that read them) take x padded and transposed.
  bool pairs = false, file32 = false, file256 = false;
  for (const Segment& s : segments) {
    pairs |= s.format == kQ4_KX16;
    (BlockValues(s.format) == 256 ? file256 : file32) |= !Interleaved(s.format);
  }
  const bool many32 = file32 && avx512_vnni && m > kStreamRows32;
  if (blocks32) {
    qx.m_pad32 = many32 ? (m + 15) / 16 * 16 : m;
    qx.q32.resize(qx.m_pad32 * k + 32);
    qx.d32.resize(m * k / 32);
    qx.s32.resize(m * k / 32);
    qx.i32.resize(m * k / 32);
  }
  const bool many512 = file256 && avx512_vnni && m > 8;
  if (blocks256) {
    qx.m_pad = many512 ? (m + 7) / 8 * 8 : m;
    qx.q256.resize(qx.m_pad * k);
    qx.d256.resize(m * k / 256);
    qx.sums16.resize(m * k / 16);
  }
  jaxinfer::ParallelFor(pool, m, [&](int64_t row) {
    QuantizeRow(xs + row * k, k, blocks32, blocks256, row, qx);
  });
  if (many32) {
    const int64_t blocks = k / 32, mp = qx.m_pad32;
    qx.d32t.assign(blocks * mp + 16, 0.0f);
    qx.s32t.assign(blocks * mp + 16, 0.0f);
    for (int64_t row = 0; row < m; ++row) {
      for (int64_t b = 0; b < blocks; ++b) {
        qx.d32t[b * mp + row] = qx.d32[row * blocks + b];
        qx.s32t[b * mp + row] = qx.s32[row * blocks + b];
      }
    }
  }
  if (pairs && avx512_vnni) GroupSumPairs(m, k, qx);
  if (many512) {
    const int64_t blocks = k / 256, mp = qx.m_pad;
    qx.d256t.assign(blocks * mp, 0.0f);
    qx.sums_t.assign(blocks * 8 * mp, 0);
    for (int64_t row = 0; row < m; ++row) {
      for (int64_t b = 0; b < blocks; ++b) {
        qx.d256t[b * mp + row] = qx.d256[row * blocks + b];
        const int16_t* sums = qx.sums16.data() + (row * k) / 16 + 16 * b;
        for (int64_t q = 0; q < 8; ++q) {
          int32_t pair;
          std::memcpy(&pair, sums + 2 * q, 4);
          qx.sums_t[(8 * b + q) * mp + row] = pair;
        }
      }
    }
  }
}

// A share of one product's output rows: rows [first, stop) of a segment, for `rows`' x.
struct Claim {
  const Segment* segment;
  const Rows* rows;
  int64_t first, stop;
};

void AddClaims(const std::vector<Segment>& segments, const Rows* rows, std::vector<Claim>& out) {
  for (const Segment& s : segments) {
    int64_t size = std::clamp<int64_t>((s.rows + 3) / 4, kMinClaim, kMaxClaim);
    if (Interleaved(s.format)) size = (size + kX16Rows - 1) / kX16Rows * kX16Rows;  // whole tiles
    for (int64_t first = 0; first < s.rows; first += size) {
      out.push_back({&s, rows, first, std::min(s.rows, first + size)});
    }
  }
}

void RunClaims(ffi::ThreadPool& pool, const std::vector<Claim>& claims, bool int8_activations,
               bool avx512_vnni) {
  jaxinfer::ParallelFor(pool, static_cast<int64_t>(claims.size()), [&](int64_t c) {
    const Claim& claim = claims[c];
    const Segment& s = *claim.segment;
    RunSegment(s.format, *claim.rows, s.data, s.row_bytes, claim.first, claim.stop,
               s.out_first, int8_activations, avx512_vnni);
  });
}

ffi::Error CheckVnni(bool avx512_vnni, const char* name) {
  if (avx512_vnni && !Vnni512Supported()) {
    return ffi::Error::InvalidArgument(
        std::string(name) +
        ": avx512_vnni asked for on a CPU without AVX-512 (F, BW, VL, DQ) and VNNI");
  }
  return ffi::Error::Success();
}

ffi::Error GGUFMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> data,
                      ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> layer,
                      ffi::Buffer<ffi::S32> valid, ffi::ResultBuffer<ffi::F32> y,
                      bool int8_activations, bool avx512_vnni) {
  if (ffi::Error error = CheckVnni(avx512_vnni, "gguf_matmul"); error.failure()) return error;
  const auto x_dims = x.dimensions();
  const auto y_dims = y->dimensions();
  if (x_dims.size() != 2 || y_dims.size() != 2 || y_dims[0] != x_dims[0]) {
    return ffi::Error::InvalidArgument("gguf_matmul: x [M, K] and y [M, N]");
  }
  const int64_t k = x_dims[1], n = y_dims[1];
  std::vector<Segment> segments;
  if (ffi::Error error = Segments(data, table, layer.typed_data()[0], k, n, segments);
      error.failure()) {
    return error;
  }
  // Rows of x past `valid` are a step's padding: their outputs are zeros, not computed.
  const int64_t m = std::clamp<int64_t>(valid.typed_data()[0], 0, x_dims[0]);
  std::fill(y->typed_data() + m * n, y->typed_data() + x_dims[0] * n, 0.0f);
  if (m == 0 || n == 0) return ffi::Error::Success();
  QuantizedX qx;
  if (int8_activations) QuantizeX(pool, x.typed_data(), m, k, segments, avx512_vnni, qx);
  Rows rows{x.typed_data(), &qx, y->typed_data(), m, n, k};
  std::vector<float> lanes;
  if (TakesLanes(segments, m, int8_activations, avx512_vnni)) {
    LaneOrder(x.typed_data(), m, k, lanes);
    rows.x_lanes = lanes.data();
  }
  std::vector<Claim> claims;
  AddClaims(segments, &rows, claims);
  RunClaims(pool, claims, int8_activations, avx512_vnni);
  return ffi::Error::Success();
}

// The experts of a MoE layer: y[M, N], product rows offsets[g] .. offsets[g] + group_sizes[g]
// times weight `layer * G + g` of the stack (data u8[L G, B], table i32[L G, S, 3]), rows
// after the last group zeros. x_rows (i32[M], or empty) gathers product row r from x[x_rows[r]]
// and y_rows (i32[M], a permutation, or empty) writes it to y[y_rows[r]]. Each group's x is
// rounded on its own (as the matmul above rounds its x) and every group's claims share one
// parallel loop.
ffi::Error GGUFGroupedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::U8> data, ffi::Buffer<ffi::S32> table,
                             ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> group_sizes,
                             ffi::Buffer<ffi::S32> x_rows, ffi::Buffer<ffi::S32> y_rows,
                             ffi::ResultBuffer<ffi::F32> y, bool int8_activations,
                             bool avx512_vnni) {
  const char* name = "gguf_grouped_matmul";
  if (ffi::Error error = CheckVnni(avx512_vnni, name); error.failure()) return error;
  const auto x_dims = x.dimensions();
  const auto y_dims = y->dimensions();
  const int64_t groups = static_cast<int64_t>(group_sizes.element_count());
  const int64_t gather = static_cast<int64_t>(x_rows.element_count());
  const int64_t scatter = static_cast<int64_t>(y_rows.element_count());
  if (x_dims.size() != 2 || y_dims.size() != 2) {
    return ffi::Error::InvalidArgument("gguf_grouped_matmul: x [X, K] and y [M, N]");
  }
  const int64_t m = y_dims[0], n = y_dims[1], k = x_dims[1];
  if ((gather ? gather : x_dims[0]) != m || (scatter && scatter != m)) {
    return ffi::Error::InvalidArgument(
        "gguf_grouped_matmul: x [M, K] (or x_rows [M]), y_rows [M] and y [M, N]");
  }
  const int32_t* xr = x_rows.typed_data();
  const int32_t* yr = y_rows.typed_data();
  for (int64_t r = 0; r < gather; ++r) {
    if (xr[r] < 0 || xr[r] >= x_dims[0]) {
      return ffi::Error::InvalidArgument("gguf_grouped_matmul: x_rows out of range");
    }
  }
  for (int64_t r = 0; r < scatter; ++r) {
    if (yr[r] < 0 || yr[r] >= m) {
      return ffi::Error::InvalidArgument("gguf_grouped_matmul: y_rows out of range");
    }
  }
  struct Group {
    std::vector<Segment> segments;
    QuantizedX qx;
    std::vector<float> xg, yg;  // the gathered rows, the rows to scatter
    std::vector<float> lanes;  // x in LaneOrder (TakesLanes)
    Rows rows{};
    int64_t first = 0;
  };
  std::vector<Group> work(groups);  // never resized: claims point into it
  const int64_t base = static_cast<int64_t>(layer.typed_data()[0]) * groups;
  const float* xs = x.typed_data();
  float* ys = y->typed_data();
  std::vector<Claim> claims;
  int64_t offset = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t size = std::min<int64_t>(std::max(group_sizes.typed_data()[g], 0), m - offset);
    if (size <= 0) continue;
    Group& group = work[g];
    group.first = offset;
    if (ffi::Error error = Segments(data, table, base + g, k, n, group.segments);
        error.failure()) {
      return error;
    }
    const float* gx = xs + offset * k;
    if (gather) {
      group.xg.resize(size * k);
      for (int64_t r = 0; r < size; ++r) {
        std::memcpy(group.xg.data() + r * k, xs + xr[offset + r] * k, k * sizeof(float));
      }
      gx = group.xg.data();
    }
    float* gy = ys + offset * n;
    if (scatter) {
      group.yg.resize(size * n);
      gy = group.yg.data();
    }
    if (int8_activations) QuantizeX(pool, gx, size, k, group.segments, avx512_vnni, group.qx);
    group.rows = Rows{gx, &group.qx, gy, size, n, k};
    if (TakesLanes(group.segments, size, int8_activations, avx512_vnni)) {
      LaneOrder(gx, size, k, group.lanes);
      group.rows.x_lanes = group.lanes.data();
    }
    AddClaims(group.segments, &group.rows, claims);
    offset += size;
  }
  RunClaims(pool, claims, int8_activations, avx512_vnni);
  for (int64_t r = offset; r < m; ++r) {  // past the last group: zeros
    std::fill_n(ys + (scatter ? yr[r] : r) * n, n, 0.0f);
  }
  if (scatter) {
    for (const Group& group : work) {
      for (int64_t r = 0; r < group.rows.m && !group.yg.empty(); ++r) {
        std::memcpy(ys + yr[group.first + r] * n, group.yg.data() + r * n, n * sizeof(float));
      }
    }
  }
  return ffi::Error::Success();
}

// out[T, K] = the exact float32 rows ids[T] of the weight (an embedding table's lookup).
template <int F>
void DequantizeRow(const uint8_t* w, int64_t k, float* out) {
  for (int64_t b = 0; b < k / kValues<F>; ++b) {
    const Block<F> block(w + b * kBytes<F>);
#pragma GCC unroll 8
    for (int g = 0; g < kValues<F> / 32; ++g) {
      __m256 v[4];
      Dequantize<F>(block, g, v);
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) _mm256_storeu_ps(out + b * kValues<F> + 32 * g + 8 * q, v[q]);
    }
  }
}

// Row `row` of a segment (its bytes from `data`, rows of `row_bytes`), exact.
void DequantizeRowOf(int32_t f, const uint8_t* data, int64_t row_bytes, int64_t row, int64_t k,
                     float* out) {
  const uint8_t* w = data + row * row_bytes;
  switch (f) {
    case kQ4_0: return DequantizeRow<kQ4_0>(w, k, out);
    case kQ4_1: return DequantizeRow<kQ4_1>(w, k, out);
    case kQ5_0: return DequantizeRow<kQ5_0>(w, k, out);
    case kQ5_1: return DequantizeRow<kQ5_1>(w, k, out);
    case kQ8_0: return DequantizeRow<kQ8_0>(w, k, out);
    case kQ4_K: return DequantizeRow<kQ4_K>(w, k, out);
    case kQ5_K: return DequantizeRow<kQ5_K>(w, k, out);
    case kQ6_K: return DequantizeRow<kQ6_K>(w, k, out);
    case kQ4_0X16: return X16DequantizeRow<kQ4_0X16>(data, row_bytes, row, k, out);
    case kQ4_1X16: return X16DequantizeRow<kQ4_1X16>(data, row_bytes, row, k, out);
    case kQ5_0X16: return X16DequantizeRow<kQ5_0X16>(data, row_bytes, row, k, out);
    case kQ8_0X16: return X16DequantizeRow<kQ8_0X16>(data, row_bytes, row, k, out);
    case kQ4_KX16: return X16DequantizeRow<kQ4_KX16>(data, row_bytes, row, k, out);
    case kQ6_KX16: return X16DequantizeRow<kQ6_KX16>(data, row_bytes, row, k, out);
  }
}

ffi::Error GGUFRows(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::U8> data,
                    ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> layer,
                    ffi::ResultBuffer<ffi::F32> out) {
  const auto out_dims = out->dimensions();
  const int64_t t = static_cast<int64_t>(ids.element_count());
  if (out_dims.size() != 2 || out_dims[0] != t) {
    return ffi::Error::InvalidArgument("gguf_rows: ids [T] and out [T, K]");
  }
  const int64_t k = out_dims[1];
  std::vector<Segment> segments;
  int64_t n = 0;
  {
    // N is the sum of the segments' rows.
    const int64_t s_count = table.dimensions()[1];
    const int64_t l = layer.typed_data()[0];
    if (table.dimensions().size() == 3 && l >= 0 && l < table.dimensions()[0]) {
      for (int64_t s = 0; s < s_count; ++s) n += table.typed_data()[(l * s_count + s) * 3 + 1];
    }
  }
  if (ffi::Error error = Segments(data, table, layer.typed_data()[0], k, n, segments);
      error.failure()) {
    return error;
  }
  const int32_t* id = ids.typed_data();
  float* o = out->typed_data();
  jaxinfer::ParallelFor(pool, (t + 7) / 8, [&](int64_t c) {
    for (int64_t i = 8 * c; i < std::min(t, 8 * c + 8); ++i) {
      const int64_t row = std::clamp<int64_t>(id[i], 0, n - 1);
      for (const Segment& s : segments) {
        if (row < s.out_first + s.rows) {
          DequantizeRowOf(s.format, s.data, s.row_bytes, row - s.out_first, k, o + i * k);
          break;
        }
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferGGUFMatmul, GGUFMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // data [L, B]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // table [L, S, 3]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // valid [] (rows of x)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<bool>("int8_activations")
                                  .Attr<bool>("avx512_vnni"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferGGUFGroupedMatmul, GGUFGroupedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [X, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // data [L G, B]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // table [L G, S, 3]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [G]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // x_rows [M] or [0]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // y_rows [M] or [0]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
                                  .Attr<bool>("int8_activations")
                                  .Attr<bool>("avx512_vnni"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferGGUFRows, GGUFRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [T]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // data [L, B]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // table [L, S, 3]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [T, K]

// Whether this CPU runs the kernel (it is compiled for AVX2, FMA and F16C).
extern "C" int jaxinfer_gguf_matmul_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

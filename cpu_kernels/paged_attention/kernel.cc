// Ragged paged attention for XLA:CPU through the XLA FFI (AVX2 + FMA), float32: the same
// contract as pallas_kernels/ragged_paged_attention/reference.py.
//
// The cache is float32, or quantized (pallas_kernels/ragged_paged_attention/kv_quant.py): int8
// with a float32 scale per position and kv head, or fp8 (e4m3fn, e5m2) with one scale per kv
// head. Quantized values are converted to float in registers as each K or V vector is loaded
// (fp8 through a table of its 256 values); int8's scales multiply each position's scores and
// weights, fp8's are folded into the queries and the output. A decode reads a quarter of
// float32's bytes from memory.
//
// One flattened batch mixes prefill chunks and decodes: request r owns query tokens
// query_start_loc[r] : query_start_loc[r + 1], the last tokens of its context of seq_lens[r]
// positions, whose K/V are already in the cache blocks block_tables[r]. Attention is causal
// (and limited to a sliding window when one is given).
//
// Work is split into items of (request, kv head, up to kQueryBlock query tokens); an item's
// rows are its tokens times the G query heads that share the kv head. The rows of one token
// and kv head go through a block together, up to three at a time, so each K and V vector read
// (and converted) serves all of them. A decode (one query token) whose batch has enough of
// them takes every kv head in one item instead: each position's K and V are then one
// contiguous run. Each item walks its context one cache block at a time with an online
// softmax: scores of every row against the block's positions it may see (four at a time),
// one rescale of the running sums, then those positions' V weighted into each row's
// accumulator.
//
// A decode reads each cache block once, from memory, and the next block sits anywhere in the
// cache, where no hardware prefetcher looks: so while a decode item computes one block, it
// fetches the next one's K and V lines (after its last block, the first block of the item its
// thread likely takes next), a share per group of rows. On the default model's decode shapes (30
// layers, the cache cold) this took the kernel to 0.68-0.77x the time.
// Tokens that belong to no real request get zeros.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kQueryBlock = 4;  // query tokens of one request per work item
constexpr int kMaxRows = 64;  // rows (tokens x query heads) per item
constexpr int kMinDecodeItems = 8;  // fewer decodes than this: one item per kv head each
constexpr int kMaxBlockSize = 128;
constexpr int kMaxHeadDim = 256;

struct Shapes {
  int64_t tokens, heads, head_dim, kv_heads, group, layers, num_blocks, block_size, max_blocks,
      requests;
};

struct Item {
  int32_t request, kv_head, num_kv_heads, first_token, num_tokens;
};

struct Inputs {
  const float* q;  // [T, H, D]
  const void* kv;  // [L, 2, NB, BS, K, D]: float32, int8 or fp8
  int64_t kv_bytes;  // bytes per cache element
  // int8: [L, 2, NB, BS, K] (scale_stride K: one per position and head); fp8: [L, 2, K]
  // (scale_stride 0); float32: unused
  const float* scales;
  int64_t scale_stride;
  const int32_t* block_tables;  // [R, MB]
  const int32_t* seq_lens;  // [R]
  const int32_t* query_start_loc;  // [R + 1]
  int64_t layer;
  float sm_scale;
  int64_t sliding_window;  // 0: none
  float* out;  // [T, H, D]
  Shapes s;
};

// How 8 consecutive cache elements become 8 floats (before their scale).
struct Float32Values {
  using T = float;
  static constexpr bool kQuantized = false;
  __m256 Load8(const float* p) const { return _mm256_loadu_ps(p); }
};

struct Int8Values {
  using T = int8_t;
  static constexpr bool kQuantized = true;
  __m256 Load8(const int8_t* p) const {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
};

struct Fp8Values {  // through a table of the format's 256 values
  using T = uint8_t;
  static constexpr bool kQuantized = true;
  const float* table;
  __m256 Load8(const uint8_t* p) const {
    const __m256i index =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_i32gather_ps(table, index, 4);
  }
};

float DecodeE4M3FN(int b) {  // 4 exponent bits (bias 7), 3 mantissa bits, NaN at S.1111.111
  const int exponent = (b >> 3) & 15, mantissa = b & 7;
  float value = exponent == 15 && mantissa == 7 ? NAN
                : exponent == 0                  ? std::ldexp(mantissa / 8.0f, -6)
                                                 : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
  return b & 128 ? -value : value;
}

float DecodeE5M2(int b) {  // 5 exponent bits (bias 15), 2 mantissa bits, IEEE inf / NaN
  const int exponent = (b >> 2) & 31, mantissa = b & 3;
  float value = exponent == 31 ? (mantissa ? NAN : INFINITY)
                : exponent == 0 ? std::ldexp(mantissa / 4.0f, -14)
                                : std::ldexp(1.0f + mantissa / 4.0f, exponent - 15);
  return b & 128 ? -value : value;
}

template <float (*Decode)(int)>
const float* Fp8Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t;
    for (int b = 0; b < 256; ++b) t[b] = Decode(b);
    return t;
  }();
  return table.data();
}

inline float Max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// out[r][j] = q[r] . k_j for the R query rows of one kv head and positions j in [0, count),
// k_j = k + j * stride (converted by `format`, unscaled): P positions at a time with an
// accumulator per row and position (8 independent FMA chains for R x P = 1 x 8 or 2 x 4), so
// every K vector read serves all R rows; each row's P sums are reduced together by rounds of
// pairwise adds.
template <int R, int P, class F>
inline void ScoresGroup(const F& format, const float* const* q, const typename F::T* k,
                        int64_t stride, int count, int64_t d, float* const* out) {
  static_assert(P == 4 || P == 8);
  int j = 0;
  for (; j + P <= count; j += P) {
    __m256 a[R][P];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int u = 0; u < P; ++u) a[r][u] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < d; i += 8) {
      __m256 qv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) qv[r] = _mm256_loadu_ps(q[r] + i);
#pragma GCC unroll 8
      for (int u = 0; u < P; ++u) {
        const __m256 kv = format.Load8(k + (j + u) * stride + i);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) a[r][u] = _mm256_fmadd_ps(qv[r], kv, a[r][u]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      // [0 1 2 3 | 0 1 2 3]: each half holds half of the sums of positions 0-3
      const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]),
                                          _mm256_hadd_ps(a[r][2], a[r][3]));
      if constexpr (P == 4) {
        _mm_storeu_ps(out[r] + j, _mm_add_ps(_mm256_castps256_ps128(s0123),
                                             _mm256_extractf128_ps(s0123, 1)));
      } else {
        const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[r][4], a[r][5]),
                                            _mm256_hadd_ps(a[r][6], a[r][7]));
        _mm256_storeu_ps(out[r] + j,
                         _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                       _mm256_permute2f128_ps(s0123, s4567, 0x31)));
      }
    }
  }
  for (; j < count; ++j) {
    for (int r = 0; r < R; ++r) {
      __m256 sum = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) {
        sum = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + i), format.Load8(k + j * stride + i), sum);
      }
      out[r][j] = jaxinfer::Sum(sum);
    }
  }
}

// acc[r][i : i + 8 NV] = acc[r] * c[r] + sum_j p[r][j] * v_j[i : i + 8 NV] for the R rows of
// one kv head, j in [0, count), v_j = v + j * stride: R x NV accumulators in registers (8 for
// R x NV = 1 x 8 or 2 x 4), every V vector read serving all R rows, the FMAs of one position
// independent of each other.
template <int R, int NV, class F>
inline void AccumulateChunk(const F& format, float* const* acc, const float* c,
                            const float* const* p, const typename F::T* v, int64_t stride,
                            int count, int64_t i) {
  __m256 a[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m256 scale = _mm256_set1_ps(c[r]);
#pragma GCC unroll 8
    for (int u = 0; u < NV; ++u) a[r][u] = _mm256_mul_ps(_mm256_loadu_ps(acc[r] + i + 8 * u), scale);
  }
  for (int j = 0; j < count; ++j) {
    __m256 w[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) w[r] = _mm256_set1_ps(p[r][j]);
#pragma GCC unroll 8
    for (int u = 0; u < NV; ++u) {
      const __m256 vv = format.Load8(v + j * stride + i + 8 * u);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) a[r][u] = _mm256_fmadd_ps(w[r], vv, a[r][u]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int u = 0; u < NV; ++u) _mm256_storeu_ps(acc[r] + i + 8 * u, a[r][u]);
  }
}

// The whole head dim (a multiple of 8) in chunks of CV vectors (see AccumulateChunk).
template <int R, int CV, class F>
inline void AccumulateGroup(const F& format, float* const* acc, const float* c,
                            const float* const* p, const typename F::T* v, int64_t stride,
                            int count, int64_t d) {
  for (int64_t i = 0; i < d; i += 8 * CV) {
    switch (std::min<int64_t>(CV, (d - i) / 8)) {
      case 8: AccumulateChunk<R, 8>(format, acc, c, p, v, stride, count, i); break;
      case 7: AccumulateChunk<R, 7>(format, acc, c, p, v, stride, count, i); break;
      case 6: AccumulateChunk<R, 6>(format, acc, c, p, v, stride, count, i); break;
      case 5: AccumulateChunk<R, 5>(format, acc, c, p, v, stride, count, i); break;
      case 4: AccumulateChunk<R, 4>(format, acc, c, p, v, stride, count, i); break;
      case 3: AccumulateChunk<R, 3>(format, acc, c, p, v, stride, count, i); break;
      case 2: AccumulateChunk<R, 2>(format, acc, c, p, v, stride, count, i); break;
      default: AccumulateChunk<R, 1>(format, acc, c, p, v, stride, count, i); break;
    }
  }
}

// The online softmax of one row over a block's scores p[0:n] (replaced by their exps
// relative to the new running max); returns the factor the row's sums are rescaled by.
inline float SoftmaxStep(float* p, int n, float& running_max, float& denom) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(p + j));
  float block_max = Max(m);
  for (; j < n; ++j) block_max = std::max(block_max, p[j]);
  const float new_max = std::max(running_max, block_max);
  const float correction = running_max == -INFINITY ? 0.0f : std::exp(running_max - new_max);
  __m256 sums = _mm256_setzero_ps();
  j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = jaxinfer::Exp(_mm256_sub_ps(_mm256_loadu_ps(p + j), _mm256_set1_ps(new_max)));
    _mm256_storeu_ps(p + j, e);
    sums = _mm256_add_ps(sums, e);
  }
  float block_sum = jaxinfer::Sum(sums);
  for (; j < n; ++j) {
    p[j] = std::exp(p[j] - new_max);
    block_sum += p[j];
  }
  denom = denom * correction + block_sum;
  running_max = new_max;
  return correction;
}

// Cache lines of a block's K and V fetched ahead of their use, a share at a time.
class Fetch {
 public:
  // `lines`: room for the lines of a whole block (LinesPerBlock).
  explicit Fetch(const char** lines) : lines_(lines) {}

  static int64_t LinesPerBlock(const Inputs& in) {
    const Shapes& s = in.s;
    return 2 * s.block_size * ((s.kv_heads * s.head_dim * in.kv_bytes + 63) / 64) +
           2 * ((s.block_size * s.kv_heads * int64_t{sizeof(float)} + 63) / 64 + 1);
  }

  // The K and V lines of the heads [kv_head, kv_head + num_kv_heads) of `count` positions of
  // cache block `block`, to be issued in `shares` shares.
  void Plan(const Inputs& in, int64_t block, int count, int32_t kv_head, int32_t num_kv_heads,
            int shares) {
    const Shapes& s = in.s;
    const int64_t stride = s.kv_heads * s.head_dim * in.kv_bytes;  // bytes per position
    const int64_t span = num_kv_heads * s.head_dim * in.kv_bytes;
    const int64_t block_bytes = s.block_size * stride;
    const char* k = reinterpret_cast<const char*>(in.kv) +
                    (in.layer * 2 * s.num_blocks + block) * block_bytes +
                    kv_head * s.head_dim * in.kv_bytes;
    const char* v = k + s.num_blocks * block_bytes;
    num_ = 0;
    for (int j = 0; j < count; ++j) {
      for (int64_t i = 0; i < span; i += 64) {
        lines_[num_++] = k + j * stride + i;
        lines_[num_++] = v + j * stride + i;
      }
    }
    if (in.scale_stride > 0) {  // the block's per-position scales
      const int64_t scale_block = s.block_size * s.kv_heads;
      const char* ks = reinterpret_cast<const char*>(
          in.scales + (in.layer * 2 * s.num_blocks + block) * scale_block);
      const char* vs = ks + s.num_blocks * scale_block * sizeof(float);
      for (int64_t i = 0; i < count * s.kv_heads * int64_t{sizeof(float)}; i += 64) {
        lines_[num_++] = ks + i;
        lines_[num_++] = vs + i;
      }
    }
    share_ = (num_ + shares - 1) / shares;
    issued_ = 0;
  }

  void IssueShare() {
    for (const int stop = std::min(num_, issued_ + share_); issued_ < stop; ++issued_) {
      _mm_prefetch(lines_[issued_], _MM_HINT_T0);
    }
  }

  void Clear() { num_ = share_ = issued_ = 0; }

 private:
  const char** lines_;
  int num_ = 0, share_ = 0, issued_ = 0;
};

// The cache block an item reads first: where its first token's visible positions start.
int64_t FirstBlock(const Inputs& in, const Item& item) {
  const int64_t position =
      in.seq_lens[item.request] - (in.query_start_loc[item.request + 1] - item.first_token);
  const int64_t start =
      in.sliding_window > 0 ? std::max<int64_t>(0, position - in.sliding_window + 1) : 0;
  return start / in.s.block_size;
}

// Query rows of one token and one kv head taken together through a block of a quantized
// cache: its values are converted once for all of them. (A float32 cache goes one row at a
// time, eight positions or 64 dims per step: sharing loads between rows made it slower.)
constexpr int kGroupRows = 2;

// The scales of a block's positions for a cache with one per position (int8); none else.
struct BlockScales {
  const float* k = nullptr;  // the first position's key scale of the group's kv head
  const float* v = nullptr;
  int64_t stride = 0;  // floats between positions
};

// One group of R rows (r0 .. r0 + R - 1, one token, one kv head) through positions [j0, j0 +
// n) of a block whose K and V of that head start at k and v: scores, scaled per position
// when the cache says so, the online softmax of each row, then the weighted values.
template <int R, class F>  // R: 1 or 2
void RunGroup(const F& format, const typename F::T* k, const typename F::T* v,
              int64_t stride, const BlockScales& scales, int n, int64_t d, int r0, float* q,
              float* acc, float* running_max, float* denom, float* scratch) {
  const float* q_rows[R];
  float* acc_rows[R];
  float* p[R];  // the scores, then their exps
  float* w[R];  // the exps times the value scales (p itself without them)
  float correction[R];
  for (int r = 0; r < R; ++r) {
    q_rows[r] = q + (r0 + r) * d;
    acc_rows[r] = acc + (r0 + r) * d;
    p[r] = scratch + r * kMaxBlockSize;
    w[r] = scales.v != nullptr ? scratch + (R + r) * kMaxBlockSize : p[r];
  }
  // 8 independent FMA chains either way, with the accumulators in registers
  constexpr int kPositions = R == 1 ? 8 : 4;
  constexpr int kChunk = R == 1 ? 8 : 4;
  ScoresGroup<R, kPositions>(format, q_rows, k, stride, n, d, p);
  if (scales.k != nullptr) {
    for (int j = 0; j < n; ++j) {
      const float ks = scales.k[j * scales.stride];
      for (int r = 0; r < R; ++r) p[r][j] *= ks;
    }
  }
  for (int r = 0; r < R; ++r) {
    correction[r] = SoftmaxStep(p[r], n, running_max[r0 + r], denom[r0 + r]);
  }
  if (scales.v != nullptr) {
    for (int j = 0; j < n; ++j) {
      const float vs = scales.v[j * scales.stride];
      for (int r = 0; r < R; ++r) w[r][j] = p[r][j] * vs;
    }
  }
  AccumulateGroup<R, kChunk>(format, acc_rows, correction, w, v, stride, n, d);
}

// `next`: the item this thread likely takes next, or nullptr.
template <class F>
void RunItem(const Inputs& in, const F& format, const Item& item, const Item* next) {
  using T = typename F::T;
  const Shapes& s = in.s;
  const int64_t d = s.head_dim, bs = s.block_size, g = s.group;
  const int per_token = item.num_kv_heads * g;  // rows of one token: its query heads
  const int rows = item.num_tokens * per_token;
  const int32_t query_end = in.query_start_loc[item.request + 1];
  const int32_t seq_len = in.seq_lens[item.request];
  int64_t first[kMaxRows], last[kMaxRows];  // visible positions [first, last] of each row
  float running_max[kMaxRows], denom[kMaxRows];
  // A cache with one scale per kv head (fp8) has them folded into the queries (keys) and
  // the output (values); one with a scale per position (int8) scales scores and weights.
  const bool per_head = in.scales != nullptr && in.scale_stride == 0;
  const int64_t scale_block = in.scale_stride * bs;  // a block's scales of one part (K or V)
  const int64_t scale_part = in.scale_stride > 0 ? s.num_blocks * scale_block : s.kv_heads;
  const float* k_scales =
      in.scales != nullptr ? in.scales + in.layer * 2 * scale_part + item.kv_head : nullptr;
  const float* v_scales = in.scales != nullptr ? k_scales + scale_part : nullptr;
  // q [rows, D] (scaled), acc [rows, D], the scores of a group
  thread_local std::vector<float> scratch;
  scratch.resize(2 * rows * d + 2 * kGroupRows * kMaxBlockSize);
  float* q = scratch.data();
  float* acc = q + rows * d;
  float* group_scratch = acc + rows * d;
  int64_t lo = INT64_MAX, hi = -1;
  for (int t = 0; t < item.num_tokens; ++t) {
    const int64_t token = item.first_token + t;
    const int64_t position = seq_len - (query_end - token);
    const int64_t start =
        in.sliding_window > 0 ? std::max<int64_t>(0, position - in.sliding_window + 1) : 0;
    for (int h = 0; h < per_token; ++h) {
      const int r = t * per_token + h;
      first[r] = start;
      last[r] = position;
      const float scale = in.sm_scale * (per_head ? k_scales[h / g] : 1.0f);
      const float* src = in.q + (token * s.heads + item.kv_head * g + h) * d;
      for (int64_t i = 0; i < d; ++i) q[r * d + i] = src[i] * scale;
      running_max[r] = -INFINITY;
      denom[r] = 0.0f;
      std::memset(acc + r * d, 0, d * sizeof(float));
    }
    lo = std::min(lo, start);
    hi = std::max(hi, position);
  }
  const int32_t* table = in.block_tables + int64_t{item.request} * s.max_blocks;
  const int64_t stride = s.kv_heads * d;  // elements between positions in a block
  const int64_t block_elements = bs * stride;
  const T* k_layer = static_cast<const T*>(in.kv) +
                     (in.layer * 2) * s.num_blocks * block_elements + item.kv_head * d;
  const T* v_layer = k_layer + s.num_blocks * block_elements;
  const bool decode = item.num_tokens == 1;  // reads each block once: fetch ahead
  constexpr int group_rows = F::kQuantized ? kGroupRows : 1;
  const int groups_per_head = static_cast<int>((g + group_rows - 1) / group_rows);
  const int groups = item.num_tokens * item.num_kv_heads * groups_per_head;
  thread_local std::vector<const char*> lines;
  lines.resize(Fetch::LinesPerBlock(in));
  Fetch fetch(lines.data());
  const int64_t last_block = hi / bs;
  for (int64_t b = lo / bs; b <= last_block; ++b) {
    const int64_t base = b * bs;
    const int count = static_cast<int>(std::min<int64_t>(bs, hi + 1 - base));
    const T* k = k_layer + table[b] * block_elements;
    const T* v = v_layer + table[b] * block_elements;
    fetch.Clear();
    if (decode && b < last_block) {
      const int next_count = static_cast<int>(std::min<int64_t>(bs, hi + 1 - base - bs));
      fetch.Plan(in, table[b + 1], next_count, item.kv_head, item.num_kv_heads, groups);
    } else if (decode && next != nullptr && next->num_tokens == 1) {
      const int32_t block = in.block_tables[int64_t{next->request} * s.max_blocks +
                                            FirstBlock(in, *next)];
      fetch.Plan(in, block, static_cast<int>(bs), next->kv_head, next->num_kv_heads, groups);
    }
    for (int t = 0; t < item.num_tokens; ++t) {
      const int r_token = t * per_token;
      // the token's visible positions in this block: [j0, j1)
      const int j0 = static_cast<int>(std::max<int64_t>(first[r_token], base) - base);
      const int j1 = static_cast<int>(std::min<int64_t>(last[r_token] + 1, base + count) - base);
      if (j0 >= j1) continue;
      for (int h = 0; h < item.num_kv_heads; ++h) {
        // only visible positions are read from K and V: the rest may hold stale data
        const T* k_head = k + h * d + j0 * stride;
        const T* v_head = v + h * d + j0 * stride;
        BlockScales scales;
        if (in.scale_stride > 0) {
          const int64_t at = table[b] * scale_block + j0 * in.scale_stride + h;
          scales = {k_scales + at, v_scales + at, in.scale_stride};
        }
        for (int r = r_token + h * g; r < r_token + (h + 1) * g; r += group_rows) {
          fetch.IssueShare();
          const int n = j1 - j0;
          const int size =
              static_cast<int>(std::min<int64_t>(group_rows, r_token + (h + 1) * g - r));
          auto run = [&](auto rows_in_group) {
            RunGroup<decltype(rows_in_group)::value>(format, k_head, v_head, stride, scales, n,
                                                     d, r, q, acc, running_max, denom,
                                                     group_scratch);
          };
          if (size == 2) {
            run(std::integral_constant<int, 2>());
          } else {
            run(std::integral_constant<int, 1>());
          }
        }
      }
    }
  }
  for (int t = 0; t < item.num_tokens; ++t) {
    for (int h = 0; h < per_token; ++h) {
      const int r = t * per_token + h;
      const float inverse = denom[r] > 0.0f ? 1.0f / denom[r] : 0.0f;
      const float scale = inverse * (per_head ? v_scales[h / g] : 1.0f);
      float* dst = in.out + ((item.first_token + t) * s.heads + item.kv_head * g + h) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = acc[r * d + i] * scale;
    }
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv,
                          ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> block_tables,
                          ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                          ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> layer,
                          float sm_scale, int64_t sliding_window,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = kv.dimensions(), bd = block_tables.dimensions();
  const auto sd = scales.dimensions();
  if (qd.size() != 3 || kd.size() != 6 || bd.size() != 2) {
    return ffi::Error::InvalidArgument(
        "paged_attention: q [T, H, D], kv_cache [L, 2, NB, BS, K, D], block_tables [R, MB]");
  }
  Shapes s{qd[0], qd[1], qd[2], kd[4], 0, kd[0], kd[2], kd[3], bd[1], bd[0]};
  if (kd[1] != 2 || kd[5] != s.head_dim || s.kv_heads == 0 || s.heads % s.kv_heads != 0) {
    return ffi::Error::InvalidArgument("paged_attention: q and kv_cache do not match");
  }
  s.group = s.heads / s.kv_heads;
  if (s.head_dim % 8 != 0 || s.head_dim > kMaxHeadDim || s.block_size > kMaxBlockSize ||
      s.group > kMaxRows) {
    return ffi::Error::InvalidArgument(
        "paged_attention: needs head_dim a multiple of 8 up to 256, block_size up to 128 and "
        "at most 64 query heads per kv head");
  }
  const ffi::DataType type = kv.element_type();
  const bool per_position = type == ffi::DataType::S8;
  const bool per_head = type == ffi::DataType::F8E4M3FN || type == ffi::DataType::F8E5M2;
  if (!per_position && !per_head && type != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("paged_attention: kv_cache must be float32, int8 or fp8");
  }
  const bool scales_match =
      per_position ? sd.size() == 5 && sd[0] == s.layers && sd[1] == 2 &&
                         sd[2] == s.num_blocks && sd[3] == s.block_size && sd[4] == s.kv_heads
      : per_head ? sd.size() == 3 && sd[0] == s.layers && sd[1] == 2 && sd[2] == s.kv_heads
                 : true;
  if (!scales_match) {
    return ffi::Error::InvalidArgument(
        "paged_attention: kv_scales must be [L, 2, NB, BS, K] for int8, [L, 2, K] for fp8");
  }
  const int64_t layer_index = layer.typed_data()[0];
  if (layer_index < 0 || layer_index >= s.layers) {
    return ffi::Error::InvalidArgument("paged_attention: layer out of range");
  }
  Inputs in{q.typed_data(),
            kv.untyped_data(),
            type == ffi::DataType::F32 ? int64_t{sizeof(float)} : 1,
            type == ffi::DataType::F32 ? nullptr : scales.typed_data(),
            per_position ? s.kv_heads : 0,
            block_tables.typed_data(),
            seq_lens.typed_data(),
            query_start_loc.typed_data(),
            layer_index,
            sm_scale,
            sliding_window,
            out->typed_data(),
            s};
  const int64_t real = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, s.requests);
  const int32_t* starts = in.query_start_loc;
  const int tokens_per_item = std::max<int>(1, std::min<int64_t>(kQueryBlock, kMaxRows / s.group));
  // Decodes take all their kv heads in one item (as many as fit kMaxRows) when there are
  // enough of them to share out over the threads.
  int64_t decodes = 0;
  for (int32_t r = 0; r < real; ++r) decodes += starts[r + 1] - starts[r] == 1;
  const int decode_heads = decodes >= kMinDecodeItems
                               ? std::max<int>(1, std::min<int64_t>(s.kv_heads, kMaxRows / s.group))
                               : 1;
  std::vector<Item> items;
  for (int32_t r = 0; r < real; ++r) {
    const int heads = starts[r + 1] - starts[r] == 1 ? decode_heads : 1;
    for (int32_t t = starts[r]; t < starts[r + 1]; t += tokens_per_item) {
      const int32_t n = std::min<int32_t>(tokens_per_item, starts[r + 1] - t);
      for (int32_t h = 0; h < s.kv_heads; h += heads) {
        items.push_back({r, h, std::min<int32_t>(heads, s.kv_heads - h), t, n});
      }
    }
  }
  const int64_t covered = real > 0 ? std::clamp<int64_t>(starts[real], 0, s.tokens) : 0;
  std::memset(in.out + covered * s.heads * s.head_dim, 0,
              (s.tokens - covered) * s.heads * s.head_dim * sizeof(float));
  // Threads claim items in turn, so a thread's next item is about one per thread further on.
  const int64_t count = static_cast<int64_t>(items.size());
  const int64_t ahead = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), count));
  auto run = [&](const auto& format) {
    jaxinfer::ParallelFor(pool, count, [&in, &format, &items, count, ahead](int64_t i) {
      RunItem(in, format, items[i], i + ahead < count ? &items[i + ahead] : nullptr);
    });
  };
  if (type == ffi::DataType::S8) {
    run(Int8Values{});
  } else if (type == ffi::DataType::F8E4M3FN) {
    run(Fp8Values{Fp8Table<DecodeE4M3FN>()});
  } else if (type == ffi::DataType::F8E5M2) {
    run(Fp8Values{Fp8Table<DecodeE5M2>()});
  } else {
    run(Float32Values{});
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, H, D]
                                  .Arg<ffi::AnyBuffer>()  // kv_cache [L, 2, NB, BS, K, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // kv_scales (see Inputs)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [R, MB]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc [R + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, H, D]
);

extern "C" int jaxinfer_paged_attention_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// Ragged paged attention for XLA:CPU through the XLA FFI (AVX2 + FMA), float32: the same
// contract as pallas_kernels/ragged_paged_attention/reference.py.
//
// The cache is float32, or quantized (pallas_kernels/ragged_paged_attention/kv_quant.py): int8
// with a float32 scale per position and kv head, or fp8 (e4m3fn, e5m2) with one scale per kv
// head. A quantized block is dequantized, scales applied, into a small float32 tile of the
// item's heads as the item reaches it (it stays in L1 while every row of the item reads it),
// and the float32 code below runs on the tile: each byte of the cache is read from memory
// once, a quarter of float32's.
//
// One flattened batch mixes prefill chunks and decodes: request r owns query tokens
// query_start_loc[r] : query_start_loc[r + 1], the last tokens of its context of seq_lens[r]
// positions, whose K/V are already in the cache blocks block_tables[r]. Attention is causal
// (and limited to a sliding window when one is given).
//
// Work is split into items of (request, kv head, up to kQueryBlock query tokens); an item's
// rows are its tokens times the G query heads that share the kv head, so each K and V vector
// read from the cache serves all of them. A decode (one query token) whose batch has enough of
// them takes every kv head in one item instead: each position's K and V are then one
// contiguous run. Each item walks its context one cache block at a time with an online
// softmax: scores of every row against the block's positions it may see (eight at a time),
// one rescale of the running sums, then those positions' V weighted into each row's
// accumulator.
//
// A decode reads each cache block once, from memory, and the next block sits anywhere in the
// cache, where no hardware prefetcher looks: so while a decode item computes one block, it
// fetches the next one's K and V lines (after its last block, the first block of the item its
// thread likely takes next), a share per row. On the default model's decode shapes (30
// layers, the cache cold) this took the kernel to 0.68-0.77x the time.
// Tokens that belong to no real request get zeros.
#include <immintrin.h>

#include <algorithm>
#include <array>
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

// tile[j, h, :] = value(src + j * position_stride + h * d) * scale[j * scale_stride + h] for
// positions j in [j0, j1) and heads h in [0, heads): a cache block's positions of an item's
// heads, dequantized.
template <class F>
void DequantizeTile(const F& format, const typename F::T* src, const float* scale,
                    int64_t position_stride, int64_t scale_stride, int j0, int j1, int heads,
                    int64_t d, float* tile) {
  for (int j = j0; j < j1; ++j) {
    for (int h = 0; h < heads; ++h) {
      const typename F::T* from = src + j * position_stride + h * d;
      float* to = tile + (int64_t{j} * heads + h) * d;
      const __m256 s = _mm256_set1_ps(scale[j * scale_stride + h]);
      for (int64_t i = 0; i < d; i += 8) {
        _mm256_storeu_ps(to + i, _mm256_mul_ps(format.Load8(from + i), s));
      }
    }
  }
}

inline float Dot(const float* a, const float* b, int64_t d) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i < d; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  return jaxinfer::Sum(_mm256_add_ps(acc0, acc1));
}

// scores[j] = q . k_j for j in [0, count), k_j = k + j * stride: eight positions at a time,
// each with its own accumulator (eight independent FMA chains), their eight sums reduced
// together by three rounds of pairwise adds instead of one horizontal sum each.
inline void Scores(const float* q, const float* k, int64_t stride, int count, int64_t d,
                   float* scores) {
  int j = 0;
  for (; j + 8 <= count; j += 8) {
    __m256 a[8];
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        a[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (j + u) * stride + i), a[u]);
      }
    }
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    // s0123 = [0 1 2 3 | 0 1 2 3] (each half holds half of every sum), s4567 likewise
    _mm256_storeu_ps(scores + j,
                     _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                   _mm256_permute2f128_ps(s0123, s4567, 0x31)));
  }
  for (; j < count; ++j) scores[j] = Dot(q, k + j * stride, d);
}

// acc[0:8 NV] = acc * c + sum_j p[j] * v_j[0:8 NV] for j in [0, count), v_j = v + j * stride:
// NV accumulators in registers, so the FMAs of one position are independent of each other.
// (With one accumulator per 8 dims and the positions inner, every FMA waited on the one
// before: the whole kernel took 1.3-1.5x as long on decode steps, 1.5x on a prefill.)
template <int NV>
inline void AccumulateVectors(float* acc, float c, const float* p, const float* v,
                              int64_t stride, int count) {
  __m256 a[NV];
  const __m256 scale = _mm256_set1_ps(c);
#pragma GCC unroll 8
  for (int u = 0; u < NV; ++u) a[u] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * u), scale);
  for (int j = 0; j < count; ++j) {
    const __m256 weight = _mm256_set1_ps(p[j]);
#pragma GCC unroll 8
    for (int u = 0; u < NV; ++u) {
      a[u] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + j * stride + 8 * u), a[u]);
    }
  }
#pragma GCC unroll 8
  for (int u = 0; u < NV; ++u) _mm256_storeu_ps(acc + 8 * u, a[u]);
}

// acc[0:d] = acc * c + sum_j p[j] * v_j for j in [0, count), v_j = v + j * stride; d is a
// multiple of 8, taken 64 dims at a time.
inline void Accumulate(float* acc, float c, const float* p, const float* v, int64_t stride,
                       int count, int64_t d) {
  for (int64_t i = 0; i < d; i += 64) {
    switch (std::min<int64_t>(8, (d - i) / 8)) {
      case 8: AccumulateVectors<8>(acc + i, c, p, v + i, stride, count); break;
      case 7: AccumulateVectors<7>(acc + i, c, p, v + i, stride, count); break;
      case 6: AccumulateVectors<6>(acc + i, c, p, v + i, stride, count); break;
      case 5: AccumulateVectors<5>(acc + i, c, p, v + i, stride, count); break;
      case 4: AccumulateVectors<4>(acc + i, c, p, v + i, stride, count); break;
      case 3: AccumulateVectors<3>(acc + i, c, p, v + i, stride, count); break;
      case 2: AccumulateVectors<2>(acc + i, c, p, v + i, stride, count); break;
      default: AccumulateVectors<1>(acc + i, c, p, v + i, stride, count); break;
    }
  }
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
  int64_t head[kMaxRows];  // offset of each row's kv head in a position's K or V
  float running_max[kMaxRows], denom[kMaxRows];
  // q [rows, D] (scaled), acc [rows, D], and for a quantized cache the K and V tiles
  // [BS, the item's kv heads, D]
  const int64_t tile = F::kQuantized ? bs * item.num_kv_heads * d : 0;
  thread_local std::vector<float> scratch;
  scratch.resize(2 * rows * d + 2 * tile);
  float* q = scratch.data();
  float* acc = q + rows * d;
  float* k_tile = acc + rows * d;
  float* v_tile = k_tile + tile;
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
      head[r] = h / g * d;
      const float* src = in.q + (token * s.heads + item.kv_head * g + h) * d;
      for (int64_t i = 0; i < d; ++i) q[r * d + i] = src[i] * in.sm_scale;
      running_max[r] = -INFINITY;
      denom[r] = 0.0f;
      std::memset(acc + r * d, 0, d * sizeof(float));
    }
    lo = std::min(lo, start);
    hi = std::max(hi, position);
  }
  const int32_t* table = in.block_tables + int64_t{item.request} * s.max_blocks;
  const int64_t cache_stride = s.kv_heads * d;  // elements between positions in a block
  const int64_t block_elements = bs * cache_stride;
  const T* k_layer = static_cast<const T*>(in.kv) +
                     (in.layer * 2) * s.num_blocks * block_elements + item.kv_head * d;
  const T* v_layer = k_layer + s.num_blocks * block_elements;
  // where the K and V scales of the item's first head are (per block, for int8)
  const int64_t scale_block = in.scale_stride * bs;  // 0 for one scale per head
  const int64_t scale_part = in.scale_stride > 0 ? s.num_blocks * scale_block : s.kv_heads;
  const float* k_scales =
      F::kQuantized ? in.scales + in.layer * 2 * scale_part + item.kv_head : nullptr;
  const float* v_scales = F::kQuantized ? k_scales + scale_part : nullptr;
  // floats between positions in what the rows read: the cache, or a tile
  const int64_t position_stride = F::kQuantized ? item.num_kv_heads * d : cache_stride;
  alignas(32) float scores[kMaxBlockSize];
  const bool decode = item.num_tokens == 1;  // reads each block once: fetch ahead
  thread_local std::vector<const char*> lines;
  lines.resize(Fetch::LinesPerBlock(in));
  Fetch fetch(lines.data());
  const int64_t last_block = hi / bs;
  for (int64_t b = lo / bs; b <= last_block; ++b) {
    const int64_t base = b * bs;
    const int count = static_cast<int>(std::min<int64_t>(bs, hi + 1 - base));
    const float* k;
    const float* v;
    if constexpr (F::kQuantized) {
      const int j0 = static_cast<int>(std::max<int64_t>(lo, base) - base);
      const int64_t at = table[b] * scale_block;
      DequantizeTile(format, k_layer + table[b] * block_elements, k_scales + at, cache_stride,
                     in.scale_stride, j0, count, item.num_kv_heads, d, k_tile);
      DequantizeTile(format, v_layer + table[b] * block_elements, v_scales + at, cache_stride,
                     in.scale_stride, j0, count, item.num_kv_heads, d, v_tile);
      k = k_tile;
      v = v_tile;
    } else {
      k = k_layer + table[b] * block_elements;
      v = v_layer + table[b] * block_elements;
    }
    fetch.Clear();
    if (decode && b < last_block) {
      const int next_count = static_cast<int>(std::min<int64_t>(bs, hi + 1 - base - bs));
      fetch.Plan(in, table[b + 1], next_count, item.kv_head, item.num_kv_heads, rows);
    } else if (decode && next != nullptr && next->num_tokens == 1) {
      const int32_t block = in.block_tables[int64_t{next->request} * s.max_blocks +
                                            FirstBlock(in, *next)];
      fetch.Plan(in, block, static_cast<int>(bs), next->kv_head, next->num_kv_heads, rows);
    }
    for (int r = 0; r < rows; ++r) {
      fetch.IssueShare();
      // the row's visible positions in this block: [j0, j1)
      const int j0 = static_cast<int>(std::max<int64_t>(first[r], base) - base);
      const int j1 = static_cast<int>(std::min<int64_t>(last[r] + 1, base + count) - base);
      if (j0 >= j1) continue;
      float* p = scores + j0;
      const int n = j1 - j0;
      Scores(q + r * d, k + head[r] + j0 * position_stride, position_stride, n, d, p);
      float block_max = -INFINITY;
      for (int j = 0; j < n; ++j) block_max = std::max(block_max, p[j]);
      const float new_max = std::max(running_max[r], block_max);
      const float correction =
          running_max[r] == -INFINITY ? 0.0f : std::exp(running_max[r] - new_max);
      __m256 sums = _mm256_setzero_ps();
      int j = 0;
      for (; j + 8 <= n; j += 8) {
        const __m256 e =
            jaxinfer::Exp(_mm256_sub_ps(_mm256_loadu_ps(p + j), _mm256_set1_ps(new_max)));
        _mm256_storeu_ps(p + j, e);
        sums = _mm256_add_ps(sums, e);
      }
      float block_sum = jaxinfer::Sum(sums);
      for (; j < n; ++j) {
        p[j] = std::exp(p[j] - new_max);
        block_sum += p[j];
      }
      denom[r] = denom[r] * correction + block_sum;
      running_max[r] = new_max;
      // only visible positions are read from V: the rest of a block may hold stale data
      Accumulate(acc + r * d, correction, p, v + head[r] + j0 * position_stride, position_stride,
                 n, d);
    }
  }
  for (int t = 0; t < item.num_tokens; ++t) {
    for (int h = 0; h < per_token; ++h) {
      const int r = t * per_token + h;
      const float inverse = denom[r] > 0.0f ? 1.0f / denom[r] : 0.0f;
      float* dst = in.out + ((item.first_token + t) * s.heads + item.kv_head * g + h) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = acc[r * d + i] * inverse;
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
            scales.typed_data(),
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

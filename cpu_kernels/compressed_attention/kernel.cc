// DeepSeek-V4's attention, its Lightning Indexer and its compressor (compressor.h) for XLA:CPU through the XLA FFI (AVX2 +
// FMA), one call over a flattened mixed batch, with the semantics of their pure-JAX
// references (pallas_kernels/compressed_attention/reference.py,
// pallas_kernels/lightning_indexer/reference.py):
//
// - CompressedAttention: each real token's heads attend, in one softmax with a per-head sink
//   logit, to the shared K=V entries of its request's last `window` positions (paged) and to
//   its request's compressed entries (paged): every closed one (mode 1, heavily compressed
//   attention) or the indexer's picks (mode 2, compressed sparse attention); mode 0 has none.
//   Only the entries a token sees are read, where the reference gathers every token's whole
//   window and store.
// - IndexerTopk: each real token's scores over its request's closed entries,
//   sum_h w[t, h] * ReLU(q[t, h] . k[e]) * scale, and the top k of them, best first (ties:
//   the lower index), -1 past the closed ones.
//
// The window's store, the entries' and the indexer's keys come as stacks over layers with the
// layer to read, so a layer of the cache is read in place, never copied out for the call.
// Tokens past query_start_loc[R] are padding: zeros (attention) and -1 (picks).
// (token, head) pairs, or (token, range of entries) for the scores, are shared out over XLA's
// intra-op threads.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <vector>

#include "common.h"
#include "compressor.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kScoreChunk = 512;  // entries a scoring item takes

using jaxinfer::Dot;

// y += a * x over n floats.
void Axpy(float a, const float* x, float* y, int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += a * x[i];
}

// The request of each token (searchsorted(qsl[1:], t, "right"), as the references), -1 for
// padding tokens (at or past qsl[R]); an error where qsl is out of order or range.
bool TokenRequests(const int32_t* qsl, int64_t requests, int64_t tokens,
                   std::vector<int64_t>* request) {
  request->assign(tokens, -1);
  for (int64_t r = 0; r < requests; ++r) {
    if (qsl[r] < 0 || qsl[r + 1] < qsl[r] || qsl[r + 1] > tokens) return false;
    for (int64_t t = qsl[r]; t < qsl[r + 1]; ++t) (*request)[t] = r;
  }
  return qsl[0] >= 0;
}

// A paged store [NB, B, D] read through one request's row of a block table [R, MB].
struct Paged {
  const float* data;
  const int32_t* table;
  int64_t num_blocks, block, dim, width;

  // Entry e of request r (e < width * block), or nullptr where its block is out of range.
  const float* At(int64_t r, int64_t e) const {
    const int64_t b = table[r * width + e / block];
    if (b < 0 || b >= num_blocks) return nullptr;
    return data + (b * block + e % block) * dim;
  }
};

ffi::Error CompressedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> kv, ffi::Buffer<ffi::S32> block_table,
                               ffi::Buffer<ffi::F32> entries,
                               ffi::Buffer<ffi::S32> entry_table, ffi::Buffer<ffi::S32> picks,
                               ffi::Buffer<ffi::F32> sinks,
                               ffi::Buffer<ffi::S32> query_start_loc,
                               ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> kv_layer,
                               ffi::Buffer<ffi::S32> entry_layer, ffi::ResultBuffer<ffi::F32> out,
                               int64_t mode, int64_t window, int64_t ratio, float scale) {
  const auto qd = q.dimensions(), kd = kv.dimensions(), td = block_table.dimensions();
  const auto ed = entries.dimensions(), etd = entry_table.dimensions(), pd = picks.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || ed.size() != 4 ||
      etd.size() != 2 || pd.size() != 2) {
    return ffi::Error::InvalidArgument(
        "compressed_attention: q [T, H, D], kv [L, NB, BS, D], block_table [R, MB], entries "
        "[Lc, NBc, Bc, D], entry_table [R, MBc], picks [T, k]");
  }
  const int64_t tokens = qd[0], heads = qd[1], dim = qd[2], requests = td[0];
  const int64_t layer = kv_layer.typed_data()[0], entry = entry_layer.typed_data()[0];
  if (layer < 0 || layer >= kd[0] || entry < 0 || entry >= ed[0]) {
    return ffi::Error::InvalidArgument("compressed_attention: layer out of range");
  }
  if (kd[3] != dim || ed[3] != dim || etd[0] != requests || pd[0] != tokens ||
      sinks.element_count() != heads || positions.element_count() != tokens ||
      query_start_loc.element_count() != requests + 1 || mode < 0 || mode > 2 || ratio < 1 ||
      window < 1) {
    return ffi::Error::InvalidArgument("compressed_attention: shapes disagree");
  }
  std::vector<int64_t> request;
  if (!TokenRequests(query_start_loc.typed_data(), requests, tokens, &request)) {
    return ffi::Error::InvalidArgument(
        "compressed_attention: query_start_loc out of order or range");
  }
  const float* kv_data = kv.typed_data() + layer * kd[1] * kd[2] * dim;
  const float* entry_data = entries.typed_data() + entry * ed[1] * ed[2] * dim;
  const Paged near{kv_data, block_table.typed_data(), kd[1], kd[2], dim, td[1]};
  const Paged far{entry_data, entry_table.typed_data(), ed[1], ed[2], dim, etd[1]};
  const int64_t span = std::min(window, td[1] * kd[2]);  // (no more than a request holds)
  const int64_t far_capacity = etd[1] * ed[2], num_picks = pd[1];
  const int32_t *pos = positions.typed_data(), *pick = picks.typed_data();
  const float *qs = q.typed_data(), *sink = sinks.typed_data();
  float* os = out->typed_data();
  std::fill(os, os + tokens * heads * dim, 0.0f);
  // The keys each token sees, gathered once per token: its window, then its entries.
  std::vector<std::vector<const float*>> keys(tokens);
  jaxinfer::ParallelFor(pool, tokens, [&](int64_t t) {
    const int64_t r = request[t];
    if (r < 0) return;
    std::vector<const float*>& own = keys[t];
    for (int64_t j = 0; j < span && pos[t] - j >= 0; ++j) {
      if (const float* key = near.At(r, pos[t] - j)) own.push_back(key);
    }
    const int64_t closed = (pos[t] + 1) / ratio;
    if (mode == 1) {
      for (int64_t e = 0; e < std::min(closed, far_capacity); ++e) {
        if (const float* key = far.At(r, e)) own.push_back(key);
      }
    } else if (mode == 2) {
      for (int64_t i = 0; i < num_picks; ++i) {
        const int64_t e = pick[t * num_picks + i];
        if (e < 0 || e >= closed || e >= far_capacity) continue;
        if (const float* key = far.At(r, e)) own.push_back(key);
      }
    }
  });
  jaxinfer::ParallelFor(pool, tokens * heads, [&](int64_t item) {
    const int64_t t = item / heads, h = item % heads;
    const std::vector<const float*>& own = keys[t];
    if (request[t] < 0 || own.empty()) return;
    const float* qh = qs + item * dim;
    std::vector<float> logits(own.size());
    float top = sink[h];
    for (size_t j = 0; j < own.size(); ++j) {
      logits[j] = Dot(qh, own[j], dim) * scale;
      top = std::max(top, logits[j]);
    }
    float total = std::exp(sink[h] - top);  // the sink: probability, no value
    float* o = os + item * dim;
    for (size_t j = 0; j < own.size(); ++j) {
      const float p = std::exp(logits[j] - top);
      total += p;
      Axpy(p, own[j], o, dim);
    }
    const float inverse = 1.0f / total;
    for (int64_t d = 0; d < dim; ++d) o[d] *= inverse;
  });
  return ffi::Error::Success();
}

ffi::Error IndexerTopk(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                       ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::F32> keys,
                       ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::S32> query_start_loc,
                       ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> keys_layer,
                       ffi::ResultBuffer<ffi::S32> out, int64_t ratio, float scale) {
  const auto qd = q.dimensions(), kd = keys.dimensions(), td = block_table.dimensions();
  const auto od = out->dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || od.size() != 2) {
    return ffi::Error::InvalidArgument(
        "indexer_topk: q [T, H, Di], keys [L, NB, B, Di], block_table [R, MB], out [T, k]");
  }
  const int64_t tokens = qd[0], heads = qd[1], dim = qd[2], requests = td[0];
  const int64_t capacity = td[1] * kd[2], topk = od[1], layer = keys_layer.typed_data()[0];
  if (layer < 0 || layer >= kd[0]) {
    return ffi::Error::InvalidArgument("indexer_topk: layer out of range");
  }
  if (kd[3] != dim || weights.element_count() != tokens * heads || od[0] != tokens ||
      positions.element_count() != tokens || query_start_loc.element_count() != requests + 1 ||
      topk > capacity || ratio < 1) {
    return ffi::Error::InvalidArgument("indexer_topk: shapes disagree");
  }
  std::vector<int64_t> request;
  if (!TokenRequests(query_start_loc.typed_data(), requests, tokens, &request)) {
    return ffi::Error::InvalidArgument("indexer_topk: query_start_loc out of order or range");
  }
  const float* key_data = keys.typed_data() + layer * kd[1] * kd[2] * dim;
  const Paged store{key_data, block_table.typed_data(), kd[1], kd[2], dim, td[1]};
  const int32_t* pos = positions.typed_data();
  const float *qs = q.typed_data(), *ws = weights.typed_data();
  std::vector<int64_t> visible(tokens, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    if (request[t] >= 0) visible[t] = std::clamp<int64_t>((pos[t] + 1) / ratio, 0, capacity);
  }
  const int64_t chunks = (capacity + kScoreChunk - 1) / kScoreChunk;
  // (uninitialized: a token reads only the visible entries it wrote)
  const std::unique_ptr<float[]> scores(new float[tokens * capacity]);
  jaxinfer::ParallelFor(pool, tokens * chunks, [&](int64_t item) {
    const int64_t t = item / chunks, begin = item % chunks * kScoreChunk;
    const int64_t end = std::min(begin + kScoreChunk, visible[t]);
    for (int64_t e = begin; e < end; ++e) {
      const float* key = store.At(request[t], e);
      float score = 0.0f;
      for (int64_t h = 0; key && h < heads; ++h) {
        const int64_t th = t * heads + h;
        score += ws[th] * (std::max(Dot(qs + th * dim, key, dim), 0.0f) * scale);
      }
      scores[t * capacity + e] = score;
    }
  });
  int32_t* picks = out->typed_data();
  jaxinfer::ParallelFor(pool, tokens, [&](int64_t t) {
    int32_t* row = picks + t * topk;
    const int64_t count = std::min(topk, visible[t]);
    std::vector<int32_t> order(visible[t]);
    std::iota(order.begin(), order.end(), 0);
    const float* score = scores.get() + t * capacity;
    std::partial_sort(order.begin(), order.begin() + count, order.end(),
                      [score](int32_t a, int32_t b) {
                        return score[a] > score[b] || (score[a] == score[b] && a < b);
                      });
    std::copy(order.begin(), order.begin() + count, row);
    std::fill(row + count, row + topk, -1);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferCompressedAttention, CompressedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, H, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // kv [L, NB, BS, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_table [R, MB]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // entries [Lc, NBc, Bc, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // entry_table [R, MBc]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // picks [T, k]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks [H]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc [R + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv's layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // entries' layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, H, D]
                                  .Attr<int64_t>("mode")  // 0: window, 1: all, 2: picks
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("ratio")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferIndexerTopk, IndexerTopk,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, H, Di]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights [T, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // keys [L, NB, B, Di]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_table [R, MB]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc [R + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // keys' layer []
                                  .Ret<ffi::Buffer<ffi::S32>>()  // picks [T, k]
                                  .Attr<int64_t>("ratio")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferCompressor, compressor::Compress,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // kv [T, F]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gate [T, F]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias [m, F]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // buffer_kv [L, S, W, F]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // buffer_gate [L, S, W, F]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc [R + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // state_rows [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // the layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()  // entries [T, D]
                                  .Ret<ffi::Buffer<ffi::PRED>>()  // closes [T]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // buffer_kv (aliased)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // buffer_gate (aliased)
                                  .Attr<bool>("overlap"));

extern "C" int jaxinfer_compressed_attention_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

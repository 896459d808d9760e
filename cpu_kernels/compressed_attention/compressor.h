// DeepSeek-V4's compressor (pallas_kernels/compressor/reference.py) for XLA:CPU, included by
// kernel.cc: every `ratio` tokens of a request pooled into one compressed entry, over the
// flattened batch of a step, and each request's state (a ring of its last W tokens, token p
// at p % W) carried into the next step.
//
// A token that closes a window (position + 1 a multiple of m) gets
//   entry[d] = sum_j softmax_j(gate_j[d] + bias_j[d]) * kv_j[d]
// over the window's m slots (HCA, its one series), or (CSA) over 2m slots: window w - 1's
// first series (none for window 0) and window w's second. A slot's token comes from the step
// where the step holds it, else from the request's ring.
//
// The state comes as stacks over the kind's layers with the layer to update; the outputs alias
// them, so the layer's rows are updated in place: the entries are computed first from the
// state before the step, then each request's last W tokens are written.
#ifndef JAXINFER_CPU_KERNELS_COMPRESSOR_H_
#define JAXINFER_CPU_KERNELS_COMPRESSOR_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace compressor {

namespace ffi = xla::ffi;

struct Step {
  const float *kv, *gate, *bias;  // [T, F], [T, F], [m, F]
  const float *buffer_kv, *buffer_gate;  // the layer's rings, [S, W, F]
  int64_t features, dim, ratio, ring;
  bool overlap;
};

// Slot value of position `at` for a token `t` at `position` whose request's first token in
// the step is at `first`, series columns from `column`: (kv, gate) pointers, D floats each.
inline void Slot(const Step& s, int64_t t, int64_t position, int64_t first, int64_t row,
                 int64_t at, int64_t column, const float** kv, const float** gate) {
  if (at >= first) {
    const int64_t index = (t + at - position) * s.features + column;
    *kv = s.kv + index, *gate = s.gate + index;
  } else {
    const int64_t index = (row * s.ring + at % s.ring) * s.features + column;
    *kv = s.buffer_kv + index, *gate = s.buffer_gate + index;
  }
}

// The entry token t closes (window `window`), into out [D].
inline void Pool(const Step& s, int64_t t, int64_t position, int64_t first, int64_t row,
                 float* out) {
  const int64_t m = s.ratio, dim = s.dim, window = (position + 1) / m - 1;
  std::vector<const float*> kvs, gates, biases;
  auto add = [&](int64_t at, int64_t column) {
    const float *kv, *gate;
    Slot(s, t, position, first, row, at, column, &kv, &gate);
    kvs.push_back(kv), gates.push_back(gate);
    biases.push_back(s.bias + (at % m) * s.features + column);
  };
  if (s.overlap && window > 0) {
    for (int64_t i = 0; i < m; ++i) add((window - 1) * m + i, 0);
  }
  for (int64_t i = 0; i < m; ++i) add(window * m + i, s.overlap ? s.features - dim : 0);
  std::vector<float> top(dim, -std::numeric_limits<float>::infinity()), total(dim, 0.0f);
  for (size_t j = 0; j < kvs.size(); ++j) {
    for (int64_t d = 0; d < dim; ++d) top[d] = std::max(top[d], gates[j][d] + biases[j][d]);
  }
  std::fill(out, out + dim, 0.0f);
  for (size_t j = 0; j < kvs.size(); ++j) {
    for (int64_t d = 0; d < dim; ++d) {
      const float e = std::exp(gates[j][d] + biases[j][d] - top[d]);
      total[d] += e;
      out[d] += e * kvs[j][d];
    }
  }
  for (int64_t d = 0; d < dim; ++d) out[d] /= total[d];
}

inline ffi::Error Compress(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> kv,
                           ffi::Buffer<ffi::F32> gate, ffi::Buffer<ffi::F32> bias,
                           ffi::Buffer<ffi::F32> buffer_kv, ffi::Buffer<ffi::F32> buffer_gate,
                           ffi::Buffer<ffi::S32> query_start_loc,
                           ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> state_rows,
                           ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> layer_index,
                           ffi::ResultBuffer<ffi::F32> entries,
                           ffi::ResultBuffer<ffi::PRED> closes,
                           ffi::ResultBuffer<ffi::F32> out_buffer_kv,
                           ffi::ResultBuffer<ffi::F32> out_buffer_gate, bool overlap) {
  const auto kd = kv.dimensions(), bd = buffer_kv.dimensions();
  if (kd.size() != 2 || bd.size() != 4) {
    return ffi::Error::InvalidArgument("compressor: kv [T, F], rings [L, S, W, F]");
  }
  const int64_t tokens = kd[0], features = kd[1], layers = bd[0], slots = bd[1], ring = bd[2];
  const int64_t m = features ? bias.element_count() / features : 0;
  const int64_t dim = overlap ? features / 2 : features, requests = state_rows.element_count();
  const int64_t layer = layer_index.typed_data()[0];
  if (m < 1 || gate.element_count() != tokens * features || bias.element_count() != m * features ||
      bd[3] != features || buffer_gate.element_count() != buffer_kv.element_count() ||
      ring < (overlap ? 2 * m : m) || ring % m || positions.element_count() != tokens ||
      query_start_loc.element_count() != requests + 1 || (overlap && features % 2)) {
    return ffi::Error::InvalidArgument("compressor: shapes disagree");
  }
  if (layer < 0 || layer >= layers) {
    return ffi::Error::InvalidArgument("compressor: layer out of range");
  }
  const int32_t *qsl = query_start_loc.typed_data(), *pos = positions.typed_data();
  const int32_t* rows = state_rows.typed_data();
  const int64_t live = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, requests);
  for (int64_t r = 0; r < requests; ++r) {
    if (qsl[r] < 0 || qsl[r + 1] < qsl[r] || qsl[r + 1] > tokens) {
      return ffi::Error::InvalidArgument("compressor: query_start_loc out of order or range");
    }
    if (r < live && qsl[r + 1] > qsl[r] && (rows[r] < 0 || rows[r] >= slots)) {
      return ffi::Error::InvalidArgument("compressor: state row out of range");
    }
  }
  const int64_t buffer_size = slots * ring * features;
  float *new_buffer_kv = out_buffer_kv->typed_data() + layer * buffer_size;
  float *new_buffer_gate = out_buffer_gate->typed_data() + layer * buffer_size;
  // The outputs alias the state's stacks (updated in place); where XLA copied them instead,
  // the copies are the state before the step too: read it from the outputs either way.
  const Step s{kv.typed_data(), gate.typed_data(), bias.typed_data(), new_buffer_kv,
               new_buffer_gate, features, dim, m, ring, overlap};
  float* out = entries->typed_data();
  bool* closing = closes->typed_data();
  std::fill(out, out + tokens * dim, 0.0f);
  std::fill(closing, closing + tokens, false);
  jaxinfer::ParallelFor(pool, live, [&](int64_t r) {  // the entries, from the old state
    for (int64_t t = qsl[r]; t < qsl[r + 1]; ++t) {
      if ((pos[t] + 1) % m) continue;
      closing[t] = true;
      Pool(s, t, pos[t], pos[qsl[r]], rows[r], out + t * dim);
    }
  });
  jaxinfer::ParallelFor(pool, live, [&](int64_t r) {  // then each request's last W tokens
    if (qsl[r + 1] == qsl[r]) return;
    const int64_t row = rows[r], end = pos[qsl[r + 1] - 1] + 1;
    for (int64_t t = qsl[r]; t < qsl[r + 1]; ++t) {
      if (pos[t] < end - ring) continue;
      const int64_t at = (row * ring + pos[t] % ring) * features;
      std::copy(s.kv + t * features, s.kv + (t + 1) * features, new_buffer_kv + at);
      std::copy(s.gate + t * features, s.gate + (t + 1) * features, new_buffer_gate + at);
    }
  });
  return ffi::Error::Success();
}

}  // namespace compressor

#endif  // JAXINFER_CPU_KERNELS_COMPRESSOR_H_

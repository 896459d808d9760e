// Batched LoRA for XLA:CPU through the XLA FFI (AVX2 + FMA): y[t] = (x[t] . a[s]^T) . b[s]
// with s = slots[t], zeros where s < 0 (pallas_kernels/lora/reference.py). x [T, I], a one
// layer of stacked shrinks [L, S, R, I], b of expands [L, S, R, O], both read in place.
//
// Each row is computed with its own adapter only (the dense reference runs every row through
// every slot): the shrink u[t] = a[s] . x[t] (R dot products over I), then the expand
// y[t] = sum_r u[t, r] b[s, r] (R vector updates over O). Rows are shared out over XLA's
// intra-op threads for the shrink, tiles of output columns for the expand. Each output is one
// chain in a fixed order whatever the other rows hold (batch-invariant).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kColumnTile = 256;

float Dot(const float* a, const float* x, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(x + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(x + i + 8), acc1);
  }
  float sum = jaxinfer::Sum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) sum += a[i] * x[i];
  return sum;
}

ffi::Error Lora(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> a,
                ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::S32> slots,
                ffi::Buffer<ffi::S32> layer_index, ffi::ResultBuffer<ffi::F32> y) {
  const auto a_dims = a.dimensions(), b_dims = b.dimensions();
  if (a_dims.size() != 4 || b_dims.size() != 4 || x.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("lora: x [T, I], a [L, S, R, I], b [L, S, R, O]");
  }
  const int64_t rows = x.dimensions()[0], depth = x.dimensions()[1];
  const int64_t layers = a_dims[0], num_slots = a_dims[1], rank = a_dims[2];
  const int64_t columns = b_dims[3];
  if (a_dims[3] != depth || b_dims[0] != layers || b_dims[1] != num_slots ||
      b_dims[2] != rank || slots.element_count() != rows) {
    return ffi::Error::InvalidArgument("lora: shapes of x, a, b and slots disagree");
  }
  const int64_t layer = layer_index.typed_data()[0];
  if (layer < 0 || layer >= layers) {
    return ffi::Error::InvalidArgument("lora: layer out of range");
  }
  const float* xs = x.typed_data();
  const int32_t* slot = slots.typed_data();
  const float* a_layer = a.typed_data() + layer * num_slots * rank * depth;
  const float* b_layer = b.typed_data() + layer * num_slots * rank * columns;
  float* out = y->typed_data();
  for (int64_t t = 0; t < rows; ++t) {
    if (slot[t] >= num_slots) return ffi::Error::InvalidArgument("lora: slot out of range");
  }

  std::vector<float> shrunk(rows * rank, 0.0f);  // [T, R]
  jaxinfer::ParallelFor(pool, rows, [&](int64_t t) {
    if (slot[t] < 0) return;
    const float* a_slot = a_layer + slot[t] * rank * depth;
    for (int64_t r = 0; r < rank; ++r) {
      shrunk[t * rank + r] = Dot(a_slot + r * depth, xs + t * depth, depth);
    }
  });
  const int64_t tiles = (columns + kColumnTile - 1) / kColumnTile;
  jaxinfer::ParallelFor(pool, tiles, [&](int64_t tile) {
    const int64_t begin = tile * kColumnTile, end = std::min(columns, begin + kColumnTile);
    for (int64_t t = 0; t < rows; ++t) {
      float* y_row = out + t * columns;
      std::fill(y_row + begin, y_row + end, 0.0f);
      if (slot[t] < 0) continue;
      const float* b_slot = b_layer + slot[t] * rank * columns;
      for (int64_t r = 0; r < rank; ++r) {
        const float u = shrunk[t * rank + r];
        const __m256 uv = _mm256_set1_ps(u);
        const float* b_row = b_slot + r * columns;
        int64_t c = begin;
        for (; c + 8 <= end; c += 8) {
          _mm256_storeu_ps(y_row + c, _mm256_fmadd_ps(uv, _mm256_loadu_ps(b_row + c),
                                                      _mm256_loadu_ps(y_row + c)));
        }
        for (; c < end; ++c) y_row[c] += u * b_row[c];
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferLora, Lora,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, I]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // a [L, S, R, I]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b [L, S, R, O]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, O]
);

extern "C" int jaxinfer_lora_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

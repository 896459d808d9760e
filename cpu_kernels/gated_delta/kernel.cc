// The gated delta rule's recurrent form (pallas_kernels/gated_delta/reference.py) for XLA:CPU
// through the XLA FFI (AVX2 + FMA): for each (request, value head), in order over the
// request's tokens, with its state S [Dk, Dv] (rows of Dv, the vectorized axis):
//
//   S *= exp(g);  m = S^T k;  d = beta (v - m);  S += k d^T;  o = S^T q
//
// q and k come normalized, repeated to the value heads and q scaled (the wrapper does it).
// (request, head) pairs are shared out over XLA's intra-op threads; each output is a fixed
// order of operations whatever else is in the batch.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error GatedDelta(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                      ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> g,
                      ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> init,
                      ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> num_seqs,
                      ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> final_state) {
  const auto qd = q.dimensions(), vd = v.dimensions(), sd = init.dimensions();
  if (qd.size() != 3 || vd.size() != 3 || sd.size() != 4) {
    return ffi::Error::InvalidArgument("gated_delta: q [T, H, Dk], v [T, H, Dv], init [R, H, Dk, Dv]");
  }
  const int64_t tokens = qd[0], heads = qd[1], dk = qd[2], dv = vd[2], requests = sd[0];
  if (vd[0] != tokens || vd[1] != heads || sd[1] != heads || sd[2] != dk || sd[3] != dv ||
      query_start_loc.element_count() != requests + 1) {
    return ffi::Error::InvalidArgument("gated_delta: shapes disagree");
  }
  const int32_t* qsl = query_start_loc.typed_data();
  const int64_t real = std::min<int64_t>(num_seqs.typed_data()[0], requests);
  for (int64_t r = 0; r <= requests; ++r) {
    if (qsl[r] < 0 || qsl[r] > tokens || (r && qsl[r] < qsl[r - 1])) {
      return ffi::Error::InvalidArgument("gated_delta: query_start_loc out of order or range");
    }
  }
  const float *qs = q.typed_data(), *ks = k.typed_data(), *vs = v.typed_data();
  const float *gs = g.typed_data(), *bs = beta.typed_data(), *inits = init.typed_data();
  float *os = out->typed_data(), *finals = final_state->typed_data();
  std::fill(os, os + tokens * heads * dv, 0.0f);
  jaxinfer::ParallelFor(pool, requests * heads, [&](int64_t item) {
    const int64_t r = item / heads, h = item % heads;
    float* state = finals + item * dk * dv;
    std::copy(inits + item * dk * dv, inits + (item + 1) * dk * dv, state);
    if (r >= real) return;
    std::vector<float> delta(dv);
    for (int64_t t = qsl[r]; t < qsl[r + 1]; ++t) {
      const int64_t th = t * heads + h;
      const float decay = std::exp(gs[th]), b = bs[th];
      const float *kt = ks + th * dk, *qt = qs + th * dk, *vt = vs + th * dv;
      // S *= exp(g); m = S^T k (accumulated into delta), then d = beta (v - m)
      std::fill(delta.begin(), delta.end(), 0.0f);
      for (int64_t i = 0; i < dk; ++i) {
        float* row = state + i * dv;
        int64_t j = 0;
        const __m256 dec = _mm256_set1_ps(decay), kv = _mm256_set1_ps(kt[i]);
        for (; j + 8 <= dv; j += 8) {
          const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + j), dec);
          _mm256_storeu_ps(row + j, s);
          _mm256_storeu_ps(delta.data() + j,
                           _mm256_fmadd_ps(s, kv, _mm256_loadu_ps(delta.data() + j)));
        }
        for (; j < dv; ++j) {
          row[j] *= decay;
          delta[j] += row[j] * kt[i];
        }
      }
      for (int64_t j = 0; j < dv; ++j) delta[j] = b * (vt[j] - delta[j]);
      // S += k d^T; o = S^T q
      float* o = os + th * dv;
      for (int64_t i = 0; i < dk; ++i) {
        float* row = state + i * dv;
        const __m256 kv = _mm256_set1_ps(kt[i]), qv = _mm256_set1_ps(qt[i]);
        int64_t j = 0;
        for (; j + 8 <= dv; j += 8) {
          const __m256 s =
              _mm256_fmadd_ps(kv, _mm256_loadu_ps(delta.data() + j), _mm256_loadu_ps(row + j));
          _mm256_storeu_ps(row + j, s);
          _mm256_storeu_ps(o + j, _mm256_fmadd_ps(s, qv, _mm256_loadu_ps(o + j)));
        }
        for (; j < dv; ++j) {
          row[j] += kt[i] * delta[j];
          o[j] += row[j] * qt[i];
        }
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferGatedDelta, GatedDelta,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, H, Dk]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k [T, H, Dk]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v [T, H, Dv]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g [T, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // beta [T, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // init [R, H, Dk, Dv]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc [R + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, H, Dv]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // final [R, H, Dk, Dv]
);

extern "C" int jaxinfer_gated_delta_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

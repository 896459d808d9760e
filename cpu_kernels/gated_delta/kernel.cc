// The gated delta rule (pallas_kernels/gated_delta/reference.py) for XLA:CPU through the XLA
// FFI (AVX2 + FMA), one call over a flattened mixed batch, for each (request, value head)
// from its initial state S [Dk, Dv] (rows of Dv, the vectorized axis), in two forms:
//
// - recurrent, token by token (decodes; every token under batch_invariant):
//     S *= exp(g);  m = S^T k;  d = beta (v - m);  S += k d^T;  o = S^T q
// - chunked (a request with more than one token in the call, when `chunk` > 0): the WY / UT
//   form, the request's tokens in chunks of `chunk` (the last one shorter), each through a
//   triangular solve and a few small matmuls against S (gated_delta_chunked's algorithm).
//
// q and k come as the model has them ([T, Hk, Dk], each key head serving Hv / Hk consecutive
// value heads); the kernel L2-normalizes them (where asked) and scales q by Dk^-1/2.
// (request, head) pairs are shared out over XLA's intra-op threads. The recurrent form's
// outputs are a fixed order of operations whatever else is in the batch; the chunked form's
// depend on where the request's tokens split into calls (so batch_invariant takes chunk 0).
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// c [m, n] = (accumulate ? c : 0) + a [m, p] @ b [p, n], row-major with leading dimensions;
// blocks of 4 rows by 16 columns in registers, so each row of b is read once per 4 rows.
void MatMul(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
            int64_t m, int64_t p, int64_t n, bool accumulate) {
  int64_t i = 0;
  for (; i + 4 <= m; i += 4) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      __m256 acc[4][2];
      for (int r = 0; r < 4; ++r) {
        acc[r][0] = accumulate ? _mm256_loadu_ps(c + (i + r) * ldc + j) : _mm256_setzero_ps();
        acc[r][1] =
            accumulate ? _mm256_loadu_ps(c + (i + r) * ldc + j + 8) : _mm256_setzero_ps();
      }
      for (int64_t l = 0; l < p; ++l) {
        const __m256 b0 = _mm256_loadu_ps(b + l * ldb + j), b1 = _mm256_loadu_ps(b + l * ldb + j + 8);
        for (int r = 0; r < 4; ++r) {
          const __m256 x = _mm256_set1_ps(a[(i + r) * lda + l]);
          acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
        }
      }
      for (int r = 0; r < 4; ++r) {
        _mm256_storeu_ps(c + (i + r) * ldc + j, acc[r][0]);
        _mm256_storeu_ps(c + (i + r) * ldc + j + 8, acc[r][1]);
      }
    }
    for (; j < n; ++j) {
      for (int r = 0; r < 4; ++r) {
        float s = accumulate ? c[(i + r) * ldc + j] : 0.0f;
        for (int64_t l = 0; l < p; ++l) s += a[(i + r) * lda + l] * b[l * ldb + j];
        c[(i + r) * ldc + j] = s;
      }
    }
  }
  for (; i < m; ++i) {
    float* row = c + i * ldc;
    if (!accumulate) std::fill(row, row + n, 0.0f);
    for (int64_t l = 0; l < p; ++l) {
      const float x = a[i * lda + l];
      const float* brow = b + l * ldb;
      int64_t j = 0;
      const __m256 xv = _mm256_set1_ps(x);
      for (; j + 8 <= n; j += 8) {
        _mm256_storeu_ps(row + j, _mm256_fmadd_ps(xv, _mm256_loadu_ps(brow + j),
                                                  _mm256_loadu_ps(row + j)));
      }
      for (; j < n; ++j) row[j] += x * brow[j];
    }
  }
}

struct Inputs {
  const float *q, *k, *v, *g, *beta;
  int64_t heads, key_heads, dk, dv;
  bool l2norm;

  // Token t's q (normalized where asked, scaled) and k (normalized) for value head h.
  void QK(int64_t t, int64_t h, float* q_out, float* k_out) const {
    const int64_t at = (t * key_heads + h / (heads / key_heads)) * dk;
    const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
    Normalized(q + at, q_out, scale);
    Normalized(k + at, k_out, 1.0f);
  }

  void Normalized(const float* x, float* y, float scale) const {
    if (l2norm) {
      __m256 acc = _mm256_setzero_ps();
      int64_t d = 0;
      for (; d + 8 <= dk; d += 8) {
        const __m256 xv = _mm256_loadu_ps(x + d);
        acc = _mm256_fmadd_ps(xv, xv, acc);
      }
      float sum = jaxinfer::Sum(acc);
      for (; d < dk; ++d) sum += x[d] * x[d];
      scale /= std::sqrt(sum + 1e-6f);
    }
    for (int64_t d = 0; d < dk; ++d) y[d] = x[d] * scale;
  }
};

// Tokens [begin, end) of one value head h, token by token, into `out` ([T, Hv, Dv]).
void Recurrent(const Inputs& in, int64_t h, int64_t begin, int64_t end, float* state,
               float* out) {
  const int64_t heads = in.heads, dk = in.dk, dv = in.dv;
  std::vector<float> delta(dv), qk(2 * dk);
  const float *qt = qk.data(), *kt = qk.data() + dk;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t th = t * heads + h;
    const float decay = std::exp(in.g[th]), b = in.beta[th];
    const float* vt = in.v + th * dv;
    in.QK(t, h, qk.data(), qk.data() + dk);
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
    float* o = out + th * dv;
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
}

// Tokens [begin, end) of value head h in chunks of `chunk`. Per chunk of n tokens, with
// c = cumsum(g) over the chunk and D[i][j] = exp(c_i - c_j):
//   T = (I + strictly_lower(beta_i k_i . k_j D[i][j]))^-1        (forward substitution)
//   U = T (beta v) - T (beta k exp(c)) S                         the chunk's new values
//   o = (q exp(c)) S + lower(q_i . k_j D[i][j]) U
//   S = exp(c_n) S + (k exp(c_n - c))^T U
void Chunked(const Inputs& in, int64_t h, int64_t begin, int64_t end, int64_t chunk,
             float* state, float* out) {
  const int64_t heads = in.heads, dk = in.dk, dv = in.dv;
  std::vector<float> q(chunk * dk), k(chunk * dk), kt(dk * chunk), kw(chunk * dk);
  std::vector<float> vb(chunk * dv), u(chunk * dv), o(chunk * dv), w(chunk * dv);
  std::vector<float> cum(chunk + 8), grow(chunk), tri(chunk * chunk), a(chunk * chunk);
  std::vector<float> decays(chunk * chunk), x(chunk * dk);
  for (int64_t start = begin; start < end; start += chunk) {
    const int64_t n = std::min(chunk, end - start);
    float total = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t th = (start + i) * heads + h;
      total += in.g[th];
      cum[i] = total;
      in.QK(start + i, h, q.data() + i * dk, k.data() + i * dk);
      const float b = in.beta[th];
      for (int64_t j = 0; j < dv; ++j) vb[i * dv + j] = b * in.v[th * dv + j];
      for (int64_t d = 0; d < dk; ++d) kt[d * chunk + i] = k[i * dk + d];
    }
    // decays[i][j] = exp(c_i - c_j) for j <= i, else 0 (8 at a time).
    for (int64_t i = 0; i < n; ++i) {
      const __m256 ci = _mm256_set1_ps(cum[i]);
      for (int64_t j = 0; j <= i; j += 8) {
        const __m256 e = jaxinfer::Exp(_mm256_sub_ps(ci, _mm256_loadu_ps(cum.data() + j)));
        _mm256_storeu_ps(decays.data() + i * chunk + j, e);  // (chunk is a multiple of 8)
      }
      std::fill(decays.data() + i * chunk + i + 1, decays.data() + (i + 1) * chunk, 0.0f);
    }
    // a = K K^T (lower half used), then the system's inverse T row by row.
    MatMul(k.data(), dk, kt.data(), chunk, a.data(), chunk, n, dk, n, false);
    for (int64_t i = 0; i < n; ++i) {
      const float b = in.beta[(start + i) * heads + h];
      float* ti = tri.data() + i * chunk;
      std::fill(ti, ti + n, 0.0f);
      ti[i] = 1.0f;
      for (int64_t j = 0; j < i; ++j) {
        const float l = b * a[i * chunk + j] * decays[i * chunk + j];
        const float* tj = tri.data() + j * chunk;
        for (int64_t c = 0; c <= j; ++c) ti[c] -= l * tj[c];
      }
    }
    // u = T (beta v); x = T (beta k exp(c)); u -= x S
    for (int64_t i = 0; i < n; ++i) grow[i] = std::exp(cum[i]);
    for (int64_t i = 0; i < n; ++i) {
      const float s = in.beta[(start + i) * heads + h] * grow[i];
      for (int64_t d = 0; d < dk; ++d) kw[i * dk + d] = s * k[i * dk + d];
    }
    MatMul(tri.data(), chunk, vb.data(), dv, u.data(), dv, n, n, dv, false);
    MatMul(tri.data(), chunk, kw.data(), dk, x.data(), dk, n, n, dk, false);
    MatMul(x.data(), dk, state, dv, w.data(), dv, n, dk, dv, false);
    for (int64_t i = 0; i < n * dv; ++i) u[i] -= w[i];
    // o = (q exp(c)) S + lower(Q K^T D) u
    MatMul(q.data(), dk, kt.data(), chunk, a.data(), chunk, n, dk, n, false);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) a[i * chunk + j] *= decays[i * chunk + j];
      const float s = grow[i];
      for (int64_t d = 0; d < dk; ++d) q[i * dk + d] *= s;
    }
    MatMul(q.data(), dk, state, dv, o.data(), dv, n, dk, dv, false);
    MatMul(a.data(), chunk, u.data(), dv, o.data(), dv, n, n, dv, true);
    for (int64_t i = 0; i < n; ++i) {
      std::copy(o.data() + i * dv, o.data() + (i + 1) * dv, out + ((start + i) * heads + h) * dv);
    }
    // S = exp(c_n) S + (k exp(c_n - c))^T u
    const float* to_last = decays.data() + (n - 1) * chunk;  // exp(c_n - c_i)
    for (int64_t d = 0; d < dk; ++d) {
      for (int64_t i = 0; i < n; ++i) kt[d * chunk + i] *= to_last[i];
    }
    const float decay = std::exp(cum[n - 1]);
    for (int64_t i = 0; i < dk * dv; ++i) state[i] *= decay;
    MatMul(kt.data(), chunk, u.data(), dv, state, dv, dk, n, dv, true);
  }
}

ffi::Error GatedDelta(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                      ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> g,
                      ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> init,
                      ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> num_seqs,
                      ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> final_state,
                      int64_t chunk, bool qk_l2norm) {
  const auto qd = q.dimensions(), vd = v.dimensions(), sd = init.dimensions();
  if (qd.size() != 3 || vd.size() != 3 || sd.size() != 4) {
    return ffi::Error::InvalidArgument(
        "gated_delta: q [T, Hk, Dk], v [T, Hv, Dv], init [R, Hv, Dk, Dv]");
  }
  const int64_t tokens = qd[0], key_heads = qd[1], dk = qd[2];
  const int64_t heads = vd[1], dv = vd[2], requests = sd[0];
  if (vd[0] != tokens || key_heads <= 0 || heads % key_heads || sd[1] != heads ||
      sd[2] != dk || sd[3] != dv || query_start_loc.element_count() != requests + 1 ||
      chunk < 0 || chunk % 8 || k.element_count() != q.element_count()) {
    return ffi::Error::InvalidArgument("gated_delta: shapes disagree");
  }
  const int32_t* qsl = query_start_loc.typed_data();
  const int64_t real = std::min<int64_t>(num_seqs.typed_data()[0], requests);
  for (int64_t r = 0; r <= requests; ++r) {
    if (qsl[r] < 0 || qsl[r] > tokens || (r && qsl[r] < qsl[r - 1])) {
      return ffi::Error::InvalidArgument("gated_delta: query_start_loc out of order or range");
    }
  }
  const Inputs in{q.typed_data(), k.typed_data(), v.typed_data(), g.typed_data(),
                  beta.typed_data(), heads, key_heads, dk, dv, qk_l2norm};
  const float* inits = init.typed_data();
  float *os = out->typed_data(), *finals = final_state->typed_data();
  std::fill(os, os + tokens * heads * dv, 0.0f);
  jaxinfer::ParallelFor(pool, requests * heads, [&](int64_t item) {
    const int64_t r = item / heads, h = item % heads;
    float* state = finals + item * dk * dv;
    std::copy(inits + item * dk * dv, inits + (item + 1) * dk * dv, state);
    if (r >= real) return;
    if (chunk > 0 && qsl[r + 1] - qsl[r] > 1) {
      Chunked(in, h, qsl[r], qsl[r + 1], chunk, state, os);
    } else {
      Recurrent(in, h, qsl[r], qsl[r + 1], state, os);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferGatedDelta, GatedDelta,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, Hk, Dk]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k [T, Hk, Dk]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v [T, Hv, Dv]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // g [T, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // beta [T, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // init [R, Hv, Dk, Dv]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc [R + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, Hv, Dv]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // final [R, Hv, Dk, Dv]
                                  .Attr<int64_t>("chunk")  // 0: recurrent only
                                  .Attr<bool>("qk_l2norm"));

extern "C" int jaxinfer_gated_delta_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

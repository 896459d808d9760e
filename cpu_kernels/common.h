// Helpers shared by the C++ kernels: a horizontal sum, a dot product, a vectorized exp, and a
// parallel loop over XLA's intra-op thread pool.
#ifndef JAXINFER_CPU_KERNELS_COMMON_H_
#define JAXINFER_CPU_KERNELS_COMMON_H_

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxinfer {

inline float Sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum_i a[i] * b[i].
inline float Dot(const float* a, const float* b, int64_t count) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  }
  float s = Sum(acc);
  for (; i < count; ++i) s += a[i] * b[i];
  return s;
}

// e^x for 8 floats (relative error about 2e-7 over the float range); 0 below about -87.3.
inline __m256 Exp(__m256 x) {
  const __m256 too_small = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // x - n ln2, in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);  // e^r on [-ln2/2, ln2/2] (Cephes expf)
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2 = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(too_small, _mm256_mul_ps(p, _mm256_castsi256_ps(pow2)));
}

// Runs body(i) for i in [0, count): items are claimed from an atomic counter by the calling
// thread and by tasks on XLA's intra-op pool, so a task that starts late finds nothing left
// and the caller never waits on an item nobody has started.
template <typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t count, const Body& body) {
  if (count <= 0) return;
  struct Claims {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto claims = std::make_shared<Claims>();
  auto work = [claims, count](const Body& run) {
    for (int64_t i; (i = claims->next.fetch_add(1, std::memory_order_relaxed)) < count;) {
      run(i);
      claims->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, count - 1);
  for (int64_t h = 0; h < helpers; ++h) {
    // A helper that starts after every item is claimed touches nothing but `claims`.
    pool.Schedule([work, body] { work(body); });
  }
  work(body);
  for (int spins = 0; claims->done.load(std::memory_order_acquire) < count; ++spins) {
    if (spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace jaxinfer

#endif  // JAXINFER_CPU_KERNELS_COMMON_H_

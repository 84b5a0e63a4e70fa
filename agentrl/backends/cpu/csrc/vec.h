// Vector helpers shared by agentrl's CPU kernels (cpu_decode.cpp, cpu_train.cpp): a float vector
// as wide as the target's registers in GCC's vector extensions (the compiler runs with
// -march=native on the machine that uses it), loads, stores, sums, and exp.
#pragma once

#include <cmath>
#include <cstdint>

// The vector is one register of the target: 16 lanes (zmm) with AVX-512, 8 (ymm) with AVX/AVX2,
// 4 (xmm, NEON q) otherwise. GCC lowers a generic vector wider than the registers badly: on an
// AVX2-only EPYC, 16 lanes kept the row GEMM's accumulators on the stack (~10 moves per FMA)
// and turned exp's compares and selects into scalar code; 8 lanes made the row GEMM at 8 rows
// 5-8x faster there, the SiLU gating ~5x and the log-prob pass ~8x (one thread).
#if defined(__AVX512F__)
#define AGENTRL_VEC_LANES 16
#elif defined(__AVX__)
#define AGENTRL_VEC_LANES 8
#else
#define AGENTRL_VEC_LANES 4
#endif

namespace agentrl {

constexpr int kLanes = AGENTRL_VEC_LANES;
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  __builtin_memcpy(&v, p, sizeof(vec));
  return v;
}

// The sum of the lanes by halves (16 -> 8 -> 4 -> 2 -> 1): a few shuffles and adds. A loop over
// 16 lanes compiles to 15 dependent scalar adds (the compiler may not reorder float sums), which
// took about as long as the multiplications of a decode step's row GEMM at 8 rows.
inline float lanes_sum(vec v) {
  typedef float v4 __attribute__((vector_size(4 * sizeof(float))));
#if AGENTRL_VEC_LANES == 16
  typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#elif AGENTRL_VEC_LANES == 8
  const v4 b =
      __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#else
  static_assert(kLanes == 4, "lanes_sum halves 16, 8 or 4 lanes");
  const v4 b = v;
#endif
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  vec acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(a + i) * load(b + i);
  float s = lanes_sum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// exp of every lane, as 2^n * e^r with x = n ln2 + r, |r| <= ln2 / 2, and e^r from Cephes'
// degree-6 polynomial for expf: within a few ulp of std::exp. Lanes below -87.3 (where expf
// turns subnormal) give 0, lanes above 88 give exp(88.03) ~ 1.6e38, NaN stays NaN. The scalar
// std::exp loops this replaces took ~0.25 ms of a ~1 ms SmolLM2 decoder layer at 8 rows.
inline vec vexp(vec x) {
  typedef int ivec __attribute__((vector_size(kLanes * sizeof(int))));
  const vec lo = vec{} - 87.3365448f, hi = vec{} + 88.0296919f;
  const vec c = x < lo ? lo : (x > hi ? hi : x);
  vec fn = c * 1.44269504088896341f + 0.5f;
  const vec t = __builtin_convertvector(__builtin_convertvector(fn, ivec), vec);
  fn = t > fn ? t - 1.f : t;  // floor(c / ln2 + 1/2)
  vec r = c - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  vec y = vec{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.f;
  const ivec bits = (__builtin_convertvector(fn, ivec) + 127) << 23;
  vec two_n;
  __builtin_memcpy(&two_n, &bits, sizeof(vec));
  y = y * two_n;
  y = x < lo ? vec{} : y;
  return x != x ? x : y;
}

inline void store(float* p, vec v) { __builtin_memcpy(p, &v, sizeof(vec)); }

// y += a * x
inline void axpy(float a, const float* x, float* y, int64_t n) {
  int64_t i = 0;
  const vec av = vec{} + a;  // a in every lane
  for (; i + kLanes <= n; i += kLanes) {
    vec yv = load(y + i) + av * load(x + i);
    __builtin_memcpy(y + i, &yv, sizeof(vec));
  }
  for (; i < n; ++i) y[i] += a * x[i];
}

}  // namespace agentrl

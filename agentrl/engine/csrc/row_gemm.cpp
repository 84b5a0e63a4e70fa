// out[m, n] = sum_k x[m, k] * w[n, k] for a few rows m: the weight-streaming product of a decode
// step (see agentrl/engine/kernels.py for when it is used and why).
//
// At 1-16 rows a decode step's linear layers are bound by reading the weights from memory, not
// by arithmetic. A general GEMM packs panels of the weight matrix for every call, and at these
// shapes the packing and its cache misses cost more than the arithmetic. Here each pair of
// weight rows is read once, straight from the model's own tensor, while the rows a few tiles
// ahead are prefetched, and multiplied into every input row (the inputs, at most 16 x K floats,
// stay in the L1/L2 cache). Each output is the sum of one row of x and one row of w in a fixed
// order, independent of how many other rows are in the batch.
//
// Written with GCC vector extensions so that the compiler (run with -march=native on the machine
// that uses it) emits AVX-512, AVX2 or NEON as the CPU has.

#include <ATen/Parallel.h>
#include <torch/extension.h>

namespace {

constexpr int kLanes = 16;
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

// Weight rows prefetched ahead of the ones being multiplied, in units of the NR-row tile.
constexpr int kPrefetchTiles = 4;

inline vec load(const float* p) {
  vec v;
  __builtin_memcpy(&v, p, sizeof(vec));
  return v;
}

inline float lanes_sum(vec v) {
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// MR rows of x against weight rows n .. n + NR - 1.
template <int MR, int NR>
inline void tile(const float* x, const float* w, float* out, int64_t K, int64_t N, int64_t n) {
  vec acc[MR][NR] = {};
  const int64_t k_vec = K - K % kLanes;
  for (int64_t k = 0; k < k_vec; k += kLanes) {
    vec wv[NR];
    for (int j = 0; j < NR; ++j) {
      wv[j] = load(w + (n + j) * K + k);
      __builtin_prefetch(w + (n + kPrefetchTiles * NR + j) * K + k);
    }
    for (int i = 0; i < MR; ++i) {
      const vec xv = load(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = lanes_sum(acc[i][j]);
      for (int64_t k = k_vec; k < K; ++k) s += x[i * K + k] * w[(n + j) * K + k];
      out[i * N + n + j] = s;
    }
  }
}

// All M rows of x against weight rows n .. n + NR - 1 (those stay in L1 across the row blocks).
template <int NR>
inline void columns(const float* x, const float* w, float* out, int64_t M, int64_t K, int64_t N,
                    int64_t n) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) tile<8, NR>(x + m * K, w, out + m * N, K, N, n);
  for (; m + 4 <= M; m += 4) tile<4, NR>(x + m * K, w, out + m * N, K, N, n);
  for (; m < M; ++m) tile<1, NR>(x + m * K, w, out + m * N, K, N, n);
}

}  // namespace

torch::Tensor row_gemm(const torch::Tensor& x_in, const torch::Tensor& w) {
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1),
              "row_gemm: x [M, K] and w [N, K] expected, got ", x_in.sizes(), " and ", w.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "row_gemm: float32 only");
  TORCH_CHECK(x_in.device().is_cpu() && w.device().is_cpu(), "row_gemm: CPU tensors only");
  TORCH_CHECK(w.is_contiguous(), "row_gemm: the weight must be contiguous");
  const torch::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  torch::Tensor out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) columns<2>(xp, wp, op, M, K, N, n);
    for (; n < n1; ++n) columns<1>(xp, wp, op, M, K, N, n);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("row_gemm", &row_gemm, "x [M, K] @ w[N, K].T for few rows M (float32, CPU)");
}

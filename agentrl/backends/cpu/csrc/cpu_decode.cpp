// CPU kernels for decode steps of a few rows (float32): agentrl/backends/cpu/kernels.py says when
// they are used and why, agentrl/backends/cpu/decode.py calls them.
//
// row_gemm: out[m, n] = sum_k x[m, k] * w[n, k]. At 1-16 rows a decode step's projections are
// bound by reading the weights from memory, not by arithmetic. A general GEMM packs panels of
// the weight matrix for every call, and at these shapes the packing and its cache misses cost
// more than the arithmetic. Here each group of a few weight rows (kTileCols) is read once,
// straight from the model's own tensor, while the rows a few tiles ahead are prefetched, and
// multiplied into every input row (the inputs, at most 16 x K floats, stay in the L1/L2 cache).
// Each output is the sum of one row of x and one row of w in a fixed order, independent of the
// other rows.
//
// decode_layer: one Llama decoder layer for one new token per row, in one call: RMS norms,
// projections, rotary embedding, the KV-cache write, attention over the cached columns, SiLU
// gating and both residual adds. Through Python the same layer is ~45 tensor operations of a
// few microseconds of dispatch each, more than their arithmetic at these sizes.
//
// Written with the vector helpers of vec.h.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using namespace agentrl;

// Weight rows prefetched ahead of the ones being multiplied.
constexpr int kPrefetchRows = 8;

// The tile of the row GEMM: kTileRows rows of x against kTileCols weight rows. Its
// kTileRows * kTileCols accumulators, kTileCols weight vectors and an x vector should fit the
// vector registers, or the accumulators go through the stack on every step of the sum. With
// AVX2 (16 ymm) and elsewhere (16 xmm, 32 NEON q) that is 4 x 3: 12 + 3 + 1, and GCC 12 keeps
// them all in registers. With AVX-512 the 8 x 4 tile tuned on a Xeon stays: 32 + 4 + 1 is more
// than its 32 zmm and GCC keeps 4 accumulators on the stack, but 8 x 3 or 6 x 4 (which fit)
// have not been measured there.
#if defined(__AVX512F__)
constexpr int kTileRows = 8, kTileCols = 4;
#else
constexpr int kTileRows = 4, kTileCols = 3;
#endif

// ------------------------------------------------------------------------------- row GEMM

// MR rows of x against weight rows n .. n + NR - 1; out = (out +) x w^T.
template <int MR, int NR>
inline void tile(const float* x, const float* w, float* out, int64_t K, int64_t N, int64_t n,
                 bool accumulate) {
  vec acc[MR][NR] = {};
  const int64_t k_vec = K - K % kLanes;
  for (int64_t k = 0; k < k_vec; k += kLanes) {
    vec wv[NR];
    for (int j = 0; j < NR; ++j) {
      wv[j] = load(w + (n + j) * K + k);
      __builtin_prefetch(w + (n + kPrefetchRows + j) * K + k);
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
      float* o = out + i * N + n + j;
      *o = accumulate ? *o + s : s;
    }
  }
}

// All M rows of x against weight rows n .. n + NR - 1 (those stay in L1 across the row blocks):
// blocks of kTileRows rows, then one of 4 (AVX-512) or 2 rows, then single rows.
template <int NR>
inline void columns(const float* x, const float* w, float* out, int64_t M, int64_t K, int64_t N,
                    int64_t n, bool accumulate) {
  int64_t m = 0;
  for (; m + kTileRows <= M; m += kTileRows)
    tile<kTileRows, NR>(x + m * K, w, out + m * N, K, N, n, accumulate);
  if constexpr (kTileRows > 4) {
    for (; m + 4 <= M; m += 4) tile<4, NR>(x + m * K, w, out + m * N, K, N, n, accumulate);
  }
  if constexpr (kTileRows == 4) {
    for (; m + 2 <= M; m += 2) tile<2, NR>(x + m * K, w, out + m * N, K, N, n, accumulate);
  }
  for (; m < M; ++m) tile<1, NR>(x + m * K, w, out + m * N, K, N, n, accumulate);
}

// out [M, N] = (out +) x [M, K] @ w [N, K]^T, all contiguous.
void gemm_rows(const float* x, const float* w, float* out, int64_t M, int64_t K, int64_t N,
               bool accumulate) {
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + kTileCols <= n1; n += kTileCols) {
      columns<kTileCols>(x, w, out, M, K, N, n, accumulate);
    }
    for (; n + 2 <= n1; n += 2) columns<2>(x, w, out, M, K, N, n, accumulate);
    for (; n < n1; ++n) columns<1>(x, w, out, M, K, N, n, accumulate);
  });
}

void check_operands(const torch::Tensor& x, const torch::Tensor& w, const char* what) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), what,
              ": x [M, K] and w [N, K] expected, got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, what,
              ": float32 only");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), what, ": CPU tensors only");
  TORCH_CHECK(w.is_contiguous(), what, ": the weight must be contiguous");
}

// ---------------------------------------------------------------------------- decode layer

// out = (out +) x @ w^T (+ b): the row kernel for weights of more than `min_numel` elements,
// ATen's GEMM for smaller ones (they stay in cache, where BLAS is faster).
void project(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& b,
             torch::Tensor& out, bool accumulate, int64_t min_numel) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.dim() == 2 && w.size(1) == K && out.size(0) == M && out.size(1) == N &&
                  w.scalar_type() == at::kFloat && w.is_contiguous(),
              "decode_layer: a [", N, ", ", K, "] float32 contiguous weight expected, got ",
              w.sizes());
  if (w.numel() > min_numel) {
    gemm_rows(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), M, K, N,
              accumulate);
  } else if (accumulate) {
    out.add_(at::mm(x, w.t()));
  } else {
    at::mm_out(out, x, w.t());
  }
  if (b.has_value() && b->defined()) out.add_(*b);
}

// out[m] = weight * x[m] / sqrt(mean(x[m]^2) + eps), as LlamaRMSNorm in float32.
void rms_norm(const float* x, const float* weight, float* out, int64_t M, int64_t H, double eps) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * H;
    const float ss = dot(xr, xr, H);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
    for (int64_t i = 0; i < H; ++i) out[m * H + i] = weight[i] * (xr[i] * inv);
  }
}

// x * cos + rotate_half(x) * sin for each head of one row, in place.
void rotate(float* x, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * D;
    for (int64_t d = 0; d < half; ++d) {
      const float a = v[d], b = v[d + half];
      v[d] = a * cos[d] - b * sin[d];
      v[d + half] = b * cos[d + half] + a * sin[d + half];
    }
  }
}

}  // namespace

torch::Tensor row_gemm(const torch::Tensor& x_in, const torch::Tensor& w) {
  check_operands(x_in, w, "row_gemm");
  const torch::Tensor x = x_in.contiguous();
  torch::Tensor out = torch::empty({x.size(0), w.size(0)}, x.options());
  gemm_rows(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), x.size(0),
            x.size(1), w.size(0), /*accumulate=*/false);
  return out;
}

// One decoder layer for one new token per row; `x` [B, hidden] is updated in place. The new
// key/value go to column `length` of buf_k / buf_v [B, n_kv, capacity, D] (capacity > length);
// attention covers columns 0..length where mask [B, length + 1] (bool) is true. cos/sin [B, D]
// are the rotary embedding's values at each row's position. With a few rows (kernels.MAX_ROWS)
// the large projections go through the row kernel, which beats ATen's GEMM there; with more,
// the caller passes a min_numel above every weight so ATen multiplies them all, and the layer
// still saves the forward's copies (KV heads repeated per query head, an additive mask).
void decode_layer(torch::Tensor x, const torch::Tensor& norm_in, double eps_in,
                  const torch::Tensor& wq, const c10::optional<torch::Tensor>& bq,
                  const torch::Tensor& wk, const c10::optional<torch::Tensor>& bk,
                  const torch::Tensor& wv, const c10::optional<torch::Tensor>& bv,
                  const torch::Tensor& wo, const c10::optional<torch::Tensor>& bo,
                  const torch::Tensor& norm_post, double eps_post,
                  const torch::Tensor& wg, const c10::optional<torch::Tensor>& bg,
                  const torch::Tensor& wu, const c10::optional<torch::Tensor>& bu,
                  const torch::Tensor& wd, const c10::optional<torch::Tensor>& bd,
                  torch::Tensor buf_k, torch::Tensor buf_v, int64_t length,
                  const torch::Tensor& mask, const torch::Tensor& cos, const torch::Tensor& sin,
                  int64_t n_heads, int64_t n_kv, double scaling, int64_t min_numel) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat, "decode_layer: x");
  const int64_t B = x.size(0), H = x.size(1), D = buf_k.size(3), T = length + 1;
  TORCH_CHECK(buf_k.size(2) > length && buf_v.sizes() == buf_k.sizes() && buf_k.stride(3) == 1 &&
                  buf_v.stride(3) == 1 && buf_k.size(0) == B && buf_k.size(1) == n_kv,
              "decode_layer: KV buffers");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.size(0) == B &&
                  mask.size(1) == T,
              "decode_layer: mask [B, length + 1] bool expected, got ", mask.sizes());
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == D, "decode_layer: rope");
  const auto opts = x.options();
  torch::Tensor h = torch::empty({B, H}, opts);
  torch::Tensor q = torch::empty({B, n_heads * D}, opts);
  torch::Tensor k = torch::empty({B, n_kv * D}, opts);
  torch::Tensor v = torch::empty({B, n_kv * D}, opts);
  torch::Tensor o = torch::empty({B, n_heads * D}, opts);

  rms_norm(x.data_ptr<float>(), norm_in.data_ptr<float>(), h.data_ptr<float>(), B, H, eps_in);
  project(h, wq, bq, q, false, min_numel);
  project(h, wk, bk, k, false, min_numel);
  project(h, wv, bv, v, false, min_numel);

  float* kb = buf_k.data_ptr<float>();
  float* vb = buf_v.data_ptr<float>();
  const int64_t s0 = buf_k.stride(0), s1 = buf_k.stride(1), s2 = buf_k.stride(2);
  const int64_t t0 = buf_v.stride(0), t1 = buf_v.stride(1), t2 = buf_v.stride(2);
  for (int64_t b = 0; b < B; ++b) {
    const float* c = cos.data_ptr<float>() + b * D;
    const float* s = sin.data_ptr<float>() + b * D;
    rotate(q.data_ptr<float>() + b * n_heads * D, n_heads, D, c, s);
    rotate(k.data_ptr<float>() + b * n_kv * D, n_kv, D, c, s);
    for (int64_t g = 0; g < n_kv; ++g) {
      const float* kr = k.data_ptr<float>() + (b * n_kv + g) * D;
      const float* vr = v.data_ptr<float>() + (b * n_kv + g) * D;
      float* kd = kb + b * s0 + g * s1 + length * s2;
      float* vd = vb + b * t0 + g * t1 + length * t2;
      for (int64_t d = 0; d < D; ++d) kd[d] = kr[d], vd[d] = vr[d];
    }
  }

  // Attention: the `groups` query heads of each key/value head (grouped-query attention) read
  // its cached columns together, each column once while it is in L1. Per head the arithmetic is
  // the same, in the same order, as one head at a time.
  const int64_t groups = n_heads / n_kv;
  const bool* mk = mask.data_ptr<bool>();
  const float* qp = q.data_ptr<float>();
  float* op = o.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  at::parallel_for(0, B * n_kv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(groups * T);
    std::vector<float> mx(groups), total(groups);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / n_kv, g = i % n_kv;
      const float* qv = qp + (b * n_heads + g * groups) * D;  // the group's heads, in order
      float* out = op + (b * n_heads + g * groups) * D;
      const float* keys = kb + b * s0 + g * s1;
      const float* vals = vb + b * t0 + g * t1;
      const bool* live = mk + b * T;
      std::fill(mx.begin(), mx.end(), -INFINITY);
      for (int64_t t = 0; t < T; ++t) {
        const float* key = keys + t * s2;
        for (int64_t j = 0; j < groups; ++j) {
          float& pjt = p[j * T + t];
          pjt = live[t] ? dot(qv + j * D, key, D) * scale : -INFINITY;  // exp(-inf) gives 0
          mx[j] = std::max(mx[j], pjt);
        }
      }
      for (int64_t j = 0; j < groups; ++j) {
        float* pj = p.data() + j * T;
        float sum = 0.f;
        int64_t t = 0;
        for (; t + kLanes <= T; t += kLanes) {
          const vec e = vexp(load(pj + t) - mx[j]);
          store(pj + t, e);
          sum += lanes_sum(e);
        }
        for (; t < T; ++t) {
          pj[t] = live[t] ? std::exp(pj[t] - mx[j]) : 0.f;
          sum += pj[t];
        }
        total[j] = sum;
      }
      for (int64_t d = 0; d < groups * D; ++d) out[d] = 0.f;
      for (int64_t t = 0; t < T; ++t) {
        if (!live[t]) continue;
        const float* val = vals + t * t2;
        for (int64_t j = 0; j < groups; ++j) {
          const float w = p[j * T + t];
          if (w != 0.f) axpy(w / total[j], val, out + j * D, D);
        }
      }
    }
  });
  project(o, wo, bo, x, /*accumulate=*/true, min_numel);

  // MLP: x += down(silu(gate(h)) * up(h)).
  const int64_t I = wg.size(0);
  torch::Tensor gate = torch::empty({B, I}, opts);
  torch::Tensor up = torch::empty({B, I}, opts);
  rms_norm(x.data_ptr<float>(), norm_post.data_ptr<float>(), h.data_ptr<float>(), B, H, eps_post);
  project(h, wg, bg, gate, false, min_numel);
  project(h, wu, bu, up, false, min_numel);
  float* gp = gate.data_ptr<float>();
  const float* upp = up.data_ptr<float>();
  int64_t i = 0;
  for (; i + kLanes <= B * I; i += kLanes) {
    const vec g = load(gp + i);
    store(gp + i, g / (1.f + vexp(-g)) * load(upp + i));
  }
  for (; i < B * I; ++i) gp[i] = gp[i] / (1.f + std::exp(-gp[i])) * upp[i];
  project(gate, wd, bd, x, /*accumulate=*/true, min_numel);
}

// cpu_train.cpp
std::vector<torch::Tensor> rms_norm_forward(const torch::Tensor& x, const torch::Tensor& w,
                                            double eps);
std::vector<torch::Tensor> rms_norm_backward(const torch::Tensor& dy, const torch::Tensor& x,
                                             const torch::Tensor& w, const torch::Tensor& r);
torch::Tensor swiglu_forward(const torch::Tensor& g, const torch::Tensor& u);
std::vector<torch::Tensor> swiglu_backward(const torch::Tensor& dy, const torch::Tensor& g,
                                           const torch::Tensor& u);
std::vector<torch::Tensor> logprob_entropy_forward(const torch::Tensor& z,
                                                   const torch::Tensor& labels, double temperature);
torch::Tensor logprob_entropy_backward(const torch::Tensor& z, const torch::Tensor& labels,
                                       const torch::Tensor& lse, const torch::Tensor& ent,
                                       const c10::optional<torch::Tensor>& grad_logp,
                                       const c10::optional<torch::Tensor>& grad_ent,
                                       double temperature, bool into_logits);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("row_gemm", &row_gemm, "x [M, K] @ w [N, K].T for few rows M (float32, CPU)");
  m.def("decode_layer", &decode_layer, "one Llama decoder layer for one token per row");
  m.def("rms_norm_forward", &rms_norm_forward, "LlamaRMSNorm: (y, 1 / rms per row)");
  m.def("rms_norm_backward", &rms_norm_backward, "LlamaRMSNorm's backward: (dx, dweight)");
  m.def("swiglu_forward", &swiglu_forward, "silu(gate) * up");
  m.def("swiglu_backward", &swiglu_backward, "silu(gate) * up's backward: (dgate, dup)");
  m.def("logprob_entropy_forward", &logprob_entropy_forward,
        "log-prob of each row's label and entropy of softmax(z / t): (logp, entropy, lse)");
  m.def("logprob_entropy_backward", &logprob_entropy_backward,
        "the gradient of logprob_entropy_forward's logp and entropy with respect to z");
}

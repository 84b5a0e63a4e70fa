// CPU kernels for the training forward and backward (float32): trainers/fused.py says when they
// are used and why.
//
// rms_norm_forward / rms_norm_backward: LlamaRMSNorm, y = w * (x * r) with
// r = 1 / sqrt(mean(x^2) + eps) per row. Through autograd it is ~6 tensor operations forward and
// ~10 backward, each a pass over [tokens, hidden]; here one pass forward (keeping r), one
// backward.
//
// swiglu_forward / swiglu_backward: the gated MLP's silu(g) * u, forward and backward in one
// pass each (autograd: silu, mul; mul, mul, silu_backward).
//
// Rows are split across threads; the weight gradient of the norm is summed per thread, then
// across threads in thread order.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <vector>

#include "vec.h"

namespace {

using namespace agentrl;

void check(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), what,
              ": a contiguous float32 CPU tensor expected");
}

// d * x elementwise into out (n floats).
inline void mul_into(const float* a, const float* b, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(out + i, load(a + i) * load(b + i));
  for (; i < n; ++i) out[i] = a[i] * b[i];
}

}  // namespace

// x [M, H], w [H] -> (y [M, H], r [M]).
std::vector<torch::Tensor> rms_norm_forward(const torch::Tensor& x, const torch::Tensor& w,
                                            double eps) {
  check(x, "rms_norm_forward: x");
  check(w, "rms_norm_forward: weight");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1), "rms_norm_forward: shapes");
  const int64_t M = x.size(0), H = x.size(1);
  torch::Tensor y = torch::empty_like(x);
  torch::Tensor r = torch::empty({M}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* rp = r.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = xp + m * H;
      float* yr = yp + m * H;
      const float inv = 1.f / std::sqrt(dot(xr, xr, H) / static_cast<float>(H) +
                                        static_cast<float>(eps));
      rp[m] = inv;
      const vec iv = vec{} + inv;
      int64_t i = 0;
      for (; i + kLanes <= H; i += kLanes) store(yr + i, load(wp + i) * (load(xr + i) * iv));
      for (; i < H; ++i) yr[i] = wp[i] * (xr[i] * inv);
    }
  });
  return {y, r};
}

// dy, x [M, H], w [H], r [M] -> (dx [M, H], dw [H]).
//   dx = r * (w dy) - x * r^3 * sum(w dy x) / H,   dw = sum over rows of dy * x * r
std::vector<torch::Tensor> rms_norm_backward(const torch::Tensor& dy, const torch::Tensor& x,
                                             const torch::Tensor& w, const torch::Tensor& r) {
  check(dy, "rms_norm_backward: grad");
  check(x, "rms_norm_backward: x");
  check(w, "rms_norm_backward: weight");
  check(r, "rms_norm_backward: r");
  TORCH_CHECK(dy.sizes() == x.sizes() && x.dim() == 2 && w.size(0) == x.size(1) &&
                  r.size(0) == x.size(0),
              "rms_norm_backward: shapes");
  const int64_t M = x.size(0), H = x.size(1);
  torch::Tensor dx = torch::empty_like(x);
  const int threads = at::get_num_threads();
  // One partial weight gradient per thread chunk, summed below in chunk order.
  const int64_t grain = std::max<int64_t>(16, (M + threads - 1) / threads);
  const int64_t chunks = (M + grain - 1) / grain;
  torch::Tensor partial = torch::zeros({std::max<int64_t>(chunks, 1), H}, x.options());
  const float* dyp = dy.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* rp = r.data_ptr<float>();
  float* dxp = dx.data_ptr<float>();
  float* pp = partial.data_ptr<float>();
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> g(H);
    for (int64_t c = c0; c < c1; ++c) {
      float* dw = pp + c * H;
      for (int64_t m = c * grain; m < std::min(M, (c + 1) * grain); ++m) {
        const float* dyr = dyp + m * H;
        const float* xr = xp + m * H;
        float* dxr = dxp + m * H;
        const float inv = rp[m];
        mul_into(wp, dyr, g.data(), H);  // g = w * dy
        const float coef = dot(g.data(), xr, H) / static_cast<float>(H) * inv * inv * inv;
        const vec iv = vec{} + inv, cv = vec{} + coef;
        int64_t i = 0;
        for (; i + kLanes <= H; i += kLanes) {
          const vec xv = load(xr + i);
          store(dxr + i, iv * load(g.data() + i) - xv * cv);
          store(dw + i, load(dw + i) + load(dyr + i) * (xv * iv));
        }
        for (; i < H; ++i) {
          dxr[i] = inv * g[i] - xr[i] * coef;
          dw[i] += dyr[i] * (xr[i] * inv);
        }
      }
    }
  });
  return {dx, partial.sum(0)};
}

// g, u [N] (any shape, contiguous) -> silu(g) * u.
torch::Tensor swiglu_forward(const torch::Tensor& g, const torch::Tensor& u) {
  check(g, "swiglu_forward: gate");
  check(u, "swiglu_forward: up");
  TORCH_CHECK(g.sizes() == u.sizes(), "swiglu_forward: shapes");
  torch::Tensor y = torch::empty_like(g);
  const float* gp = g.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, g.numel(), 4096, [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
    for (; i + kLanes <= i1; i += kLanes) {
      const vec gv = load(gp + i);
      store(yp + i, gv / (1.f + vexp(-gv)) * load(up + i));
    }
    for (; i < i1; ++i) yp[i] = gp[i] / (1.f + std::exp(-gp[i])) * up[i];
  });
  return y;
}

// dy, g, u -> (dg, du): with s = sigmoid(g), du = dy * g * s, dg = dy * u * s * (1 + g (1 - s)).
std::vector<torch::Tensor> swiglu_backward(const torch::Tensor& dy, const torch::Tensor& g,
                                           const torch::Tensor& u) {
  check(dy, "swiglu_backward: grad");
  check(g, "swiglu_backward: gate");
  check(u, "swiglu_backward: up");
  TORCH_CHECK(g.sizes() == u.sizes() && dy.sizes() == g.sizes(), "swiglu_backward: shapes");
  torch::Tensor dg = torch::empty_like(g);
  torch::Tensor du = torch::empty_like(u);
  const float* dyp = dy.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  float* dgp = dg.data_ptr<float>();
  float* dup = du.data_ptr<float>();
  at::parallel_for(0, g.numel(), 4096, [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
    for (; i + kLanes <= i1; i += kLanes) {
      const vec gv = load(gp + i), dv = load(dyp + i);
      const vec s = 1.f / (1.f + vexp(-gv));
      store(dup + i, dv * (gv * s));
      store(dgp + i, dv * load(up + i) * (s * (1.f + gv * (1.f - s))));
    }
    for (; i < i1; ++i) {
      const float s = 1.f / (1.f + std::exp(-gp[i]));
      dup[i] = dyp[i] * (gp[i] * s);
      dgp[i] = dyp[i] * up[i] * (s * (1.f + gp[i] * (1.f - s)));
    }
  });
  return {dg, du};
}

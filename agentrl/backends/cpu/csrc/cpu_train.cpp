// CPU kernels for the training forward and backward (float32): agentrl/backends/cpu/fused.py
// says when they are used and why.
//
// rms_norm_forward / rms_norm_backward: LlamaRMSNorm, y = w * (x * r) with
// r = 1 / sqrt(mean(x^2) + eps) per row. Through autograd it is ~6 tensor operations forward and
// ~10 backward, each a pass over [tokens, hidden]; here one pass forward (keeping r), one
// backward.
//
// swiglu_forward / swiglu_backward: the gated MLP's silu(g) * u, forward and backward in one
// pass each (autograd: silu, mul; mul, mul, silu_backward).
//
// logprob_entropy_forward / logprob_entropy_backward: the log-prob of each token's label and
// the entropy of softmax(logits / t) over the vocabulary, and their gradient, one pass per row
// each way.
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

// ------------------------------------------------------------- log-probs and entropies

namespace {

inline vec vmax(vec a, vec b) { return a > b ? a : b; }

// z / t for one row into a scratch row (the logits themselves when t == 1).
inline const float* scaled_row(const float* z, int64_t V, double temperature, float* scratch) {
  if (temperature == 1.0) return z;
  const float t = static_cast<float>(temperature);
  int64_t v = 0;
  for (; v + kLanes <= V; v += kLanes) store(scratch + v, load(z + v) / t);
  for (; v < V; ++v) scratch[v] = z[v] / t;
  return scratch;
}

}  // namespace

// z [R, V] logits, labels [R] int64, temperature -> (logp [R], entropy [R], lse [R]) of
// softmax(z / temperature): logp = z[label] / t - lse, entropy = lse - sum_v p_v z_v / t, with
// lse = log sum_v exp(z_v / t). Per row: one pass for the max, one for the sums (the row, 49k
// floats for a 49k vocabulary, stays in L2 between them). Through torch it is a log-softmax,
// a gather, an exp, a product and a sum, each writing or reading a fresh [R, V] tensor.
std::vector<torch::Tensor> logprob_entropy_forward(const torch::Tensor& z,
                                                   const torch::Tensor& labels,
                                                   double temperature) {
  check(z, "logprob_entropy_forward: logits");
  TORCH_CHECK(z.dim() == 2 && labels.dim() == 1 && labels.size(0) == z.size(0) &&
                  labels.scalar_type() == at::kLong && labels.is_contiguous(),
              "logprob_entropy_forward: logits [R, V] and int64 labels [R] expected, got ",
              z.sizes(), " and ", labels.sizes());
  TORCH_CHECK(temperature > 0, "logprob_entropy_forward: temperature must be > 0");
  const int64_t R = z.size(0), V = z.size(1);
  TORCH_CHECK(R == 0 || (labels.min().item<int64_t>() >= 0 && labels.max().item<int64_t>() < V),
              "logprob_entropy_forward: labels must be in [0, ", V, ")");
  torch::Tensor logp = torch::empty({R}, z.options());
  torch::Tensor ent = torch::empty({R}, z.options());
  torch::Tensor lse = torch::empty({R}, z.options());
  const float* zp = z.data_ptr<float>();
  const int64_t* lp = labels.data_ptr<int64_t>();
  float* logpp = logp.data_ptr<float>();
  float* entp = ent.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> scratch(temperature == 1.0 ? 0 : V);
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = scaled_row(zp + r * V, V, temperature, scratch.data());
      const int64_t v_vec = V - V % kLanes;
      vec mv = vec{} - INFINITY;
      for (int64_t v = 0; v < v_vec; v += kLanes) mv = vmax(mv, load(x + v));
      float m = -INFINITY;
      for (int l = 0; l < kLanes; ++l) m = std::max(m, mv[l]);
      for (int64_t v = v_vec; v < V; ++v) m = std::max(m, x[v]);
      // sum exp(x - m) and sum exp(x - m) (x - m); a -inf logit (p = 0) adds 0 to both.
      vec sv = {}, wv = {};
      const vec zero = {};
      for (int64_t v = 0; v < v_vec; v += kLanes) {
        const vec d = load(x + v) - m;
        const vec e = vexp(d);
        sv += e;
        wv += e == zero ? zero : e * d;
      }
      float s = lanes_sum(sv), w = lanes_sum(wv);
      for (int64_t v = v_vec; v < V; ++v) {
        const float d = x[v] - m, e = std::exp(d);
        s += e;
        w += e == 0.f ? 0.f : e * d;
      }
      const float log_s = std::log(s);
      lsep[r] = m + log_s;
      logpp[r] = x[lp[r]] - lsep[r];
      entp[r] = log_s - w / s;  // -sum p log p, p = e / s, log p = d - log s
    }
  });
  return {logp, ent, lse};
}

// The gradient of the above with respect to z, for upstream gradients g (of logp) and h (of
// the entropy), either absent: with x = z / t, log p = x - lse and H the entropy,
//   dz_v = (g (onehot(label)_v - p_v) - h p_v (log p_v + H)) / t,
// one pass per row writing dz (torch: a product, a scatter, xlogy and a division over [R, V]).
torch::Tensor logprob_entropy_backward(const torch::Tensor& z, const torch::Tensor& labels,
                                       const torch::Tensor& lse, const torch::Tensor& ent,
                                       const c10::optional<torch::Tensor>& grad_logp,
                                       const c10::optional<torch::Tensor>& grad_ent,
                                       double temperature, bool into_logits) {
  check(z, "logprob_entropy_backward: logits");
  check(lse, "logprob_entropy_backward: lse");
  check(ent, "logprob_entropy_backward: entropy");
  const int64_t R = z.size(0), V = z.size(1);
  const bool has_g = grad_logp.has_value() && grad_logp->defined();
  const bool has_h = grad_ent.has_value() && grad_ent->defined();
  torch::Tensor g = has_g ? grad_logp->contiguous() : torch::zeros({R}, z.options());
  torch::Tensor h = has_h ? grad_ent->contiguous() : torch::zeros({R}, z.options());
  check(g, "logprob_entropy_backward: grad of logp");
  check(h, "logprob_entropy_backward: grad of entropy");
  TORCH_CHECK(lse.numel() == R && ent.numel() == R && g.numel() == R && h.numel() == R &&
                  labels.numel() == R,
              "logprob_entropy_backward: [R] tensors expected");
  // Each element of z is read before its gradient is written, so dz may take z's memory.
  torch::Tensor dz = into_logits ? z : torch::empty_like(z);
  const float* zp = z.data_ptr<float>();
  const int64_t* lp = labels.data_ptr<int64_t>();
  const float *lsep = lse.data_ptr<float>(), *entp = ent.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *hp = h.data_ptr<float>();
  float* dzp = dz.data_ptr<float>();
  const float t = static_cast<float>(temperature);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* zr = zp + r * V;
      float* out = dzp + r * V;
      const float gr = gp[r], hr = hp[r], l = lsep[r], H = entp[r];
      const vec zero = {};
      int64_t v = 0;
      for (; v + kLanes <= V; v += kLanes) {
        const vec x = temperature == 1.0 ? load(zr + v) : load(zr + v) / t;
        const vec logp = x - l;
        const vec p = vexp(logp);
        const vec term = p * (gr + hr * (logp + H));
        const vec d = p == zero ? zero : zero - term;  // 0 where p underflowed (as xlogy)
        store(out + v, temperature == 1.0 ? d : d / t);
      }
      for (; v < V; ++v) {
        const float x = temperature == 1.0 ? zr[v] : zr[v] / t;
        const float logp = x - l, p = std::exp(logp);
        const float d = p == 0.f ? 0.f : -(p * (gr + hr * (logp + H)));
        out[v] = temperature == 1.0 ? d : d / t;
      }
      out[lp[r]] += temperature == 1.0 ? gr : gr / t;
    }
  });
  return dz;
}

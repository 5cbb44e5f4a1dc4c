// A Llama decoder layer's work before and after its attention, in one call each (spd.targets.lean_layers): the
// RMSNorm, the q / k / v products and the rotary embedding; then the o product, the residual, the second RMSNorm,
// the MLP and its residual. Each step is the ATen operator transformers' Python calls (the same kernels, so the same
// bits: tests/test_lean_layers.py) or the suite's panel product; what it saves is Python's ~3 us an operation,
// ~40 of them a layer, which outweigh the products of a one-row step over 4-bit blocks.

#include <torch/extension.h>

#include "panel_api.h"

namespace {

using torch::Tensor;
using Bias = c10::optional<Tensor>;

Tensor product(const Tensor& x, const Tensor& panels, int64_t n_out, const Bias& bias, int64_t level, int64_t bits) {
  return multiply_at(x, panels, n_out, bias, level, bits == 0 ? 0 : bits == 4 ? 1 : 2);
}

std::vector<int64_t> formats(const std::vector<int64_t>& bits) {
  // weight bits (0: float32 panels) -> multiply_many_at's formats
  std::vector<int64_t> out;
  for (auto b : bits) out.push_back(b == 0 ? 0 : b == 4 ? 1 : 2);
  return out;
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  // LlamaRMSNorm.forward: float32 rows here, so its casts are the identity
  auto variance = x.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (x * at::rsqrt(variance + eps));
}

Tensor rotate_half(const Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, x.size(-1) - half), x.narrow(-1, 0, half)}, -1);
}

}  // namespace

std::vector<Tensor> llama_before_attention(const Tensor& hidden, const Tensor& norm, double eps,
                                           const std::vector<Tensor>& panels, const std::vector<int64_t>& n_out,
                                           const std::vector<Bias>& biases,
                                           const std::vector<int64_t>& bits, int64_t level, const Tensor& cos, const Tensor& sin,
                                           int64_t head_dim) {
  // hidden [B, T, d] -> q [B, H, T, hd], k and v [B, H_kv, T, hd] (q and k rotated); cos, sin [B, T, hd]
  TORCH_CHECK(panels.size() == 3 && n_out.size() == 3 && biases.size() == 3 && bits.size() == 3, "q, k and v");
  auto h = rms_norm(hidden, norm, eps);
  std::vector<int64_t> shape(h.sizes().begin(), h.sizes().end() - 1);
  shape.push_back(-1);
  shape.push_back(head_dim);
  std::vector<Tensor> out;
  for (int i = 0; i < 3; ++i)
    out.push_back(product(h, panels[i], n_out[i], biases[i], level, bits[i]).view(shape).transpose(1, 2));
  auto c = cos.unsqueeze(1), s = sin.unsqueeze(1);                       // [B, 1, T, hd]
  for (int i = 0; i < 2; ++i) out[i] = (out[i] * c) + (rotate_half(out[i]) * s);
  return out;
}

Tensor llama_after_attention(const Tensor& attended, const Tensor& residual, const Tensor& norm, double eps,
                             const std::vector<Tensor>& panels, const std::vector<int64_t>& n_out,
                             const std::vector<Bias>& biases, const std::vector<int64_t>& bits, int64_t level) {
  // attended [B, T, H, hd] (the attention's output), residual [B, T, d] -> the layer's output [B, T, d];
  // panels: o, gate, up, down
  TORCH_CHECK(panels.size() == 4 && n_out.size() == 4 && biases.size() == 4 && bits.size() == 4, "o, gate, up, down");
  std::vector<int64_t> shape(residual.sizes().begin(), residual.sizes().end() - 1);
  shape.push_back(-1);
  auto hidden = residual + product(attended.reshape(shape).contiguous(), panels[0], n_out[0], biases[0], level, bits[0]);
  auto h = rms_norm(hidden, norm, eps);
  auto gate = product(h, panels[1], n_out[1], biases[1], level, bits[1]);
  auto up = product(h, panels[2], n_out[2], biases[2], level, bits[2]);
  return hidden + product(at::silu(gate) * up, panels[3], n_out[3], biases[3], level, bits[3]);
}

// ---------------------------------------------------------------------------------------------------------------
// A layer at weights=q4 in the suite's own row arithmetic: the same steps, each a loop over a row's own values in a
// written-out order (spd/csrc/row_ops.h for the vector ones), instead of ATen operators. A GGUF's blocks define a
// target of their own (its products already differ from the float32 target's in rounding), so nothing ties this
// layer to transformers' bits; what it must keep is the row property — a row's bits do not depend on what else the
// call holds — which each loop has by construction. What it saves is ATen's dispatch, ~1–2 us an operator and ~60
// operators a layer, most of a one-row step once the products read 5 bits a weight.

namespace {

void rms_rows(const float* x, const float* w, float eps, int64_t rows, int64_t d, float* y) {
  // y = w * (x / sqrt(mean(x^2) + eps)), a row at a time, its squares summed in order
  for (int64_t r = 0; r < rows; ++r, x += d, y += d) {
    float ss = 0.0f;
    for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) y[i] = w[i] * (x[i] * inv);
  }
}

Tensor rms(const Tensor& x, const Tensor& weight, double eps) {
  auto xc = x.contiguous(), w = weight.contiguous();
  TORCH_CHECK(xc.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32, "float32 rows and norm");
  auto y = torch::empty_like(xc);
  const int64_t d = xc.size(-1);
  rms_rows(xc.data_ptr<float>(), w.data_ptr<float>(), static_cast<float>(eps), xc.numel() / d, d, y.data_ptr<float>());
  return y;
}

Tensor rotated(const Tensor& y, int64_t B, int64_t T, int64_t heads, int64_t hd, const Tensor& cos, const Tensor& sin) {
  // y [B * T, heads * hd] (a product's rows) -> [B, heads, T, hd]: x * cos + rotate_half(x) * sin
  auto out = torch::empty({B, heads, T, hd}, y.options());
  const float *src = y.data_ptr<float>(), *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t half = hd / 2, cb = cos.size(0) == 1 ? 0 : T * hd;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const float* row = src + (b * T + t) * heads * hd;
      const float *cr = c + b * cb + t * hd, *sr = s + b * cb + t * hd;
      for (int64_t h = 0; h < heads; ++h) {
        const float* x = row + h * hd;
        float* o = dst + ((b * heads + h) * T + t) * hd;
        for (int64_t i = 0; i < hd; ++i) {
          const float r = i < half ? -x[i + half] : x[i - half];
          o[i] = x[i] * cr[i] + r * sr[i];
        }
      }
    }
  return out;
}

void add_into(Tensor& a, const Tensor& b) {
  // a += b element by element (a is this file's own output; b contiguous float32 of a's size)
  auto bc = b.contiguous();
  float* pa = a.data_ptr<float>();
  const float* pb = bc.data_ptr<float>();
  for (int64_t i = 0, n = a.numel(); i < n; ++i) pa[i] = pa[i] + pb[i];
}

}  // namespace

std::vector<Tensor> own_before_attention(const Tensor& hidden, const Tensor& norm, double eps,
                                         const std::vector<Tensor>& panels, const std::vector<int64_t>& n_out,
                                         const std::vector<Bias>& biases, const std::vector<int64_t>& bits,
                                         int64_t level, const Tensor& cos, const Tensor& sin, int64_t head_dim) {
  // hidden [B, T, d] -> q [B, H, T, hd], k [B, H_kv, T, hd] (both rotated), v [B, H_kv, T, hd]; cos, sin [1 or B, T, hd]
  TORCH_CHECK(panels.size() == 3 && n_out.size() == 3 && biases.size() == 3 && bits.size() == 3, "q, k and v");
  TORCH_CHECK(hidden.dim() == 3, "hidden [B, T, d]");
  const int64_t B = hidden.size(0), T = hidden.size(1);
  auto h = rms(hidden, norm, eps);
  auto c = cos.to(torch::kFloat32).contiguous(), s = sin.to(torch::kFloat32).contiguous();
  TORCH_CHECK(c.dim() == 3 && c.size(1) == T && c.size(2) == head_dim, "cos, sin [1 or B, T, head_dim]");
  std::vector<Tensor> out, ys = multiply_many_at(h, panels, n_out, biases, formats(bits), level);
  for (int i = 0; i < 3; ++i) {
    auto y = ys[i].contiguous();                                                          // [B, T, heads * hd]
    const int64_t heads = n_out[i] / head_dim;
    if (i < 2) out.push_back(rotated(y, B, T, heads, head_dim, c, s));
    else out.push_back(y.view({B, T, heads, head_dim}).transpose(1, 2));
  }
  return out;
}

Tensor own_attention(const Tensor& q, const Tensor& k, const Tensor& v, const c10::optional<Tensor>& mask,
                     double scaling, int64_t level) {
  // q [B, H, T, hd], k and v [B, H_kv, S, hd] -> [B, T, H, hd]; mask [1 or B, 1, T, S] bool (true: visible) or
  // additive float32, or none (row t sees keys 0 .. S - T + t)
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q [B, H, T, hd], k and v [B, H_kv, S, hd]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
              v.scalar_type() == torch::kFloat32, "float32 attention");
  auto qc = q.stride(3) == 1 ? q : q.contiguous();
  auto kc = k.stride(3) == 1 ? k : k.contiguous();
  auto vc = v.stride(3) == 1 ? v : v.contiguous();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(H % Hkv == 0 && k.size(0) == B && v.sizes() == k.sizes() && k.size(3) == D, "q, k, v do not fit");
  auto out = torch::empty({B, T, H, D}, q.options());
  RowAttention a{};
  a.q = qc.data_ptr<float>(); a.k = kc.data_ptr<float>(); a.v = vc.data_ptr<float>();
  for (int i = 0; i < 3; ++i) { a.qs[i] = qc.stride(i); a.ks[i] = kc.stride(i); a.vs[i] = vc.stride(i); }
  Tensor m;
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 4 && mask->size(1) == 1 && mask->size(2) == T && mask->size(3) == S,
                "mask [1 or B, 1, T, S]");
    m = mask->scalar_type() == torch::kBool ? mask->contiguous() : mask->to(torch::kFloat32).contiguous();
    if (m.scalar_type() == torch::kBool) a.visible = m.data_ptr<bool>();
    else a.bias = m.data_ptr<float>();
    a.ms[0] = m.size(0) == 1 ? 0 : m.stride(0);
    a.ms[1] = m.stride(2);
    a.ms[2] = m.stride(3);
  }
  a.B = B; a.H = H; a.Hkv = Hkv; a.T = T; a.S = S; a.D = D;
  a.scale = static_cast<float>(scaling);
  a.out = out.data_ptr<float>();
  attend_at(a, level);
  return out;
}

Tensor own_after_attention(const Tensor& attended, const Tensor& residual, const Tensor& norm, double eps,
                           const std::vector<Tensor>& panels, const std::vector<int64_t>& n_out,
                           const std::vector<Bias>& biases, const std::vector<int64_t>& bits, int64_t level) {
  // attended [B, T, H, hd], residual [B, T, d] -> the layer's output [B, T, d]; panels: o, gate, up, down
  TORCH_CHECK(panels.size() == 4 && n_out.size() == 4 && biases.size() == 4 && bits.size() == 4, "o, gate, up, down");
  std::vector<int64_t> shape(residual.sizes().begin(), residual.sizes().end() - 1);
  shape.push_back(-1);
  auto hidden = product(attended.reshape(shape).contiguous(), panels[0], n_out[0], biases[0], level, bits[0]).contiguous();
  add_into(hidden, residual.to(torch::kFloat32));                 // o(attended) + residual: the same sum either way
  auto h = rms(hidden, norm, eps);
  auto gate_up = multiply_many_at(h, {panels[1], panels[2]}, {n_out[1], n_out[2]}, {biases[1], biases[2]},
                                  formats({bits[1], bits[2]}), level);
  auto gate = gate_up[0].contiguous(), up = gate_up[1].contiguous();
  silu_mul_at(gate.data_ptr<float>(), up.data_ptr<float>(), gate.numel(), level);
  add_into(hidden, product(gate, panels[3], n_out[3], biases[3], level, bits[3]));
  return hidden;
}

Tensor own_attend_after(const Tensor& q, const Tensor& k, const Tensor& v, const c10::optional<Tensor>& mask,
                        double scaling, const Tensor& residual, const Tensor& norm, double eps,
                        const std::vector<Tensor>& panels, const std::vector<int64_t>& n_out,
                        const std::vector<Bias>& biases, const std::vector<int64_t>& bits, int64_t level) {
  // own_attention, then own_after_attention: one call from Python for the layer's second half
  return own_after_attention(own_attention(q, k, v, mask, scaling, level), residual, norm, eps, panels, n_out, biases,
                             bits, level);
}

OwnLayer::OwnLayer(Tensor norm1, double eps1, std::vector<Tensor> before, std::vector<int64_t> before_n,
                   std::vector<Bias> before_bias, std::vector<int64_t> before_bits, Tensor norm2, double eps2,
                   std::vector<Tensor> after, std::vector<int64_t> after_n, std::vector<Bias> after_bias,
                   std::vector<int64_t> after_bits, int64_t level, int64_t head_dim, double scaling)
    : norm1(std::move(norm1)), eps1(eps1), before(std::move(before)), before_n(std::move(before_n)),
      before_bias(std::move(before_bias)), before_bits(std::move(before_bits)), norm2(std::move(norm2)), eps2(eps2),
      after(std::move(after)), after_n(std::move(after_n)), after_bias(std::move(after_bias)),
      after_bits(std::move(after_bits)), level(level), head_dim(head_dim), scaling(scaling) {}

Tensor OwnLayer::forward(const Tensor& hidden, const c10::optional<Tensor>& keys, const c10::optional<Tensor>& values,
                         int64_t start, const c10::optional<Tensor>& mask, const Tensor& cos, const Tensor& sin) const {
  // hidden [B, T, d] -> [B, T, d]; keys / values: the layer's cache buffers [B, H_kv, capacity, hd], this
  // call's rows written at start .. start + T and the rows 0 .. start + T attended (none: the rows' own)
  auto qkv = own_before_attention(hidden, norm1, eps1, before, before_n, before_bias, before_bits, level, cos, sin,
                                  head_dim);
  Tensor k = qkv[1], v = qkv[2];
  if (keys.has_value()) {
    const int64_t T = k.size(2);
    keys->narrow(2, start, T).copy_(k);
    values->narrow(2, start, T).copy_(v);
    k = keys->narrow(2, 0, start + T);
    v = values->narrow(2, 0, start + T);
  }
  return own_attend_after(qkv[0], k, v, mask, scaling, hidden, norm2, eps2, after, after_n, after_bias, after_bits,
                          level);
}

std::vector<Tensor> own_layers(Tensor hidden, const std::vector<const OwnLayer*>& layers,
                               const std::vector<Tensor>& keys, const std::vector<Tensor>& values,
                               const std::vector<int64_t>& starts, const c10::optional<Tensor>& mask, const Tensor& cos,
                               const Tensor& sin, const std::vector<bool>& capture) {
  // the layers in order (each as OwnLayer::forward); returns the last one's output, then the output of every
  // layer i with capture[i], in order. keys / values / starts: one per layer, or empty (no cache)
  std::vector<Tensor> captured;
  for (size_t i = 0; i < layers.size(); ++i) {
    const bool cached = !keys.empty();
    hidden = layers[i]->forward(hidden, cached ? c10::optional<Tensor>(keys[i]) : c10::nullopt,
                                cached ? c10::optional<Tensor>(values[i]) : c10::nullopt, cached ? starts[i] : 0,
                                mask, cos, sin);
    if (capture[i]) captured.push_back(hidden);
  }
  captured.insert(captured.begin(), hidden);
  return captured;
}

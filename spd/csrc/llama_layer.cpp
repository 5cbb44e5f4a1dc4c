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

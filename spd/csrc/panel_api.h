// What spd/csrc/panel_linear.cpp gives the other sources of its build: the panel product at a level and format, and
// the Llama layer glue spd/csrc/llama_layer.cpp defines (bound to Python there, in one module).
#pragma once

#include <torch/extension.h>

#include <vector>

struct PanelProduct {
  // one product of a multiply_many call: its panels in `format`, P of them, into y [M, N]
  int64_t format;
  const uint8_t* panels;
  int64_t P, N;
  float* y;
};

struct QRows {
  // a product's rows quantized for a GGUF's blocks: q [M, K] 16-bit codes, per block of 32 inputs of a row
  // q = round(x / dx) (|q| <= 32767, ties to even), dx [M, K / 32] = the block's largest |x| / 32767 and
  // sx [M, K / 32] = dx * (the block's codes' sum). Where the products take byte dot products (AVX-512 VNNI), each
  // code also as its low byte (unsigned) and high byte (signed), q = 256 * high + low, in 32-bit words ordered as the
  // weights' bytes sit: per block of a row BYTE_WORDS words for 4-bit weights (b4) and for 8-bit ones (b8)
  static constexpr int64_t BYTE_WORDS = 18;
  const int16_t* q;
  const float *dx, *sx;
  const int32_t *b4, *b8;
  QRows from(int64_t m, int64_t K) const {      // the rows from row m on
    const int64_t B = K / 32;
    return {q ? q + m * K : q, dx ? dx + m * B : dx, sx ? sx + m * B : sx, b4 ? b4 + m * B * BYTE_WORDS : b4,
            b8 ? b8 + m * B * BYTE_WORDS : b8};
  }
};

// x [..., K] times each of several panels (the same rows): one parallel region for all of them
std::vector<torch::Tensor> multiply_many_at(const torch::Tensor& x, const std::vector<torch::Tensor>& panels,
                                            const std::vector<int64_t>& n_out,
                                            const std::vector<c10::optional<torch::Tensor>>& biases,
                                            const std::vector<int64_t>& formats, int64_t level);

struct RowAttention {
  // q [B, H, T, D], k and v [B, Hkv, S, D] (a layer's cache), each with strides (b, head, row) and D contiguous;
  // mask: bool `visible` or additive `bias` (-inf hides), strides (b, t, s) (0 where broadcast), or neither
  // (row t sees keys 0 .. S - T + t); out [B, T, H, D] contiguous
  const float *q, *k, *v;
  int64_t qs[3], ks[3], vs[3];
  const bool* visible;
  const float* bias;
  int64_t ms[3];
  int64_t B, H, Hkv, T, S, D;
  float scale;
  float* out;
};

// spd/csrc/row_ops.h at `level`: attention, and gate[i] = silu(gate[i]) * up[i]
void attend_at(const RowAttention& a, int64_t level);
void silu_mul_at(float* gate, const float* up, int64_t n, int64_t level);

// x [..., K] -> [..., N] from panels in `format` (0: float32, 1: 4-bit blocks, 2: 8-bit blocks) at `level`
torch::Tensor multiply_at(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                          const c10::optional<torch::Tensor>& bias, int64_t level, int64_t format);

std::vector<torch::Tensor> llama_before_attention(
    const torch::Tensor& hidden, const torch::Tensor& norm, double eps, const std::vector<torch::Tensor>& panels,
    const std::vector<int64_t>& n_out, const std::vector<c10::optional<torch::Tensor>>& biases,
    const std::vector<int64_t>& bits, int64_t level, const torch::Tensor& cos, const torch::Tensor& sin, int64_t head_dim);

torch::Tensor llama_after_attention(
    const torch::Tensor& attended, const torch::Tensor& residual, const torch::Tensor& norm, double eps,
    const std::vector<torch::Tensor>& panels, const std::vector<int64_t>& n_out,
    const std::vector<c10::optional<torch::Tensor>>& biases, const std::vector<int64_t>& bits, int64_t level);

// a layer at weights=q4 in the suite's own row arithmetic (spd/csrc/llama_layer.cpp)
std::vector<torch::Tensor> own_before_attention(
    const torch::Tensor& hidden, const torch::Tensor& norm, double eps, const std::vector<torch::Tensor>& panels,
    const std::vector<int64_t>& n_out, const std::vector<c10::optional<torch::Tensor>>& biases,
    const std::vector<int64_t>& bits, int64_t level, const torch::Tensor& cos, const torch::Tensor& sin, int64_t head_dim);

torch::Tensor own_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const c10::optional<torch::Tensor>& mask, double scaling, int64_t level);

torch::Tensor own_after_attention(
    const torch::Tensor& attended, const torch::Tensor& residual, const torch::Tensor& norm, double eps,
    const std::vector<torch::Tensor>& panels, const std::vector<int64_t>& n_out,
    const std::vector<c10::optional<torch::Tensor>>& biases, const std::vector<int64_t>& bits, int64_t level);

torch::Tensor own_attend_after(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const c10::optional<torch::Tensor>& mask,
    double scaling, const torch::Tensor& residual, const torch::Tensor& norm, double eps,
    const std::vector<torch::Tensor>& panels, const std::vector<int64_t>& n_out,
    const std::vector<c10::optional<torch::Tensor>>& biases, const std::vector<int64_t>& bits, int64_t level);

// a layer at weights=q4 held once (its norms, panels and shapes), run with a cache's buffers
struct OwnLayer {
  OwnLayer(torch::Tensor norm1, double eps1, std::vector<torch::Tensor> before, std::vector<int64_t> before_n,
           std::vector<c10::optional<torch::Tensor>> before_bias, std::vector<int64_t> before_bits, torch::Tensor norm2,
           double eps2, std::vector<torch::Tensor> after, std::vector<int64_t> after_n,
           std::vector<c10::optional<torch::Tensor>> after_bias, std::vector<int64_t> after_bits, int64_t level,
           int64_t head_dim, double scaling);
  torch::Tensor forward(const torch::Tensor& hidden, const c10::optional<torch::Tensor>& keys,
                        const c10::optional<torch::Tensor>& values, int64_t start,
                        const c10::optional<torch::Tensor>& mask, const torch::Tensor& cos,
                        const torch::Tensor& sin) const;
  torch::Tensor norm1;
  double eps1;
  std::vector<torch::Tensor> before;              // q, k, v
  std::vector<int64_t> before_n;
  std::vector<c10::optional<torch::Tensor>> before_bias;
  std::vector<int64_t> before_bits;
  torch::Tensor norm2;
  double eps2;
  std::vector<torch::Tensor> after;               // o, gate, up, down
  std::vector<int64_t> after_n;
  std::vector<c10::optional<torch::Tensor>> after_bias;
  std::vector<int64_t> after_bits;
  int64_t level, head_dim;
  double scaling;
};

std::vector<torch::Tensor> own_layers(torch::Tensor hidden, const std::vector<const OwnLayer*>& layers,
                                      const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                                      const std::vector<int64_t>& starts, const c10::optional<torch::Tensor>& mask,
                                      const torch::Tensor& cos, const torch::Tensor& sin, const std::vector<bool>& capture);

// What spd/csrc/panel_linear.cpp gives the other sources of its build: the panel product at a level and format, and
// the Llama layer glue spd/csrc/llama_layer.cpp defines (bound to Python there, in one module).
#pragma once

#include <torch/extension.h>

#include <vector>

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

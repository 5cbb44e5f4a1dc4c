// float32 x W^T on a CPU from a weight packed once into panels of LANES output features, for few rows at a time.
//
// Why: MKL's sgemm steps at 4 rows on these CPUs (a forward's products cost 1.8x their one-row time at 4 rows and
// stay above it to 15; docs/speed-cpu.md), so a draft of 4..15 rows paid most of a second forward. Streaming
// the weight once per call and multiplying every row against it while it is in registers keeps the products at the
// weight's memory time up to ~12 rows.
//
// Every output element is the same sequence of operations whatever the row count: blocks of KB inputs in order,
// each summed in order by fused multiply-adds into a fresh accumulator, the blocks added in order. So a row's bits do
// not depend on the rows beside it (the premise of exact drafted decoding; checked at load by spd.targets.panel).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#if defined(__AVX512F__)
constexpr int LANES = 16;
constexpr int MT = 12;      // 2 panels x 12 rows = 24 accumulators + 2 weights + 1 broadcast of 32 registers
#else
constexpr int LANES = 8;
constexpr int MT = 6;       // 2 x 6 + 2 + 1 of 16
#endif
constexpr int NP = 2;       // panels per tile
constexpr int64_t KB = 64;  // inputs per block
constexpr int64_t PREFETCH = 32;  // panel lines ahead (2 KiB)

typedef float vec __attribute__((vector_size(LANES * 4)));

template <int P, int R>
static inline void tile(const float* __restrict x, int64_t K, const float* __restrict panel, float* __restrict y,
                        int64_t N, int64_t n0) {
  // R rows of x [R, K] against P panels [P, K, LANES] -> y[:R, n0 : n0 + P * LANES] (clipped at N)
  float out[P][R][LANES];
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    const int64_t k1 = std::min(K, k0 + KB);
    vec acc[P][R];
    for (int i = 0; i < P; ++i)
      for (int j = 0; j < R; ++j) acc[i][j] = (vec){};
    for (int64_t k = k0; k < k1; ++k) {
      vec w[P];
      for (int i = 0; i < P; ++i) __builtin_memcpy(&w[i], panel + (i * K + k) * LANES, sizeof(vec));
      // the hardware prefetcher alone leaves several rows' products waiting on memory (-10..20% at 4..16 rows)
      for (int i = 0; i < P; ++i) __builtin_prefetch(panel + (i * K + k + PREFETCH) * LANES);
      for (int j = 0; j < R; ++j) {
        const float xs = x[j * K + k];
        for (int i = 0; i < P; ++i) acc[i][j] += w[i] * xs;
      }
    }
    for (int i = 0; i < P; ++i)
      for (int j = 0; j < R; ++j) {
        float block[LANES];
        __builtin_memcpy(block, &acc[i][j], sizeof(vec));
        for (int l = 0; l < LANES; ++l) out[i][j][l] = k0 == 0 ? block[l] : out[i][j][l] + block[l];
      }
  }
  for (int i = 0; i < P; ++i) {
    const int64_t n = n0 + i * LANES, width = std::min<int64_t>(LANES, N - n);
    for (int j = 0; j < R && width > 0; ++j) std::copy(out[i][j], out[i][j] + width, y + j * N + n);
  }
}

template <int P>
static void rows(const float* x, int64_t M, int64_t K, const float* panel, float* y, int64_t N, int64_t n0) {
  int64_t m = 0;
  for (; m + MT <= M; m += MT) tile<P, MT>(x + m * K, K, panel, y + m * N, N, n0);
  const float* xm = x + m * K;
  float* ym = y + m * N;
  switch (M - m) {
    case 1: tile<P, 1>(xm, K, panel, ym, N, n0); break;
    case 2: tile<P, 2>(xm, K, panel, ym, N, n0); break;
    case 3: tile<P, 3>(xm, K, panel, ym, N, n0); break;
    case 4: tile<P, 4>(xm, K, panel, ym, N, n0); break;
    case 5: tile<P, 5>(xm, K, panel, ym, N, n0); break;
#if defined(__AVX512F__)
    case 6: tile<P, 6>(xm, K, panel, ym, N, n0); break;
    case 7: tile<P, 7>(xm, K, panel, ym, N, n0); break;
    case 8: tile<P, 8>(xm, K, panel, ym, N, n0); break;
    case 9: tile<P, 9>(xm, K, panel, ym, N, n0); break;
    case 10: tile<P, 10>(xm, K, panel, ym, N, n0); break;
    case 11: tile<P, 11>(xm, K, panel, ym, N, n0); break;
#endif
    default: break;
  }
}

torch::Tensor pack(const torch::Tensor& weight) {
  // weight [N, K] -> panels [ceil(N / LANES), K, LANES], zero-padded
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32, "pack: a 2-D float32 weight");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + LANES - 1) / LANES;
  auto padded = torch::zeros({P * LANES, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, LANES, K}).permute({0, 2, 1}).contiguous();
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                     const c10::optional<torch::Tensor>& bias) {
  // x [..., K] -> [..., N]
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && panels.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == LANES && panels.size(1) == x.size(-1), "panels do not fit x");
  auto x2 = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = x2.size(0), K = x2.size(1), P = panels.size(0);
  TORCH_CHECK(P * LANES >= N && N > (P - 1) * LANES, "panels do not hold N outputs");
  auto y = torch::empty({M, N}, x2.options());
  const float* xp = x2.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M > 0) {
    at::parallel_for(0, (P + NP - 1) / NP, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t p = t * NP;
        if (p + NP <= P) rows<NP>(xp, M, K, pp + p * K * LANES, yp, N, p * LANES);
        else rows<1>(xp, M, K, pp + p * K * LANES, yp, N, p * LANES);
      }
    });
  }
  if (bias.has_value()) y.add_(*bias);
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack);
  m.def("linear", &linear);
  m.attr("lanes") = LANES;
}

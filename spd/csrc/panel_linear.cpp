// float32 x W^T on a CPU from a weight packed once into panels of LANES output features, for few rows at a time.
//
// Why: MKL's sgemm steps at 4 rows on these CPUs (a forward's products cost 1.8x their one-row time at 4 rows and
// stay above it to 15; docs/speed-cpu.md), so a draft of 4..15 rows paid most of a second forward. Streaming
// the weight once per call and multiplying every row against it while it is in registers keeps the products at the
// weight's memory time up to ~12 rows.
//
// Three ISA levels in one build, chosen at run time (spd.targets.panel): AVX-512 (16 lanes), AVX2 + FMA (8 lanes)
// and a portable one (8 lanes of plain multiplies and adds, any x86-64 or other CPU). Each gives a row the same bits
// whatever the row count (panel_kernel.h says why that holds by construction); the levels differ from each other in
// their bits, so a process multiplies every product at one level (the premise of exact drafted decoding; checked
// at load by spd.targets.panel, on every level the CPU runs by tests/test_panel.py).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "panel_api.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PANEL_X86 1
#endif

constexpr int NP = 2;             // panels per tile
constexpr int64_t KB = 64;        // inputs per block
constexpr int64_t PREFETCH = 32;  // panel lines ahead

#if PANEL_X86
namespace avx512 {
#define PANEL_TARGET __attribute__((target("avx512f,avx512bw,fma")))
#define IDOT(s, a, b) _mm512_add_epi32(s, _mm512_madd_epi16(a, b))
#define PANEL_BYTE_DOTS 0
#include "level_avx512.h"
}  // namespace avx512

namespace avx512vnni {
// the AVX-512 level where the CPU has VNNI: its blocks' dot products one instruction each, the same integers
#define PANEL_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni,fma")))
#define IDOT(s, a, b) _mm512_dpwssd_epi32(s, a, b)
#define PANEL_BYTE_DOTS 1
#define IBDOT(s, u, v) _mm512_dpbusd_epi32(s, u, v)
#include "level_avx512.h"
}  // namespace avx512vnni

namespace avx2 {
#define PANEL_TARGET __attribute__((target("avx2,fma,f16c")))
PANEL_TARGET static inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));   // lanes i + (i + 4)
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));                                           // + (i + 2)
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));                     // + (i + 1)
}
constexpr int LANES = 8;
constexpr int MT = 6;             // 2 x 6 + 2 + 1 of 16
constexpr int QMT = 3;            // 2 x 3 outputs, 2 x 3 sums, 4 codes, 1 broadcast
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSET1(s) _mm256_set1_ps(s)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VHALF(p) _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VSUB(a, b) _mm256_sub_ps(a, b)
#define VDIV(a, b) _mm256_div_ps(a, b)
#define VMAX(a, b) _mm256_max_ps(a, b)
#define VMIN(a, b) _mm256_min_ps(a, b)
#define VHSUM(v) hsum8(v)
PANEL_TARGET static inline void hsums(const __m256* a, float* out) {
  // out[i] = hsum8(a[i]) for 8 vectors, bit for bit: its tree (i + (i + 4), + (i + 2), + (i + 1)) on four vectors'
  // halves at once, the sums then put back in order
  __m256 w[4], z[2];
  for (int j = 0; j < 4; ++j)            // w[j]: lanes 0..3 vector 2j's i + (i + 4), lanes 4..7 vector 2j + 1's
    w[j] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * j], a[2 * j + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * j], a[2 * j + 1], 0x31));
  for (int k = 0; k < 2; ++k)            // z[k]: half h lanes 0, 1 vector 4k + h's + (i + 2), lanes 2, 3 4k + 2 + h's
    z[k] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 f = _mm256_add_ps(_mm256_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));   // lane 4h + e: vector 2e + h
  _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#define PANEL_INT_SIMD 1
#define PANEL_BYTE_DOTS 0
typedef __m256i ivec;
#define ILOAD(p) _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
#define ISET1(i) _mm256_set1_epi32(i)
#define IAND(a, b) _mm256_and_si256(a, b)
#define ISRLI(a, n) _mm256_srli_epi32(a, n)
#define ISLL16(a, n) _mm256_slli_epi16(a, n)
#define ISRA16(a, n) _mm256_srai_epi16(a, n)
#define IDOT(s, a, b) _mm256_add_epi32(s, _mm256_madd_epi16(a, b))
#define ICVT(a) _mm256_cvtepi32_ps(a)
#define VPOW2(t) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_castps_si256(t), \
    _mm256_set1_epi32(0x4B400000 - 127)), 23))
#include "panel_kernel.h"
}  // namespace avx2
#endif

namespace portable {
// no target attribute: the build's baseline (SSE2 on x86-64); a multiply and then an add, never fused
// (-ffp-contract=off), so any CPU computes the same bits
#define PANEL_TARGET
constexpr int LANES = 8;
constexpr int MT = 4;
constexpr int QMT = 4;
#define PANEL_INT_SIMD 0
#define PANEL_BYTE_DOTS 0
typedef float vec __attribute__((vector_size(LANES * 4)));
typedef int32_t ivec __attribute__((vector_size(LANES * 4)));
typedef uint32_t uvec __attribute__((vector_size(LANES * 4)));
#define VZERO() ((vec){})
#define VLOAD(p) ({ vec v_; __builtin_memcpy(&v_, (p), sizeof(vec)); v_; })
#define VSET1(s) ((vec){} + (s))
#define VFMA(a, b, c) ((a) * (b) + (c))
#define VMUL(a, b) ((a) * (b))
#define VADD(a, b) ((a) + (b))
#define VHALF(p) half_lanes(reinterpret_cast<const uint16_t*>(p))
#define VSTORE(p, v) ({ vec v_ = (v); __builtin_memcpy((p), &v_, sizeof(vec)); })
#define VSUB(a, b) ((a) - (b))
#define VDIV(a, b) ((a) / (b))
#define VMAX(a, b) ({ vec a_ = (a), b_ = (b); a_ > b_ ? a_ : b_; })
#define VMIN(a, b) ({ vec a_ = (a), b_ = (b); a_ < b_ ? a_ : b_; })
#define VHSUM(v) hsum_tree(v)
#define VPOW2(t) ({ vec t_ = (t); uvec u_; __builtin_memcpy(&u_, &t_, sizeof(vec)); \
    u_ = (u_ - (0x4B400000u - 127u)) << 23; vec p_; __builtin_memcpy(&p_, &u_, sizeof(vec)); p_; })
static inline float half_to_float(uint16_t h) {
  // IEEE half -> float, exactly (every half is a float): subnormals, infinities and NaNs included
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) bits = sign | 0x7F800000u | (man << 13);
  else if (exp != 0) bits = sign | ((exp + 112) << 23) | (man << 13);
  else if (man == 0) bits = sign;
  else {                                     // subnormal: normalise
    int e = -1;
    uint32_t m = man;
    do { m <<= 1; ++e; } while (!(m & 0x400));
    bits = sign | uint32_t(112 - e) << 23 | ((m & 0x3FF) << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}
static inline float hsum_tree(vec v) {
  // the lanes summed pairwise: i + (i + 4), then + (i + 2), then + (i + 1), as the AVX2 level's tree
  float a[LANES];
  __builtin_memcpy(a, &v, sizeof(vec));
  for (int w = LANES / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) a[i] += a[i + w];
  return a[0];
}
static inline void hsums(const vec* a, float* out) {
  for (int i = 0; i < LANES; ++i) out[i] = hsum_tree(a[i]);
}
static inline vec half_lanes(const uint16_t* p) {
  vec v;
  for (int l = 0; l < LANES; ++l) v[l] = half_to_float(p[l]);
  return v;
}
#include "panel_kernel.h"
}  // namespace portable

enum Level : int64_t { PORTABLE = 0, AVX2 = 1, AVX512 = 2 };   // spd.targets.panel.LEVELS' indices

static bool& vnni_wanted() {
  // whether the AVX-512 level takes VNNI's dot products where the CPU has them (a test turns it off to compare)
  static bool on = true;
  return on;
}

static bool vnni_on() {
#if PANEL_X86
  static const bool has = (__builtin_cpu_init(), __builtin_cpu_supports("avx512vnni"));
  return has && vnni_wanted();
#else
  return false;
#endif
}

bool use_vnni(bool on) {
  // the AVX-512 level's 16-bit dot products by VNNI (where the CPU has it) or not; returns whether it was on
  const bool was = vnni_wanted();
  vnni_wanted() = on;
  return was;
}

static void byte_words(const int16_t* q, int64_t M, int64_t K, int32_t* b4, int32_t* b8) {
  // QRows' b4 and b8: each code's low and high byte in the order of the weights' bytes (spd/csrc/panel_kernel.h:
  // a 4-bit word's masked nibbles are inputs 8u, 8u + 4, 8u + 1, 8u + 5 and, shifted, 8u + 2, 8u + 6, 8u + 3,
  // 8u + 7; an 8-bit word's bytes 4c, 4c + 2, 4c + 1, 4c + 3)
  static const int A[4] = {0, 4, 1, 5}, Bo[4] = {2, 6, 3, 7}, C[4] = {0, 2, 1, 3};
  const int64_t B = K / 32;
  auto word = [](const int16_t* c, const int* order, bool high) {
    uint32_t w = 0;
    for (int k = 0; k < 4; ++k) {
      const int v = c[order[k]];
      w |= uint32_t(uint8_t(high ? v >> 8 : v & 0xFF)) << (8 * k);
    }
    return int32_t(w);
  };
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < B; ++b) {
      const int16_t* c = q + m * K + b * 32;
      int32_t* w4 = b4 + (m * B + b) * QRows::BYTE_WORDS;
      int32_t* w8 = b8 + (m * B + b) * QRows::BYTE_WORDS;
      int32_t high = 0;
      for (int t = 0; t < 32; ++t) high += c[t] >> 8;
      for (int u = 0; u < 4; ++u) {
        w4[4 * u] = word(c + 8 * u, A, false);
        w4[4 * u + 1] = word(c + 8 * u, A, true);
        w4[4 * u + 2] = word(c + 8 * u, Bo, false);
        w4[4 * u + 3] = word(c + 8 * u, Bo, true);
      }
      for (int k = 0; k < 8; ++k) {
        w8[2 * k] = word(c + 4 * k, C, false);
        w8[2 * k + 1] = word(c + 4 * k, C, true);
      }
      w4[16] = w4[17] = w8[17] = 0;
      w8[16] = 128 * high;
    }
}

static void quantize_rows(const float* x, int64_t M, int64_t K, int16_t* q, float* dx, float* sx) {
  // each row's blocks of 32 inputs as 16-bit codes (QRows): the same plain loop on every level, a row alone
  const int64_t B = K / 32;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < B; ++b) {
      const float* xb = x + m * K + b * 32;
      int16_t* qb = q + m * K + b * 32;
      float amax = 0.0f;
      for (int t = 0; t < 32; ++t) amax = std::max(amax, std::fabs(xb[t]));
      const float d = amax / 32767.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      int32_t sum = 0;
      for (int t = 0; t < 32; ++t) {
        float v = xb[t] * id;
        v = v != v ? 0.0f : v > 32767.0f ? 32767.0f : v < -32767.0f ? -32767.0f : v;
        v = (v + 12582912.0f) - 12582912.0f;          // to the nearest integer, ties to even (1.5 * 2^23)
        qb[t] = static_cast<int16_t>(v);
        sum += qb[t];
      }
      dx[m * B + b] = d;
      sx[m * B + b] = d * static_cast<float>(sum);
    }
}

static int lanes_of(int64_t level) { return level == AVX512 ? 16 : 8; }

std::vector<std::string> levels() {
  // the levels this CPU executes, lowest first
  std::vector<std::string> out{"portable"};
#if PANEL_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    out.push_back("avx2");
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) out.push_back("avx512");
#endif
  return out;
}

torch::Tensor pack(const torch::Tensor& weight, int64_t level) {
  // weight [N, K] -> panels [ceil(N / LANES), K, LANES], zero-padded
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32, "pack: a 2-D float32 weight");
  const int64_t lanes = lanes_of(level);
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + lanes - 1) / lanes;
  auto padded = torch::zeros({P * lanes, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, lanes, K}).permute({0, 2, 1}).contiguous();
}

std::vector<torch::Tensor> multiply_many_at(const torch::Tensor& x, const std::vector<torch::Tensor>& panels,
                                            const std::vector<int64_t>& n_out,
                                            const std::vector<c10::optional<torch::Tensor>>& biases,
                                            const std::vector<int64_t>& formats, int64_t level) {
  // x [..., K] -> one [..., N_j] per product j; panels in formats[j] (0: float32, 1: 4-bit blocks, 2: 8-bit blocks;
  // panel_kernel.h)
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "float32 rows only");
  const size_t count = panels.size();
  TORCH_CHECK(n_out.size() == count && biases.size() == count && formats.size() == count, "one N, bias, format each");
  auto x2 = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t lanes = lanes_of(level), M = x2.size(0), K = x2.size(1);
  const float* xp = x2.data_ptr<float>();
  std::vector<torch::Tensor> ys;
  std::vector<PanelProduct> products;
  bool blocks = false;
  for (size_t j = 0; j < count; ++j) {
    const int64_t P = panels[j].size(0), N = n_out[j];
    TORCH_CHECK(P * lanes >= N && N > (P - 1) * lanes, "panels do not hold N outputs");
    ys.push_back(torch::empty({M, N}, x2.options()));
    products.push_back({formats[j], static_cast<const uint8_t*>(panels[j].data_ptr()), P, N, ys.back().data_ptr<float>()});
    blocks = blocks || formats[j] != 0;
  }
  // a quantized product's rows as codes and scales, once for all of its products (spd/csrc/panel_api.h: QRows)
  std::vector<int16_t> codes;
  std::vector<float> scales;
  std::vector<int32_t> bytes;
  QRows q{nullptr, nullptr, nullptr, nullptr, nullptr};
  if (blocks) {
    TORCH_CHECK(K % 32 == 0, "blocks of 32 inputs");
    codes.resize(M * K);
    scales.resize(2 * M * (K / 32));
    quantize_rows(xp, M, K, codes.data(), scales.data(), scales.data() + M * (K / 32));
    q = {codes.data(), scales.data(), scales.data() + M * (K / 32), nullptr, nullptr};
    if (level == AVX512 && vnni_on()) {
      bytes.resize(2 * M * (K / 32) * QRows::BYTE_WORDS);
      byte_words(codes.data(), M, K, bytes.data(), bytes.data() + M * (K / 32) * QRows::BYTE_WORDS);
      q.b4 = bytes.data();
      q.b8 = bytes.data() + M * (K / 32) * QRows::BYTE_WORDS;
    }
  }
  if (M > 0) {
    switch (level) {
#if PANEL_X86
      case AVX512:
        if (vnni_on()) avx512vnni::multiply_many(products.data(), count, xp, q, M, K);
        else avx512::multiply_many(products.data(), count, xp, q, M, K);
        break;
      case AVX2: avx2::multiply_many(products.data(), count, xp, q, M, K); break;
#endif
      case PORTABLE: portable::multiply_many(products.data(), count, xp, q, M, K); break;
      default: TORCH_CHECK(false, "no such level in this build: ", level);
    }
  }
  auto shape = x.sizes().vec();
  for (size_t j = 0; j < count; ++j) {
    if (biases[j].has_value()) ys[j].add_(*biases[j]);
    shape.back() = n_out[j];
    ys[j] = ys[j].view(shape);
  }
  return ys;
}

torch::Tensor multiply_at(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                          const c10::optional<torch::Tensor>& bias, int64_t level, int64_t format) {
  // x [..., K] -> [..., N]: one product
  return multiply_many_at(x, {panels}, {N}, {bias}, {format}, level)[0];
}

void attend_at(const RowAttention& a, int64_t level) {
  switch (level) {
#if PANEL_X86
    case AVX512: avx512::attend(a); break;
    case AVX2: avx2::attend(a); break;
#endif
    case PORTABLE: portable::attend(a); break;
    default: TORCH_CHECK(false, "no such level in this build: ", level);
  }
}

void silu_mul_at(float* gate, const float* up, int64_t n, int64_t level) {
  switch (level) {
#if PANEL_X86
    case AVX512: avx512::silu_mul(gate, up, n); break;
    case AVX2: avx2::silu_mul(gate, up, n); break;
#endif
    case PORTABLE: portable::silu_mul(gate, up, n); break;
    default: TORCH_CHECK(false, "no such level in this build: ", level);
  }
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                     const c10::optional<torch::Tensor>& bias, int64_t level) {
  // x [..., K] times float32 panels [P, K, LANES] -> [..., N]
  TORCH_CHECK(panels.scalar_type() == torch::kFloat32 && panels.is_contiguous(), "float32 panels");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == lanes_of(level) && panels.size(1) == x.size(-1),
              "panels do not fit x");
  return multiply_at(x, panels, N, bias, level, 0);
}

torch::Tensor linear_blocks(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                            const c10::optional<torch::Tensor>& bias, int64_t level, int64_t bits) {
  // x [..., K] times quantized panels [P, K / 32, bytes a block] (bits 4 or 8) -> [..., N]
  TORCH_CHECK(bits == 4 || bits == 8, "4- or 8-bit blocks");
  TORCH_CHECK(panels.scalar_type() == torch::kUInt8 && panels.is_contiguous() && panels.dim() == 3, "byte panels");
  const int64_t K = x.size(-1);
  TORCH_CHECK(K % 32 == 0 && panels.size(1) == K / 32 &&
              panels.size(2) == (bits == 4 ? 20 : 34) * lanes_of(level), "panels do not fit x");
  return multiply_at(x, panels, N, bias, level, bits == 4 ? 1 : 2);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("levels", &levels);
  m.def("use_vnni", &use_vnni);
  m.def("pack", &pack);
  m.def("linear", &linear);
  m.def("linear_blocks", &linear_blocks);
  m.def("llama_before_attention", &llama_before_attention);       // spd/csrc/llama_layer.cpp
  m.def("llama_after_attention", &llama_after_attention);
  m.def("own_before_attention", &own_before_attention);
  m.def("own_attention", &own_attention);
  m.def("own_after_attention", &own_after_attention);
  pybind11::class_<OwnLayer>(m, "OwnLayer")
      .def(pybind11::init<torch::Tensor, double, std::vector<torch::Tensor>, std::vector<int64_t>,
                          std::vector<c10::optional<torch::Tensor>>, std::vector<int64_t>, torch::Tensor, double,
                          std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<c10::optional<torch::Tensor>>,
                          std::vector<int64_t>, int64_t, int64_t, double>())
      .def("forward", &OwnLayer::forward);
  m.def("own_layers", &own_layers);
}

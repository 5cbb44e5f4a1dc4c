// One ISA level's panel products; spd/csrc/panel_linear.cpp includes this file once per level, inside that level's
// namespace, after defining (this file undefines the macros again at its end):
//   PANEL_TARGET   the function attribute that lets the compiler use the level's instructions here only
//   LANES, MT      output features a panel holds (one vector) and rows a full tile multiplies
//   vec, VZERO(), VLOAD(p), VSET1(s), VFMA(a, b, c) (a * b + c), VMUL, VADD, VSTORE(p, v)
//   VNIB(p, s)     LANES 32-bit words at p, each shifted right by s and masked to its low 4 bits, as floats
//   VI8(p)         LANES signed bytes at p as floats
//   VHALF(p)       LANES IEEE halves at p as floats (exact: every half is a float)
//
// Why the order is fixed by this code and not by the compiler: the translation unit is built with
// -ffp-contract=off and without -march=native, so a multiply-add is fused exactly where VFMA says (an intrinsic on
// the vector levels, never on the portable one) and nowhere else. GCC's tuning for some CPUs (Zen's
// "avoid FMA chains") otherwise fuses some multiply-adds and not others depending on the loop around them — which
// differs with the tile's row count, and so gave a row other bits at other row counts on an AVX2-only EPYC.
//
// Every output element is then the same sequence of operations whatever the row count: blocks of KB inputs in
// order, each summed in order by VFMA into a fresh accumulator, the blocks added in order (scalar adds).
//
// The weights come in three formats (the Weights structs below), read the same way: a group of inputs at a time,
// one vector of LANES weights per input. A quantized weight is expanded to float32 as GGUF's reference dequantizer
// does it — q * d, then + m, each rounded — so a 4-bit panel gives the bits the float32 panel of the dequantized
// weight gives, while a one-row product reads ~5 bits a weight instead of 32.

struct F32 {
  // panels [P, K, LANES] float32
  static constexpr int64_t GROUP = KB;
  struct group { const float* w; };
  static int64_t stride(int64_t K) { return K * LANES * 4; }                      // bytes a panel
  PANEL_TARGET static inline group at(const uint8_t* panel, int64_t k) {
    return {reinterpret_cast<const float*>(panel) + k * LANES};
  }
  PANEL_TARGET static inline vec weight(const group& g, int64_t t) { return VLOAD(g.w + t * LANES); }
  PANEL_TARGET static inline const void* ahead(const group& g, int64_t t) { return g.w + (t + PREFETCH) * LANES; }
};

struct Q4 {
  // panels [P, K / 32, 20 * LANES] bytes: per block of 32 inputs, d [LANES] and m [LANES] as the file's halves, then
  // 4 rows of LANES 32-bit words; word u of a feature holds inputs 8u .. 8u + 7 of the block, input 8u + j in bits
  // 4j .. 4j + 3 (one load serves 8 inputs, each a shift, a mask and a conversion; GGUF's Q4_1: w = q * d + m).
  // A one-row product is bound by memory here: halves, not floats, for d and m read 5 bits a weight, not 6.
  static constexpr int64_t GROUP = 32;
  static constexpr bool SHIFTED = true;           // a block's sum carries m * (its inputs' sum)
  struct group { vec d, m; const uint32_t* q; };
  static int64_t stride(int64_t K) { return K / 32 * 20 * LANES; }
  PANEL_TARGET static inline group at(const uint8_t* panel, int64_t k) {
    const uint8_t* block = panel + k / 32 * 20 * LANES;
    return {VHALF(block), VHALF(block + 2 * LANES), reinterpret_cast<const uint32_t*>(block + 4 * LANES)};
  }
  PANEL_TARGET static inline vec q(const group& g, int64_t t) { return VNIB(g.q + (t >> 3) * LANES, (t & 7) * 4); }
  PANEL_TARGET static inline vec block(const group& g, vec acc, float sum) {
    return VFMA(g.m, VSET1(sum), VMUL(g.d, acc));                 // d * sum(q x) + m * sum(x)
  }
  PANEL_TARGET static inline const void* ahead(const group& g, int64_t t) { return g.q + (t / 8 + 16) * LANES; }
};

struct Q8 {
  // panels [P, K / 32, 34 * LANES] bytes: per block of 32 inputs, d [LANES] halves, then 32 rows of LANES signed
  // bytes (GGUF's Q8_0: w = q * d)
  static constexpr int64_t GROUP = 32;
  static constexpr bool SHIFTED = false;
  struct group { vec d; const int8_t* q; };
  static int64_t stride(int64_t K) { return K / 32 * 34 * LANES; }
  PANEL_TARGET static inline group at(const uint8_t* panel, int64_t k) {
    const uint8_t* block = panel + k / 32 * 34 * LANES;
    return {VHALF(block), reinterpret_cast<const int8_t*>(block + 2 * LANES)};
  }
  PANEL_TARGET static inline vec q(const group& g, int64_t t) { return VI8(g.q + t * LANES); }
  PANEL_TARGET static inline vec block(const group& g, vec acc, float) { return VMUL(g.d, acc); }
  PANEL_TARGET static inline const void* ahead(const group& g, int64_t t) { return g.q + (t + 128) * LANES; }
};

template <class W, int P, int R>
PANEL_TARGET static inline void tile(const float* __restrict x, int64_t K, const uint8_t* __restrict panel,
                                     float* __restrict y, int64_t N, int64_t n0) {
  // R rows of x [R, K] against P panels -> y[:R, n0 : n0 + P * LANES] (clipped at N)
  const int64_t stride = W::stride(K);
  float out[P][R][LANES];
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    const int64_t k1 = std::min(K, k0 + KB);
    vec acc[P][R];
    for (int i = 0; i < P; ++i)
      for (int j = 0; j < R; ++j) acc[i][j] = VZERO();
    for (int64_t g0 = k0; g0 < k1; g0 += W::GROUP) {
      typename W::group g[P];
      for (int i = 0; i < P; ++i) g[i] = W::at(panel + i * stride, g0);
      // a quantized group is always whole (K is a multiple of 32): a fixed count the compiler unrolls, so each
      // input's shift is a constant
      const int64_t width = W::GROUP == 32 ? 32 : std::min(k1 - g0, W::GROUP);
#pragma GCC unroll 32
      for (int64_t t = 0; t < width; ++t) {
        vec w[P];
        for (int i = 0; i < P; ++i) w[i] = W::weight(g[i], t);
        // the hardware prefetcher alone leaves several rows' products waiting on memory (-10..20% at 4..16 rows)
        for (int i = 0; i < P; ++i) __builtin_prefetch(W::ahead(g[i], t));
        for (int j = 0; j < R; ++j) {
          const vec xs = VSET1(x[j * K + g0 + t]);
          for (int i = 0; i < P; ++i) acc[i][j] = VFMA(w[i], xs, acc[i][j]);
        }
      }
    }
    for (int i = 0; i < P; ++i)
      for (int j = 0; j < R; ++j) {
        float block[LANES];
        VSTORE(block, acc[i][j]);
        for (int l = 0; l < LANES; ++l) out[i][j][l] = k0 == 0 ? block[l] : out[i][j][l] + block[l];
      }
  }
  for (int i = 0; i < P; ++i) {
    const int64_t n = n0 + i * LANES, width = std::min<int64_t>(LANES, N - n);
    for (int j = 0; j < R && width > 0; ++j) std::copy(out[i][j], out[i][j] + width, y + j * N + n);
  }
}

template <class W, int P, int R>
PANEL_TARGET static inline void qtile(const float* __restrict x, const float* __restrict sums, int64_t K,
                                      const uint8_t* __restrict panel, float* __restrict y, int64_t N, int64_t n0) {
  // R rows of x [R, K] (sums [R, K / 32]: each block's inputs summed in order) against P panels of GGUF blocks:
  // per block, its integer codes times the inputs in order into a fresh accumulator, then d * that (+ m * the
  // inputs' sum), added to the output in block order. One multiply-add a weight and row, the block's scales once.
  const int64_t stride = W::stride(K), B = K / 32;
  vec out[P][R];
  for (int i = 0; i < P; ++i)
    for (int j = 0; j < R; ++j) out[i][j] = VZERO();
  for (int64_t b = 0; b < B; ++b) {
    typename W::group g[P];
    for (int i = 0; i < P; ++i) g[i] = W::at(panel + i * stride, b * 32);
    vec acc[P][R];
    for (int i = 0; i < P; ++i)
      for (int j = 0; j < R; ++j) acc[i][j] = VZERO();
#pragma GCC unroll 32
    for (int64_t t = 0; t < 32; ++t) {
      vec w[P];
      for (int i = 0; i < P; ++i) w[i] = W::q(g[i], t);
      for (int i = 0; i < P; ++i) __builtin_prefetch(W::ahead(g[i], t));
      for (int j = 0; j < R; ++j) {
        const vec xs = VSET1(x[j * K + b * 32 + t]);
        for (int i = 0; i < P; ++i) acc[i][j] = VFMA(w[i], xs, acc[i][j]);
      }
    }
    for (int i = 0; i < P; ++i)
      for (int j = 0; j < R; ++j) out[i][j] = VADD(out[i][j], W::block(g[i], acc[i][j], sums[j * B + b]));
  }
  for (int i = 0; i < P; ++i) {
    const int64_t n = n0 + i * LANES, width = std::min<int64_t>(LANES, N - n);
    for (int j = 0; j < R && width > 0; ++j) {
      float row[LANES];
      VSTORE(row, out[i][j]);
      std::copy(row, row + width, y + j * N + n);
    }
  }
}

template <class W, int P, int R>
PANEL_TARGET static inline void any_tile(const float* x, const float* sums, int64_t K, const uint8_t* panel, float* y,
                                         int64_t N, int64_t n0) {
  if constexpr (std::is_same_v<W, F32>) tile<W, P, R>(x, K, panel, y, N, n0);
  else qtile<W, P, R>(x, sums, K, panel, y, N, n0);
}

template <class W, int P, int R>
PANEL_TARGET static inline void remainder(int64_t r, const float* x, const float* sums, int64_t K,
                                          const uint8_t* panel, float* y, int64_t N, int64_t n0) {
  // the r < MT rows left after the full tiles, as one tile of exactly r rows
  if constexpr (R < MT) {
    if (r == R) any_tile<W, P, R>(x, sums, K, panel, y, N, n0);
    else remainder<W, P, R + 1>(r, x, sums, K, panel, y, N, n0);
  }
}

template <class W, int P>
PANEL_TARGET static void rows(const float* x, const float* sums, int64_t M, int64_t K, const uint8_t* panel, float* y,
                              int64_t N, int64_t n0) {
  const int64_t B = K / 32;
  int64_t m = 0;
  for (; m + MT <= M; m += MT) any_tile<W, P, MT>(x + m * K, sums + m * B, K, panel, y + m * N, N, n0);
  if (m < M) remainder<W, P, 1>(M - m, x + m * K, sums + m * B, K, panel, y + m * N, N, n0);
}

template <class W>
PANEL_TARGET static void panel_tile(const float* x, const float* sums, int64_t M, int64_t K, const uint8_t* panels,
                                    int64_t P, float* y, int64_t N, int64_t t) {
  // tile t of a product: its NP panels (fewer at the end) against every row
  const int64_t p = t * NP, stride = W::stride(K);
  if (p + NP <= P) rows<W, NP>(x, sums, M, K, panels + p * stride, y, N, p * LANES);
  else rows<W, 1>(x, sums, M, K, panels + p * stride, y, N, p * LANES);
}

PANEL_TARGET static void format_tile(int64_t format, const float* x, const float* sums, int64_t M, int64_t K,
                                     const uint8_t* panels, int64_t P, float* y, int64_t N, int64_t t) {
  switch (format) {
    case 0: panel_tile<F32>(x, sums, M, K, panels, P, y, N, t); break;
    case 1: panel_tile<Q4>(x, sums, M, K, panels, P, y, N, t); break;
    default: panel_tile<Q8>(x, sums, M, K, panels, P, y, N, t); break;
  }
}

PANEL_TARGET static void multiply_many(const PanelProduct* products, int64_t count, const float* x, const float* sums,
                                       int64_t M, int64_t K) {
  // several products of the same rows in one parallel region: the tiles of all of them, the threads sharing them
  std::vector<int64_t> first(count + 1, 0);
  for (int64_t j = 0; j < count; ++j) first[j + 1] = first[j] + (products[j].P + NP - 1) / NP;
  at::parallel_for(0, first[count], 1, [&](int64_t lo, int64_t hi) {
    int64_t j = 0;
    for (int64_t t = lo; t < hi; ++t) {
      while (t >= first[j + 1]) ++j;
      const PanelProduct& p = products[j];
      format_tile(p.format, x, sums, M, K, p.panels, p.P, p.y, p.N, t - first[j]);
    }
  });
}

#include "row_ops.h"

#undef PANEL_TARGET
#undef VZERO
#undef VLOAD
#undef VSET1
#undef VFMA
#undef VMUL
#undef VADD
#undef VNIB
#undef VI8
#undef VHALF
#undef VSTORE
#undef VSUB
#undef VDIV
#undef VMAX
#undef VMIN
#undef VPOW2
#undef VHSUM

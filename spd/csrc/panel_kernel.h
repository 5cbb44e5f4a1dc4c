// One ISA level's panel products; spd/csrc/panel_linear.cpp includes this file once per level, inside that level's
// namespace, after defining (this file undefines the macros again at its end):
//   PANEL_TARGET   the function attribute that lets the compiler use the level's instructions here only
//   LANES, MT, QMT output features a panel holds (one vector), rows a full float32 tile and a full block tile multiply
//   vec, VZERO(), VLOAD(p), VSET1(s), VFMA(a, b, c) (a * b + c), VMUL, VADD, VSTORE(p, v)
//   VHALF(p)       LANES IEEE halves at p as floats (exact: every half is a float)
//   PANEL_INT_SIMD 1 where the level has 16-bit dot products, with ivec and ILOAD(p) (LANES 32-bit words),
//                  ISET1(i), IAND, ISRLI(a, n) (each word shifted right), ISLL16 / ISRA16 (each 16-bit half shifted
//                  left / right arithmetically), IDOT(s, a, b) (s + a's and b's 16-bit halves multiplied in pairs and
//                  summed to 32 bits), ICVT (to float)
//
// Why the order is fixed by this code and not by the compiler: the translation unit is built with
// -ffp-contract=off and without -march=native, so a multiply-add is fused exactly where VFMA says (an intrinsic on
// the vector levels, never on the portable one) and nowhere else. GCC's tuning for some CPUs (Zen's
// "avoid FMA chains") otherwise fuses some multiply-adds and not others depending on the loop around them — which
// differs with the tile's row count, and so gave a row other bits at other row counts on an AVX2-only EPYC.
//
// Every output element is then the same sequence of operations whatever the row count. Float32 panels: blocks of KB
// inputs in order, each summed in order by VFMA into a fresh accumulator, the blocks added in order (scalar adds).
// A GGUF's blocks (Q4_1, Q8_0) multiply rows quantized to 16-bit codes and a scale per block of 32 inputs (QRows, a
// row alone): per block the codes' dot product, an exact integer whatever its order, then its scales in a
// written-out order, the blocks added in order. A one-row product reads ~5 bits a weight and multiplies pairs of
// 16-bit integers where float32 does one float multiply-add a weight; 16 bits keep an input to 1 / 65534 of its
// block's largest (llama.cpp's 8 bits: 1 / 254), so the logits stay the float32 target's up to ~1e-3.

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
  // 4 rows of LANES 32-bit words; nibble s of a feature's word u holds input 8u + 2s and nibble s of its upper half
  // input 8u + 2s + 1 (spd.targets.blocks.pack), so a shift and a mask give a pair of inputs' codes as the two 16-bit
  // halves a 16-bit dot product multiplies (GGUF's Q4_1: w = q * d + m)
  struct group { vec d, m; const uint32_t* q; };
  static int64_t stride(int64_t K) { return K / 32 * 20 * LANES; }
  PANEL_TARGET static inline group at(const uint8_t* panel, int64_t b) {
    const uint8_t* block = panel + b * 20 * LANES;
    return {VHALF(block), VHALF(block + 2 * LANES), reinterpret_cast<const uint32_t*>(block + 4 * LANES)};
  }
  PANEL_TARGET static inline vec block(const group& g, vec codes, float dx, float sx) {
    return VFMA(g.m, VSET1(sx), VMUL(VMUL(g.d, VSET1(dx)), codes));   // d dx sum(q qx) + m dx sum(qx)
  }
};

struct Q8 {
  // panels [P, K / 32, 34 * LANES] bytes: per block of 32 inputs, d [LANES] halves, then 8 rows of LANES 32-bit
  // words; a feature's word c holds its signed bytes 4c, 4c + 2, 4c + 1, 4c + 3, so that sign-extending each 16-bit
  // half's low byte gives the pair (4c, 4c + 1) and its high byte (4c + 2, 4c + 3) (GGUF's Q8_0: w = q * d)
  struct group { vec d; const uint32_t* q; };
  static int64_t stride(int64_t K) { return K / 32 * 34 * LANES; }
  PANEL_TARGET static inline group at(const uint8_t* panel, int64_t b) {
    const uint8_t* block = panel + b * 34 * LANES;
    return {VHALF(block), reinterpret_cast<const uint32_t*>(block + 2 * LANES)};
  }
  PANEL_TARGET static inline vec block(const group& g, vec codes, float dx, float) {
    return VMUL(VMUL(g.d, VSET1(dx)), codes);                              // d dx sum(q qx)
  }
};

static inline int32_t pair_at(const int16_t* p) {
  // two inputs' codes as the 32-bit word a 16-bit dot product broadcasts
  int32_t w;
  __builtin_memcpy(&w, p, 4);
  return w;
}

#if PANEL_BYTE_DOTS
// the same integer sums by byte dot products (AVX-512 VNNI): a code is 256 * its high byte + its low byte, each
// multiplied by the weights' bytes (QRows' b4, b8), the two sums added at the block's end
template <int P, int R>
PANEL_TARGET static inline void dots(const Q4::group* g, const QRows& xr, int64_t b, int64_t K, vec (*f)[R]) {
  // the codes 0..15 as signed bytes beside the low bytes, as unsigned beside the high ones
  const ivec low = ISET1(0x0F0F0F0F);
  const int64_t row = K / 32 * QRows::BYTE_WORDS;
  const int32_t* x = xr.b4 + b * QRows::BYTE_WORDS;
  ivec sl[P][R], sh[P][R];
  for (int i = 0; i < P; ++i)
    for (int j = 0; j < R; ++j) sl[i][j] = sh[i][j] = ISET1(0);
  for (int u = 0; u < 4; ++u) {
    ivec lo[P], hi[P];
    for (int i = 0; i < P; ++i) {
      const ivec w = ILOAD(g[i].q + u * LANES);
      lo[i] = IAND(w, low);                                              // inputs 8u, 8u + 4, 8u + 1, 8u + 5
      hi[i] = IAND(ISRLI(w, 4), low);                                    // 8u + 2, 8u + 6, 8u + 3, 8u + 7
    }
    for (int j = 0; j < R; ++j) {
      const int32_t* xw = x + j * row + 4 * u;
      const ivec la = ISET1(xw[0]), ha = ISET1(xw[1]), lb = ISET1(xw[2]), hb = ISET1(xw[3]);
      for (int i = 0; i < P; ++i) {
        sl[i][j] = IBDOT(IBDOT(sl[i][j], la, lo[i]), lb, hi[i]);
        sh[i][j] = IBDOT(IBDOT(sh[i][j], lo[i], ha), hi[i], hb);
      }
    }
  }
  for (int i = 0; i < P; ++i)
    for (int j = 0; j < R; ++j) f[i][j] = ICVT(_mm512_add_epi32(_mm512_slli_epi32(sh[i][j], 8), sl[i][j]));
}

template <int P, int R>
PANEL_TARGET static inline void dots(const Q8::group* g, const QRows& xr, int64_t b, int64_t K, vec (*f)[R]) {
  // signed weights beside the unsigned low bytes; beside the signed high bytes as w + 128 (unsigned), less
  // 128 * (the high bytes' sum), word 16 of the block's words
  const int64_t row = K / 32 * QRows::BYTE_WORDS;
  const int32_t* x = xr.b8 + b * QRows::BYTE_WORDS;
  const ivec flip = ISET1(int32_t(0x80808080u));
  ivec sl[P][R], sh[P][R];
  for (int i = 0; i < P; ++i)
    for (int j = 0; j < R; ++j) sl[i][j] = sh[i][j] = ISET1(0);
  for (int c = 0; c < 8; ++c) {
    ivec w[P], u[P];
    for (int i = 0; i < P; ++i) {
      w[i] = ILOAD(g[i].q + c * LANES);
      u[i] = _mm512_xor_si512(w[i], flip);
    }
    for (int j = 0; j < R; ++j) {
      const int32_t* xw = x + j * row + 2 * c;
      const ivec l = ISET1(xw[0]), h = ISET1(xw[1]);
      for (int i = 0; i < P; ++i) {
        sl[i][j] = IBDOT(sl[i][j], l, w[i]);
        sh[i][j] = IBDOT(sh[i][j], u[i], h);
      }
    }
  }
  for (int i = 0; i < P; ++i)
    for (int j = 0; j < R; ++j) {
      const ivec high = _mm512_sub_epi32(sh[i][j], ISET1(x[j * row + 16]));
      f[i][j] = ICVT(_mm512_add_epi32(_mm512_slli_epi32(high, 8), sl[i][j]));
    }
}
#elif PANEL_INT_SIMD
// a block's integer dot products, P panels by R rows (row j's codes x + j * K): sums of codes times codes, exact
// integers whatever their order (at most 32 * 128 * 32767 < 2^31)
template <int P, int R>
PANEL_TARGET static inline void dots(const Q4::group* g, const QRows& xr, int64_t b, int64_t K, vec (*f)[R]) {
  const int16_t* x = xr.q + b * 32;
  const ivec low = ISET1(0x000F000F);
  ivec s[P][R];
  for (int i = 0; i < P; ++i)
    for (int j = 0; j < R; ++j) s[i][j] = ISET1(0);
  for (int u = 0; u < 4; ++u) {
    ivec w[P];
    for (int i = 0; i < P; ++i) w[i] = ILOAD(g[i].q + u * LANES);
    for (int n = 0; n < 4; ++n) {
      ivec c[P];
      for (int i = 0; i < P; ++i) c[i] = IAND(n ? ISRLI(w[i], 4 * n) : w[i], low);     // inputs 8u + 2n, + 1
      for (int j = 0; j < R; ++j) {
        const ivec a = ISET1(pair_at(x + j * K + 8 * u + 2 * n));
        for (int i = 0; i < P; ++i) s[i][j] = IDOT(s[i][j], c[i], a);
      }
    }
  }
  for (int i = 0; i < P; ++i)
    for (int j = 0; j < R; ++j) f[i][j] = ICVT(s[i][j]);
}

template <int P, int R>
PANEL_TARGET static inline void dots(const Q8::group* g, const QRows& xr, int64_t b, int64_t K, vec (*f)[R]) {
  const int16_t* x = xr.q + b * 32;
  ivec s[P][R];
  for (int i = 0; i < P; ++i)
    for (int j = 0; j < R; ++j) s[i][j] = ISET1(0);
  for (int c = 0; c < 8; ++c) {
    ivec lo[P], hi[P];
    for (int i = 0; i < P; ++i) {
      const ivec w = ILOAD(g[i].q + c * LANES);
      lo[i] = ISRA16(ISLL16(w, 8), 8);                                   // inputs 4c, 4c + 1
      hi[i] = ISRA16(w, 8);                                              // inputs 4c + 2, 4c + 3
    }
    for (int j = 0; j < R; ++j) {
      const ivec a = ISET1(pair_at(x + j * K + 4 * c)), b = ISET1(pair_at(x + j * K + 4 * c + 2));
      for (int i = 0; i < P; ++i) s[i][j] = IDOT(IDOT(s[i][j], lo[i], a), hi[i], b);
    }
  }
  for (int i = 0; i < P; ++i)
    for (int j = 0; j < R; ++j) f[i][j] = ICVT(s[i][j]);
}
#else
template <class G, int P, int R>
static inline void dots(const G* g, const QRows& xr, int64_t b, int64_t K, vec (*f)[R]) {
  // the same integer sums, a lane at a time
  const int16_t* x = xr.q + b * 32;
  constexpr bool four = std::is_same_v<G, Q4::group>;
  for (int i = 0; i < P; ++i)
    for (int j = 0; j < R; ++j)
      for (int l = 0; l < LANES; ++l) {
        const int16_t* xr = x + j * K;
        int32_t s = 0;
        for (int u = 0; u < (four ? 4 : 8); ++u) {
          const uint32_t w = g[i].q[u * LANES + l];
          if (four) {
            for (int n = 0; n < 4; ++n)
              s += int32_t((w >> (4 * n)) & 15) * xr[8 * u + 2 * n] + int32_t((w >> (16 + 4 * n)) & 15) * xr[8 * u + 2 * n + 1];
          } else {
            s += int32_t(int8_t(w)) * xr[4 * u] + int32_t(int8_t(w >> 16)) * xr[4 * u + 1] +
                 int32_t(int8_t(w >> 8)) * xr[4 * u + 2] + int32_t(int8_t(w >> 24)) * xr[4 * u + 3];
          }
        }
        f[i][j][l] = static_cast<float>(s);
      }
}
#endif

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
      const int64_t width = std::min(k1 - g0, W::GROUP);
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
PANEL_TARGET static inline void qtile(const QRows& xr, int64_t K, const uint8_t* __restrict panel, float* __restrict y,
                                      int64_t N, int64_t n0) {
  // R rows of quantized inputs (QRows) against P panels of GGUF blocks: per block, the integer dot products of its
  // codes and the rows' codes, then d dx times that (+ m times the block's sx), added to the output in block order
  const int64_t stride = W::stride(K), B = K / 32;
  vec out[P][R];
  for (int i = 0; i < P; ++i)
    for (int j = 0; j < R; ++j) out[i][j] = VZERO();
  for (int64_t b = 0; b < B; ++b) {
    typename W::group g[P];
    for (int i = 0; i < P; ++i) {
      g[i] = W::at(panel + i * stride, b);
      __builtin_prefetch(reinterpret_cast<const uint8_t*>(g[i].q) + 4 * stride / B);    // 4 blocks ahead
    }
    vec f[P][R];
#if PANEL_INT_SIMD
    dots<P, R>(g, xr, b, K, f);
#else
    dots<typename W::group, P, R>(g, xr, b, K, f);
#endif
    for (int i = 0; i < P; ++i)
      for (int j = 0; j < R; ++j)
        out[i][j] = VADD(out[i][j], W::block(g[i], f[i][j], xr.dx[j * B + b], xr.sx[j * B + b]));
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
PANEL_TARGET static inline void any_tile(const float* x, const QRows& q, int64_t K, const uint8_t* panel, float* y,
                                         int64_t N, int64_t n0) {
  if constexpr (std::is_same_v<W, F32>) tile<W, P, R>(x, K, panel, y, N, n0);
  else qtile<W, P, R>(q, K, panel, y, N, n0);
}

template <class W, int P, int R>
PANEL_TARGET static inline void remainder(int64_t r, const float* x, const QRows& q, int64_t K,
                                          const uint8_t* panel, float* y, int64_t N, int64_t n0) {
  // the r rows left after the full tiles, as one tile of exactly r rows
  constexpr int most = std::is_same_v<W, F32> ? MT : QMT;
  if constexpr (R < most) {
    if (r == R) any_tile<W, P, R>(x, q, K, panel, y, N, n0);
    else remainder<W, P, R + 1>(r, x, q, K, panel, y, N, n0);
  }
}

template <class W, int P>
PANEL_TARGET static void rows(const float* x, const QRows& q, int64_t M, int64_t K, const uint8_t* panel, float* y,
                              int64_t N, int64_t n0) {
  // full tiles of MT rows (QMT for blocks), then the rest
  constexpr int most = std::is_same_v<W, F32> ? MT : QMT;
  int64_t m = 0;
  for (; m + most <= M; m += most)
    any_tile<W, P, most>(x + m * K, q.from(m, K), K, panel, y + m * N, N, n0);
  if (m < M) remainder<W, P, 1>(M - m, x + m * K, q.from(m, K), K, panel, y + m * N, N, n0);
}

template <class W>
PANEL_TARGET static void panel_tile(const float* x, const QRows& q, int64_t M, int64_t K, const uint8_t* panels,
                                    int64_t P, float* y, int64_t N, int64_t t) {
  // tile t of a product: its NP panels (fewer at the end) against every row
  const int64_t p = t * NP, stride = W::stride(K);
  if (p + NP <= P) rows<W, NP>(x, q, M, K, panels + p * stride, y, N, p * LANES);
  else rows<W, 1>(x, q, M, K, panels + p * stride, y, N, p * LANES);
}

PANEL_TARGET static void format_tile(int64_t format, const float* x, const QRows& q, int64_t M, int64_t K,
                                     const uint8_t* panels, int64_t P, float* y, int64_t N, int64_t t) {
  switch (format) {
    case 0: panel_tile<F32>(x, q, M, K, panels, P, y, N, t); break;
    case 1: panel_tile<Q4>(x, q, M, K, panels, P, y, N, t); break;
    default: panel_tile<Q8>(x, q, M, K, panels, P, y, N, t); break;
  }
}

PANEL_TARGET static void multiply_many(const PanelProduct* products, int64_t count, const float* x, const QRows& q,
                                       int64_t M, int64_t K) {
  // several products of the same rows in one parallel region: the tiles of all of them, the threads sharing them
  std::vector<int64_t> first(count + 1, 0);
  for (int64_t j = 0; j < count; ++j) first[j + 1] = first[j] + (products[j].P + NP - 1) / NP;
  at::parallel_for(0, first[count], 1, [&](int64_t lo, int64_t hi) {
    int64_t j = 0;
    for (int64_t t = lo; t < hi; ++t) {
      while (t >= first[j + 1]) ++j;
      const PanelProduct& p = products[j];
      format_tile(p.format, x, q, M, K, p.panels, p.P, p.y, p.N, t - first[j]);
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
#undef VHALF
#undef VSTORE
#undef VSUB
#undef VDIV
#undef VMAX
#undef VMIN
#undef VPOW2
#undef VHSUM
#undef PANEL_INT_SIMD
#undef PANEL_BYTE_DOTS
#undef IBDOT
#undef ILOAD
#undef ISET1
#undef IAND
#undef ISRLI
#undef ISLL16
#undef ISRA16
#undef IDOT
#undef ICVT

// One ISA level's float32 panel product; spd/csrc/panel_linear.cpp includes this file once per level, inside that
// level's namespace, after defining (this file undefines the macros again at its end):
//   PANEL_TARGET   the function attribute that lets the compiler use the level's instructions here only
//   LANES, MT      output features a panel holds (one vector) and rows a full tile multiplies
//   vec, VZERO(), VLOAD(p), VSET1(s), VFMA(a, b, c) (a * b + c), VSTORE(p, v)
//
// Why the order is fixed by this code and not by the compiler: the translation unit is built with
// -ffp-contract=off and without -march=native, so a multiply-add is fused exactly where VFMA says (an intrinsic on
// the vector levels, never on the portable one) and nowhere else. GCC's tuning for some CPUs (Zen's
// "avoid FMA chains") otherwise fuses some multiply-adds and not others depending on the loop around them — which
// differs with the tile's row count, and so gave a row other bits at other row counts on an AVX2-only EPYC.
//
// Every output element is then the same sequence of operations whatever the row count: blocks of KB inputs in
// order, each summed in order by VFMA into a fresh accumulator, the blocks added in order (scalar adds).

template <int P, int R>
PANEL_TARGET static inline void tile(const float* __restrict x, int64_t K, const float* __restrict panel,
                                     float* __restrict y, int64_t N, int64_t n0) {
  // R rows of x [R, K] against P panels [P, K, LANES] -> y[:R, n0 : n0 + P * LANES] (clipped at N)
  float out[P][R][LANES];
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    const int64_t k1 = std::min(K, k0 + KB);
    vec acc[P][R];
    for (int i = 0; i < P; ++i)
      for (int j = 0; j < R; ++j) acc[i][j] = VZERO();
    for (int64_t k = k0; k < k1; ++k) {
      vec w[P];
      for (int i = 0; i < P; ++i) w[i] = VLOAD(panel + (i * K + k) * LANES);
      // the hardware prefetcher alone leaves several rows' products waiting on memory (-10..20% at 4..16 rows)
      for (int i = 0; i < P; ++i) __builtin_prefetch(panel + (i * K + k + PREFETCH) * LANES);
      for (int j = 0; j < R; ++j) {
        const vec xs = VSET1(x[j * K + k]);
        for (int i = 0; i < P; ++i) acc[i][j] = VFMA(w[i], xs, acc[i][j]);
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

template <int P, int R>
PANEL_TARGET static inline void remainder(int64_t r, const float* x, int64_t K, const float* panel, float* y,
                                          int64_t N, int64_t n0) {
  // the r < MT rows left after the full tiles, as one tile of exactly r rows
  if constexpr (R < MT) {
    if (r == R) tile<P, R>(x, K, panel, y, N, n0);
    else remainder<P, R + 1>(r, x, K, panel, y, N, n0);
  }
}

template <int P>
PANEL_TARGET static void rows(const float* x, int64_t M, int64_t K, const float* panel, float* y, int64_t N,
                              int64_t n0) {
  int64_t m = 0;
  for (; m + MT <= M; m += MT) tile<P, MT>(x + m * K, K, panel, y + m * N, N, n0);
  if (m < M) remainder<P, 1>(M - m, x + m * K, K, panel, y + m * N, N, n0);
}

PANEL_TARGET static void product(const float* x, int64_t M, int64_t K, const float* panels, int64_t P, float* y,
                                 int64_t N) {
  // x [M, K] times panels [P, K, LANES] -> y [M, N]; threads take tiles of NP panels
  at::parallel_for(0, (P + NP - 1) / NP, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t p = t * NP;
      if (p + NP <= P) rows<NP>(x, M, K, panels + p * K * LANES, y, N, p * LANES);
      else rows<1>(x, M, K, panels + p * K * LANES, y, N, p * LANES);
    }
  });
}

#undef PANEL_TARGET
#undef VZERO
#undef VLOAD
#undef VSET1
#undef VFMA
#undef VSTORE

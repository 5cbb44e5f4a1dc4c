// One ISA level's row operations for a target at weights=q4 (spd/csrc/llama_layer.cpp's own layer): exp, the
// MLP's silu(gate) * up, and attention over a layer's cached keys. Included by panel_kernel.h inside each level's
// namespace, with its macros, plus:
//   VSUB(a, b), VDIV(a, b), VMAX(a, b), VMIN(a, b)
//   VHSUM(v)   the lanes' sum, by a fixed tree
//   VPOW2(t)   2^n as floats, where t = n + MAGIC holds the integer n in its low mantissa bits
//
// Each row's result is a fixed sequence of operations on that row's values alone — an element-wise function applied
// element by element, a sum in a written-out order, a row's visible keys in ascending cache slot — so a row has the
// same bits whatever else shares the call: how many rows, which other keys the cache holds beside its own (a draft
// tree's other branches, another sequence's padding). A draft tree's ancestors sit in node order, parents first,
// so a tree row meets exactly the keys, in the order, of the one-row step at its position.

constexpr int64_t ATTEND_ALONE = 768;    // units x keys under which one thread attends
constexpr float MAGIC = 12582912.0f;       // 1.5 * 2^23: x + MAGIC - MAGIC rounds x to the nearest integer

PANEL_TARGET static inline vec vexp(vec x) {
  // e^x for x clamped to [-87.3, 88.3] (the float range of 2^n): x = n ln 2 + r, |r| <= ln 2 / 2, e^r by a
  // degree-7 polynomial (Cephes' expf coefficients), scaled by 2^n built from n's bits
  x = VMIN(VMAX(x, VSET1(-87.3f)), VSET1(88.3f));
  const vec t = VADD(VMUL(x, VSET1(1.44269504088896341f)), VSET1(MAGIC));
  const vec n = VSUB(t, VSET1(MAGIC));
  vec r = VFMA(n, VSET1(-0.693359375f), x);
  r = VFMA(n, VSET1(2.12194440e-4f), r);
  vec p = VSET1(1.9875691500e-4f);
  p = VFMA(p, r, VSET1(1.3981999507e-3f));
  p = VFMA(p, r, VSET1(8.3334519073e-3f));
  p = VFMA(p, r, VSET1(4.1665795894e-2f));
  p = VFMA(p, r, VSET1(1.6666665459e-1f));
  p = VFMA(p, r, VSET1(5.0000001201e-1f));
  p = VADD(VFMA(p, VMUL(r, r), r), VSET1(1.0f));
  return VMUL(p, VPOW2(t));
}

PANEL_TARGET static inline vec silu_times(vec g, vec u) {
  return VMUL(VDIV(g, VADD(VSET1(1.0f), vexp(VSUB(VZERO(), g)))), u);      // g / (1 + e^-g) * u
}

PANEL_TARGET static void silu_mul(float* gate, const float* up, int64_t n) {
  // gate[i] = silu(gate[i]) * up[i], a vector at a time; a last partial vector through the same code, padded
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) VSTORE(gate + i, silu_times(VLOAD(gate + i), VLOAD(up + i)));
  if (i < n) {
    float g[LANES] = {}, u[LANES] = {};
    std::copy(gate + i, gate + n, g);
    std::copy(up + i, up + n, u);
    VSTORE(g, silu_times(VLOAD(g), VLOAD(u)));
    std::copy(g, g + (n - i), gate + i);
  }
}

PANEL_TARGET static inline void weigh(const float* values, int64_t stride, const int64_t* keys, int64_t n,
                                      const float* p, float* out, int64_t full) {
  // out[: full] = sum over i of p[i] * values[keys[i] * stride + :], in key order (accumulators in memory: any width)
  std::fill(out, out + full, 0.0f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < full; d += LANES)
      VSTORE(out + d, VFMA(VSET1(p[i]), VLOAD(values + keys[i] * stride + d), VLOAD(out + d)));
}

template <int C, int G>
PANEL_TARGET static inline void weigh_heads(const float* values, int64_t stride, const int64_t* keys, int64_t n,
                                            const float* p, int64_t p_stride, float* out, int64_t out_stride) {
  // weigh<C> for G heads at once (head g's weights p + g * p_stride, output out + g * out_stride): each value row
  // read once for all of them, G * C chains of multiply-adds in flight; every element still sums in key order
  vec o[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) o[g][c] = VZERO();
  for (int64_t i = 0; i < n; ++i) {
    const float* v = values + keys[i] * stride;
    for (int g = 0; g < G; ++g) {
      const vec w = VSET1(p[g * p_stride + i]);
      for (int c = 0; c < C; ++c) o[g][c] = VFMA(w, VLOAD(v + c * LANES), o[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) VSTORE(out + g * out_stride + c * LANES, o[g][c]);
}

template <int C>
PANEL_TARGET static inline void weigh_all(const float* values, int64_t stride, const int64_t* keys, int64_t n,
                                          const float* p, int64_t p_stride, float* out, int64_t out_stride,
                                          int64_t heads) {
  // every head of a group, as many at a time as 16 accumulators hold
  constexpr int most = 16 / C < 1 ? 1 : 16 / C > 4 ? 4 : 16 / C;
  for (int64_t g = 0; g < heads;) {
    const int64_t r = std::min<int64_t>(heads - g, most);
    const float* pg = p + g * p_stride;
    float* og = out + g * out_stride;
    if (r >= 4 && most >= 4) weigh_heads<C, (most >= 4 ? 4 : 1)>(values, stride, keys, n, pg, p_stride, og, out_stride), g += 4;
    else if (r == 3 && most >= 3) weigh_heads<C, (most >= 3 ? 3 : 1)>(values, stride, keys, n, pg, p_stride, og, out_stride), g += 3;
    else if (r >= 2 && most >= 2) weigh_heads<C, (most >= 2 ? 2 : 1)>(values, stride, keys, n, pg, p_stride, og, out_stride), g += 2;
    else weigh_heads<C, 1>(values, stride, keys, n, pg, p_stride, og, out_stride), g += 1;
  }
}

PANEL_TARGET static void attend_units(const RowAttention& a, int64_t lo, int64_t hi) {
  // units lo .. hi - 1; a unit: a (b, kv head, row), its query heads together (query head h reads kv head h / groups)
  const int64_t groups = a.H / a.Hkv, full = a.D / LANES * LANES;
  std::vector<float> scores, acc(groups * a.D), totals(groups);
  std::vector<int64_t> keys;
  for (int64_t u = lo; u < hi; ++u) {
    const int64_t b = u / (a.Hkv * a.T), kh = u / a.T % a.Hkv, t = u % a.T;
    keys.clear();
    for (int64_t s = 0; s < a.S; ++s) {
      const int64_t m = b * a.ms[0] + t * a.ms[1] + s * a.ms[2];
      if (a.visible ? a.visible[m] : a.bias ? a.bias[m] > -INFINITY : s <= a.S - a.T + t) keys.push_back(s);
    }
    const int64_t n = keys.size(), padded = (n + LANES - 1) / LANES * LANES;
    scores.assign(groups * padded, 0.0f);
    const float* kv = a.k + b * a.ks[0] + kh * a.ks[1];
    const float* vv = a.v + b * a.vs[0] + kh * a.vs[1];
    const float* qrow = a.q + b * a.qs[0] + kh * groups * a.qs[1] + t * a.qs[2];
    // each score: the products a vector of lanes at a time, the lanes summed by VHSUM's tree (for LANES keys at
    // once, hsums), then a tail in order, times the scale, plus the bias
    for (int64_t i0 = 0; i0 < n; i0 += LANES) {
      const int64_t count = std::min<int64_t>(LANES, n - i0);
      const float* key[LANES];
      for (int r = 0; r < LANES; ++r) key[r] = kv + keys[i0 + std::min<int64_t>(r, count - 1)] * a.ks[2];
      for (int64_t g = 0; g < groups; ++g) {
        const float* qg = qrow + g * a.qs[1];
        vec acc[LANES];
        for (int r = 0; r < LANES; ++r) acc[r] = VZERO();
        for (int64_t d = 0; d < full; d += LANES) {
          const vec qv = VLOAD(qg + d);
          for (int r = 0; r < LANES; ++r) acc[r] = VFMA(qv, VLOAD(key[r] + d), acc[r]);
        }
        float sums[LANES];
        hsums(acc, sums);
        for (int64_t r = 0; r < count; ++r) {
          float sc = sums[r];
          for (int64_t d = full; d < a.D; ++d) sc += qg[d] * key[r][d];
          sc = sc * a.scale;
          if (a.bias) sc += a.bias[b * a.ms[0] + t * a.ms[1] + keys[i0 + r] * a.ms[2]];
          scores[g * padded + i0 + r] = sc;
        }
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      float* sc = scores.data() + g * padded;
      // the maximum (exact in any order), e^(score - max) with the padding's weights 0, their sum a vector of
      // lanes at a time and the lanes by VHSUM's tree (the row's own count of keys fixes the order)
      std::fill(sc + n, sc + padded, -INFINITY);
      vec top = VSET1(-INFINITY);
      for (int64_t i = 0; i < padded; i += LANES) top = VMAX(top, VLOAD(sc + i));
      float lanes[LANES], mx = -INFINITY;
      VSTORE(lanes, top);
      for (int l = 0; l < LANES; ++l) mx = std::max(mx, lanes[l]);
      for (int64_t i = 0; i < padded; i += LANES) VSTORE(sc + i, vexp(VSUB(VLOAD(sc + i), VSET1(mx))));
      std::fill(sc + n, sc + padded, 0.0f);
      vec sum = VZERO();
      for (int64_t i = 0; i < padded; i += LANES) sum = VADD(sum, VLOAD(sc + i));
      totals[g] = VHSUM(sum);
    }
    // the values weighted in key order, then divided by the weights' sum
    switch (full / LANES) {        // the rows' accumulators in registers where they fit
      case 1: weigh_all<1>(vv, a.vs[2], keys.data(), n, scores.data(), padded, acc.data(), a.D, groups); break;
      case 2: weigh_all<2>(vv, a.vs[2], keys.data(), n, scores.data(), padded, acc.data(), a.D, groups); break;
      case 4: weigh_all<4>(vv, a.vs[2], keys.data(), n, scores.data(), padded, acc.data(), a.D, groups); break;
      case 8: weigh_all<8>(vv, a.vs[2], keys.data(), n, scores.data(), padded, acc.data(), a.D, groups); break;
      default:
        for (int64_t g = 0; g < groups; ++g)
          weigh(vv, a.vs[2], keys.data(), n, scores.data() + g * padded, acc.data() + g * a.D, full);
    }
    for (int64_t g = 0; g < groups; ++g) {
      float* o = acc.data() + g * a.D;
      const float* p = scores.data() + g * padded;
      for (int64_t d = full; d < a.D; ++d) {
        o[d] = 0.0f;
        for (int64_t i = 0; i < n; ++i) o[d] += p[i] * vv[keys[i] * a.vs[2] + d];
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      float* dst = a.out + ((b * a.T + t) * a.H + kh * groups + g) * a.D;
      for (int64_t d = 0; d < a.D; ++d) dst[d] = n ? acc[g * a.D + d] / totals[g] : 0.0f;
    }
  }
}

PANEL_TARGET static void attend(const RowAttention& a) {
  // a unit's cost grows with its keys: a few short ones cost less than waking another thread
  const int64_t units = a.B * a.Hkv * a.T;
  if (units * a.S < ATTEND_ALONE) attend_units(a, 0, units);
  else at::parallel_for(0, units, 1, [&](int64_t lo, int64_t hi) { attend_units(a, lo, hi); });
}

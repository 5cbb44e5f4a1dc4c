// The AVX-512 level's definitions for spd/csrc/panel_kernel.h, included by spd/csrc/panel_linear.cpp in two
// namespaces that differ only in how a 16-bit dot product is done (PANEL_TARGET and IDOT, defined before): with
// AVX-512 VNNI's one instruction, or a multiply-add of pairs and an add. Integer sums, so the same bits.

constexpr int LANES = 16;
constexpr int MT = 12;            // 2 panels x 12 rows = 24 accumulators + 2 weights + 1 broadcast of 32 registers
constexpr int QMT = 6;            // 2 x 6 outputs, 2 x 6 sums, 4 codes, 1 broadcast
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSET1(s) _mm512_set1_ps(s)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VHALF(p) _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSUB(a, b) _mm512_sub_ps(a, b)
#define VDIV(a, b) _mm512_div_ps(a, b)
#define VMAX(a, b) _mm512_max_ps(a, b)
#define VMIN(a, b) _mm512_min_ps(a, b)
#define VHSUM(v) _mm512_reduce_add_ps(v)
#define PANEL_INT_SIMD 1
typedef __m512i ivec;
#define ILOAD(p) _mm512_loadu_si512(reinterpret_cast<const void*>(p))
#define ISET1(i) _mm512_set1_epi32(i)
#define IAND(a, b) _mm512_and_si512(a, b)
#define ISRLI(a, n) _mm512_srli_epi32(a, n)
#define ISLL16(a, n) _mm512_slli_epi16(a, n)
#define ISRA16(a, n) _mm512_srai_epi16(a, n)
#define ICVT(a) _mm512_cvtepi32_ps(a)
#define VPOW2(t) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_castps_si512(t), \
    _mm512_set1_epi32(0x4B400000 - 127)), 23))
PANEL_TARGET static inline void hsums(const __m512* a, float* out) {
  // out[i] = VHSUM(a[i]) for 16 vectors, bit for bit: _mm512_reduce_add_ps's tree (lanes i + (i + 8), then + (i + 4),
  // + (i + 2), + (i + 1)) run on four vectors' halves at once, the keys' sums then put back in order
  __m512 w[8], z[4], y[2];
  for (int j = 0; j < 8; ++j)            // w[j]: lanes 0..7 vector 2j's i + (i + 8), lanes 8..15 vector 2j + 1's
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 4; ++k)            // z[k]: quarter q vector 4k + q's + (i + 4)
    z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int m = 0; m < 2; ++m)            // y[m]: quarter q lanes 0, 1 vector 8m + q's + (i + 2), lanes 2, 3 8m + 4 + q's
    y[m] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * m], z[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(z[2 * m], z[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));   // lane 4q + e: vector 4e + q
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), f));
}
#include "panel_kernel.h"

// The AVX2 + FMA loops of the native CPU kernels (8 floats a register) under the reference's names (cpu_ref.cpp),
// every weight loaded once for all the rows of x a decode step has. Compiled with target attributes (the extension
// loads on any x86 CPU); they run only where features() has kAVX2. Chapter 08, Appendix A1.

#include "cpu_kernels.h"

#ifdef LLMINFER_X86
namespace llminfer_cpu::avx2 {

using V = V8;
#define LLMINFER_TARGET __attribute__((target("avx2,fma,f16c")))
#include "cpu_vec.h"

// int4 in tiles of 8 rows: codes (N/8, K/8, 32) bytes, where tile t, chunk c holds, as 8 little-endian 32-bit words,
// rows 8t..8t+7's codes for inputs 8c..8c+7 (word j: row 8t+j, its nibble i the code of input 8c+i); scale and offset
// are (N/8, G, 8). One 32-byte load brings 64 codes, the lane of a row holding its 8 codes; each code is isolated in
// place by one AND (the last by one shift) and converted by one vcvtdq2ps (code i arrives as q·16^i, so x is read
// pre-scaled by 16^-i: `int4t_x`), and multiplied into the 8 rows at once against x broadcast from L1, for each of MX
// rows of x. One row of x takes two tiles at a time (two streams), in four chains each (codes i % 4).
template <int T, int MX>
LLMINFER_TARGET void int4_block(const float* xs, const float* xsum, int64_t K, const uint8_t* w, Terms terms,
                                int64_t group, int64_t tile, float* y, int64_t N) {
  constexpr int CH = MX == 1 ? 4 : MX == 2 ? 2 : 1;
  const int64_t G = K / group;
  const __m256i mask[7] = {_mm256_set1_epi32(0xF), _mm256_set1_epi32(0xF0), _mm256_set1_epi32(0xF00),
                           _mm256_set1_epi32(0xF000), _mm256_set1_epi32(0xF0000), _mm256_set1_epi32(0xF00000),
                           _mm256_set1_epi32(0xF000000)};
  const uint8_t* codes[T];
  for (int t = 0; t < T; ++t) codes[t] = w + (tile + t) * (K / 8) * 32;
  const int64_t ahead = T * (K / 8) * 32;                 // bytes from a tile to the one T tiles on
  __m256 total[T][MX];
  for (int t = 0; t < T; ++t)
    for (int m = 0; m < MX; ++m) total[t][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[T][MX][CH];
    for (int t = 0; t < T; ++t)
      for (int m = 0; m < MX; ++m)
        for (int c = 0; c < CH; ++c) acc[t][m][c] = _mm256_setzero_ps();
    for (int t = 0; t < T; ++t) prefetch_terms(terms, ((tile + T + t) * G + g) * 8);   // the next tiles' terms
    for (int64_t k = g * group; k < (g + 1) * group; k += 8) {
      if (k % 16 == 0)                                    // the next tiles' codes, a line every 16 inputs
        for (int t = 0; t < T; ++t) _mm_prefetch(reinterpret_cast<const char*>(codes[t] + ahead + k * 4), _MM_HINT_T0);
      __m256i v[T];
      for (int t = 0; t < T; ++t) v[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes[t] + k * 4));
      for (int i = 0; i < 8; ++i) {
        __m256 q[T];
        for (int t = 0; t < T; ++t)
          q[t] = _mm256_cvtepi32_ps(i < 7 ? _mm256_and_si256(v[t], mask[i]) : _mm256_srli_epi32(v[t], 28));
        for (int m = 0; m < MX; ++m) {
          const __m256 xb = _mm256_broadcast_ss(xs + m * K + k + i);
          for (int t = 0; t < T; ++t) acc[t][m][i % CH] = _mm256_fmadd_ps(q[t], xb, acc[t][m][i % CH]);
        }
      }
    }
    for (int t = 0; t < T; ++t) {                        // w = q·scale + offset: Σ q·x·scale + offset·Σ x
      const int64_t at = ((tile + t) * G + g) * 8;
      const __m256 scale = terms8(terms.scale, terms.half, at), offset = terms8(terms.offset, terms.half, at);
      for (int m = 0; m < MX; ++m) {
        __m256 sum = acc[t][m][0];
        for (int c = 1; c < CH; ++c) sum = _mm256_add_ps(sum, acc[t][m][c]);
        total[t][m] = _mm256_fmadd_ps(sum, scale, total[t][m]);
        total[t][m] = _mm256_fmadd_ps(offset, _mm256_broadcast_ss(xsum + m * G + g), total[t][m]);
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int m = 0; m < MX; ++m) _mm256_storeu_ps(y + m * N + (tile + t) * 8, total[t][m]);
}

// ref::int4_tiles with xs, x placed by int4t_x (cpu_matvec.cpp)
void int4_tiles(const Weight& W, const float* xs, const float* xsum, int64_t M, float* y, int64_t t0, int64_t t1) {
  const int64_t K = W.K, G = K / W.group, N = W.N;
  const uint8_t* w = static_cast<const uint8_t*>(W.w);
  for (int64_t t = t0; t < t1; ++t) {
    if (M == 1) {
      if (t + 2 <= t1) int4_block<2, 1>(xs, xsum, K, w, W.terms, W.group, t++, y, N);
      else int4_block<1, 1>(xs, xsum, K, w, W.terms, W.group, t, y, N);
      continue;
    }
    for (int64_t m = 0; m < M; m += kRowsX) {
      const float *xm = xs + m * K, *sm = xsum + m * G;
      switch (std::min<int64_t>(kRowsX, M - m)) {
        case 1: int4_block<1, 1>(xm, sm, K, w, W.terms, W.group, t, y + m * N, N); break;
        case 2: int4_block<1, 2>(xm, sm, K, w, W.terms, W.group, t, y + m * N, N); break;
        case 3: int4_block<1, 3>(xm, sm, K, w, W.terms, W.group, t, y + m * N, N); break;
        default: int4_block<1, kRowsX>(xm, sm, K, w, W.terms, W.group, t, y + m * N, N);
      }
    }
  }
}

// W4A8 on the tiled layout, one tile for MX rows of x. xq holds each chunk of 8 inputs as its 4 even then its 4
// odd ones (int8; x ≈ xq·dx, one dx a block of 32). A word's low nibbles (AND 0x0F0F0F0F) are a row's 4 even
// codes as bytes, its high ones (shift, AND) the 4 odd: against the chunk's even and odd bytes broadcast to every
// lane, maddubs sums the byte products in pairs to int16 (at most 2·15·128 each, 8 of them a block: 30720 fits),
// and one madd with ones sums the block's pairs to int32 for each of the 8 rows. Then one conversion and one FMA by
// dx, and per group one FMA by the 8 rows' scales. The nibbles are isolated once for all MX rows of x.
template <int MX>
LLMINFER_TARGET void a8_block(const int8_t* xq, const float* dx, const float* xsum, int64_t K, const uint8_t* w,
                              Terms terms, int64_t group, int64_t tile, float* y, int64_t N) {
  const int64_t G = K / group, B = K / 32;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint8_t* codes = w + tile * (K / 8) * 32;
  const int64_t ahead = (K / 8) * 32;                     // bytes from a tile to the next
  __m256 total[MX];
  for (int m = 0; m < MX; ++m) total[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[MX];
    for (int m = 0; m < MX; ++m) acc[m] = _mm256_setzero_ps();
    prefetch_terms(terms, ((tile + 1) * G + g) * 8);
    for (int64_t b = g * group; b < (g + 1) * group; b += 32) {
      __m256i sum[MX];
      for (int m = 0; m < MX; ++m) sum[m] = _mm256_setzero_si256();
      for (int64_t k = b; k < b + 32; k += 8) {
        if (k % 16 == 0) _mm_prefetch(reinterpret_cast<const char*>(codes + ahead + k * 4), _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + k * 4));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int m = 0; m < MX; ++m) {
          int32_t even, odd;
          std::memcpy(&even, xq + m * K + k, 4);
          std::memcpy(&odd, xq + m * K + k + 4, 4);
          sum[m] = _mm256_add_epi16(sum[m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(even)));
          sum[m] = _mm256_add_epi16(sum[m], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(odd)));
        }
      }
      for (int m = 0; m < MX; ++m)
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum[m], ones)),
                                 _mm256_set1_ps(dx[m * B + b / 32]), acc[m]);
    }
    const int64_t at = (tile * G + g) * 8;
    const __m256 scale = terms8(terms.scale, terms.half, at), offset = terms8(terms.offset, terms.half, at);
    for (int m = 0; m < MX; ++m) {
      total[m] = _mm256_fmadd_ps(acc[m], scale, total[m]);
      total[m] = _mm256_fmadd_ps(offset, _mm256_broadcast_ss(xsum + m * G + g), total[m]);
    }
  }
  for (int m = 0; m < MX; ++m) _mm256_storeu_ps(y + m * N + tile * 8, total[m]);
}

void int4_tiles_a8(const int8_t* xq, const float* dx, const float* xsum, int64_t M, int64_t K, const uint8_t* w,
                   Terms terms, int64_t group, float* y, int64_t N, int64_t t0, int64_t t1) {
  const int64_t G = K / group, B = K / 32;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t m = 0; m < M; m += kRowsX) {
      const int8_t* xm = xq + m * K;
      const float *dm = dx + m * B, *sm = xsum + m * G;
      switch (std::min<int64_t>(kRowsX, M - m)) {
        case 1: a8_block<1>(xm, dm, sm, K, w, terms, group, t, y + m * N, N); break;
        case 2: a8_block<2>(xm, dm, sm, K, w, terms, group, t, y + m * N, N); break;
        case 3: a8_block<3>(xm, dm, sm, K, w, terms, group, t, y + m * N, N); break;
        default: a8_block<kRowsX>(xm, dm, sm, K, w, terms, group, t, y + m * N, N);
      }
    }
}

// ref::quantize_x_blocks, a block of 32 in registers (vcvtps2dq rounds half to even, as lrint: the same bytes)
LLMINFER_TARGET void quantize_x_blocks(const float* x, int64_t n_blocks, int8_t* xq, float* dx) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  // within each 16-byte lane: every chunk of 8 as its 4 even bytes, then its 4 odd
  const __m256i chunks = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,
                                          0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float* xb = x + b * 32;
    const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8), v2 = _mm256_loadu_ps(xb + 16),
                 v3 = _mm256_loadu_ps(xb + 24);
    // max |x| (vmaxps keeps its second operand where the first is NaN, as std::max(amax, |x|) ignores a NaN)
    __m256 m = _mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_setzero_ps());
    m = _mm256_max_ps(_mm256_andnot_ps(sign, v1), m);
    m = _mm256_max_ps(_mm256_andnot_ps(sign, v2), m);
    m = _mm256_max_ps(_mm256_andnot_ps(sign, v3), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float step = amax / 127.f, inverse = step > 0.f ? 1.f / step : 0.f;
    dx[b] = step;
    const __m256 inv = _mm256_set1_ps(inverse);
    const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv)),
                  q2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
    // packs work per 128-bit lane: bytes come out as x0-3, x8-11, x16-19, x24-27, x4-7, ...; a permute of 4-byte
    // groups restores x0..x31
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * 32), _mm256_shuffle_epi8(ordered, chunks));
  }
}

// s[0..n) <- exp(s - best), 0 where s is -inf (no key visible); returns their sum
LLMINFER_TARGET float exp_shifted(float* s, int64_t n, float best) {
  const __m256 shift = _mm256_set1_ps(best), neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 v = _mm256_loadu_ps(s + j);
    __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(v, neg_inf, _CMP_EQ_OQ), V8::exp(_mm256_sub_ps(v, shift)));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = hsum8(sum);
  for (; j < n; ++j) {
    s[j] = std::isinf(s[j]) ? 0.f : std::exp(s[j] - best);
    total += s[j];
  }
  return total;
}

#undef LLMINFER_TARGET
}  // namespace llminfer_cpu::avx2
#endif

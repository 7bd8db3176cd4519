// The AVX-512 loops of the native CPU kernels (16 floats a register) under the reference's names (cpu_ref.cpp), and
// those of its extensions: AVX512-VNNI (int8 dot products by vpdpbusd) and AVX512-BF16 (vdpbf16ps). Compiled with
// target attributes; they run only where features() has the bits and, for decode, where the static table names them
// (matvec_features). Chapter 08, Appendix A1.

#include "cpu_kernels.h"

#ifdef LLMINFER_X86
namespace llminfer_cpu::avx512 {

using V = V16;
#define LLMINFER_TARGET __attribute__((target(LLMINFER_AVX512 ",f16c")))
#include "cpu_vec.h"

// bfloat16 on 16 lanes: one 64-byte load brings 32 weights, two a 32-bit lane; a bfloat16 is the top half of its
// float32, so the lane shifted left by 16 is the even weight and the lane ANDed with 0xFFFF0000 the odd one (2
// instructions for 32 weights, where widening 16 at a time takes 4), against x's chunk of 32 as its 16 even, then its
// 16 odd entries (`even_odd`; x itself for the inputs after the last chunk)
struct BF16Split {
  using X = float;
  using XV = __m512;
  using WV = __m512;
  static constexpr int P = 2;
  static constexpr int64_t kStep = 32, kBytes = 2;
  LLMINFER_TARGET static void load_w(const void* w, int64_t i, WV (&out)[P]) {
    const __m512i v = _mm512_loadu_si512(static_cast<const uint16_t*>(w) + i);
    out[0] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    out[1] = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  LLMINFER_TARGET static void load_x(const float* x, int64_t k, XV (&out)[P]) {
    out[0] = _mm512_loadu_ps(x + k), out[1] = _mm512_loadu_ps(x + k + 16);
  }
  LLMINFER_TARGET static __m512 madd(__m512 acc, WV w, XV x) { return _mm512_fmadd_ps(w, x, acc); }
  static float tail(const float* x, const void* w, int64_t row, int64_t j) {
    return x[j] * weight_at<WKind::BF16>(w, row + j);
  }
};

void bf16_rows(const Weight& W, const float* xp, int64_t M, float* y, int64_t n0, int64_t n1) {
  rows_by<BF16Split>(xp, M, W, y, n0, n1);
}

// AVX-512, 16 lanes: one 64-byte load brings two chunks of a tile (inputs 8c..8c+15: lanes 0-7 the 8 rows' codes
// for the first 8 inputs, lanes 8-15 for the next 8). Code i of each half takes no conversion: one shift moves it
// to the top 4 bits of a float's mantissa and one vpternlogd keeps them under the exponent of 1.0, so the lane
// holds 1 + q/16 exactly. That is multiplied into a chain against x (plain, not scaled) whose lanes 0-7 hold input
// 8c+i and lanes 8-15 input 8c+8+i (one vpermps of the 16 inputs, shared by the tiles). A group's chains then hold
// Σ(1 + q/16)·x = Σx + Σq·x/16, so its scale is taken 16 times and its offset less those 16 scales:
// 16s·(Σx + Σq·x/16) + (o - 16s)·Σx = s·Σq·x + o·Σx. The two halves are summed at the end.
template <int T>
LLMINFER_TARGET void int4t_tiles_avx512(const float* x, const float* xsum, int64_t K, const uint8_t* w, Terms terms,
                                        int64_t group, int64_t tile, float* out) {
  const int64_t G = K / group;
  __m512i pick[8];
  for (int i = 0; i < 8; ++i)
    pick[i] = _mm512_setr_epi32(i, i, i, i, i, i, i, i, 8 + i, 8 + i, 8 + i, 8 + i, 8 + i, 8 + i, 8 + i, 8 + i);
  const __m512i field = _mm512_set1_epi32(0x00780000), one = _mm512_set1_epi32(0x3F800000);
  const uint8_t* codes[T];
  for (int t = 0; t < T; ++t) codes[t] = w + (tile + t) * (K / 8) * 32;
  const int64_t ahead = T * (K / 8) * 32;
  __m512 total[T];
  __m256 off[T];
  for (int t = 0; t < T; ++t) total[t] = _mm512_setzero_ps(), off[t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 a[T], b[T], c[T], d[T];                          // four chains a tile: codes i % 4
    for (int t = 0; t < T; ++t) a[t] = b[t] = c[t] = d[t] = _mm512_setzero_ps();
    for (int t = 0; t < T; ++t) prefetch_terms(terms, ((tile + T + t) * G + g) * 8);
    for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
      __m512i v[T];
      for (int t = 0; t < T; ++t) {
        _mm_prefetch(reinterpret_cast<const char*>(codes[t] + ahead + k * 4), _MM_HINT_T0);
        v[t] = _mm512_loadu_si512(codes[t] + k * 4);
      }
      const __m512 xk = _mm512_loadu_ps(x + k);
      for (int i = 0; i < 8; ++i) {
        const __m512 xb = _mm512_permutexvar_ps(pick[i], xk);
        for (int t = 0; t < T; ++t) {
          // code i (bits 4i..4i+3) to bits 19..22, then (moved AND field) OR one: the float 1 + q/16
          const __m512i moved = 4 * i <= 19 ? _mm512_slli_epi32(v[t], 19 - 4 * i) : _mm512_srli_epi32(v[t], 4 * i - 19);
          const __m512 q = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(moved, field, one, 0xEA));
          __m512& chain = i % 4 == 0 ? a[t] : i % 4 == 1 ? b[t] : i % 4 == 2 ? c[t] : d[t];
          chain = _mm512_fmadd_ps(q, xb, chain);
        }
      }
    }
    const __m256 xg = _mm256_broadcast_ss(xsum + g);
    for (int t = 0; t < T; ++t) {
      const int64_t at = ((tile + t) * G + g) * 8;
      const __m256 scale16 = _mm256_mul_ps(terms8(terms.scale, terms.half, at), _mm256_set1_ps(16.f));
      const __m512 scales = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(scale16)));
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(a[t], b[t]), _mm512_add_ps(c[t], d[t]));
      total[t] = _mm512_fmadd_ps(sum, scales, total[t]);                 // the 8 rows' scales ×16, both halves
      off[t] = _mm256_fmadd_ps(_mm256_sub_ps(terms8(terms.offset, terms.half, at), scale16), xg, off[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm256_storeu_ps(out + 8 * t, _mm256_add_ps(halves_sum(total[t]), off[t]));
}

// ref::int4_tiles, x itself (not placed), a row of x at a time: two tiles, a last odd one alone
void int4_tiles(const Weight& W, const float* x, const float* xsum, int64_t M, float* y, int64_t t0, int64_t t1) {
  const int64_t K = W.K, G = K / W.group, N = W.N;
  const uint8_t* w = static_cast<const uint8_t*>(W.w);
  float out[16];
  for (int64_t t = t0; t < t1;) {
    const int T = t + 2 <= t1 ? 2 : 1;
    for (int64_t m = 0; m < M; ++m) {
      if (T == 2) int4t_tiles_avx512<2>(x + m * K, xsum + m * G, K, w, W.terms, W.group, t, out);
      else int4t_tiles_avx512<1>(x + m * K, xsum + m * G, K, w, W.terms, W.group, t, out);
      std::memcpy(y + m * N + t * 8, out, 8 * T * sizeof(float));
    }
    t += T;
  }
}

// The bytes of x the 512-bit int8 dot-product loops on int4 tiles multiply, laid out once per product so that they
// read each pair of chunks' even and odd fours as whole registers: per 16 inputs (chunks c and c + 1, each in xq as
// its 4 even then its 4 odd inputs), 128 bytes: c's even four 8 times, c + 1's even four 8 times (lanes 0-7 and
// 8-15 of one load), then the two odd fours the same way. spread: K·8 bytes; K a multiple of 16.
__attribute__((target("avx2"))) void int4t_spread(const int8_t* xq, int64_t K, int8_t* spread) {
  for (int64_t k = 0; k < K; k += 16) {
    int32_t four[4];                                      // c even, c odd, c + 1 even, c + 1 odd
    std::memcpy(four, xq + k, 16);
    __m256i* out = reinterpret_cast<__m256i*>(spread + k * 8);
    _mm256_storeu_si256(out, _mm256_set1_epi32(four[0]));
    _mm256_storeu_si256(out + 1, _mm256_set1_epi32(four[2]));
    _mm256_storeu_si256(out + 2, _mm256_set1_epi32(four[1]));
    _mm256_storeu_si256(out + 3, _mm256_set1_epi32(four[3]));
  }
}

// int8 dot products on 512-bit registers (AVX512-VNNI), for W4A8 and for int4 with float x. One 64-byte load
// brings two chunks of a tile, as in the weight-only loop above; the x bytes each half multiplies are laid out once
// per product (`int4t_spread`), so the vpdpbusd read them straight from L1.
//   Planes = 1 (W4A8): x ≈ xq·dx, one int8 plane. Per 32 inputs a tile takes a prefetch two tiles ahead, a load,
//     the nibbles by AND and shift, and two vpdpbusd (into two sums, so that no instruction waits on the one
//     before), twice; then one conversion and one FMA by dx on all 16 lanes.
//   Planes = 3 (int4 with float x, `int4_x_digits`): x = (a·2^16 + b·2^8 + c)·dx exactly to within 2^-23 of the
//     block's largest |x|, three int8 planes, so the nibbles meet six vpdpbusd instead of sixteen conversions and
//     sixteen FMAs. The plane sums stay exact in int32 (|a| ≤ 65, |b|, |c| ≤ 128: at most 15·128·32 a block), and
//     65536·A + (256·B + C) is formed in float32 from two exact conversions: one rounding, as an FMA's.
// Per group one FMA by the 8 rows' scales (both halves), and the halves are summed once, at the end.
// spread: Planes planes of K·8 bytes, one after the other; dx: a step per block of 32 inputs
template <int Planes>
__attribute__((target(LLMINFER_AVX512 ",f16c,avx512vnni"))) void int4t_dp_avx512(
    const int8_t* spread, const float* dx, const float* xsum, int64_t K, const uint8_t* w, Terms terms, int64_t group,
    int64_t tile, float* out) {
  static_assert(Planes == 1 || Planes == 3, "one plane (W4A8) or three (float x)");
  const int64_t G = K / group;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512 place = _mm512_set1_ps(65536.f);
  const uint8_t* codes = w + tile * (K / 8) * 32;
  const int64_t ahead = 2 * (K / 8) * 32;                 // bytes from a tile to the one after the next
  __m512 total = _mm512_setzero_ps();                     // lanes 0-7 and 8-15: the 8 rows, a half each
  __m256 off = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = g * group; b < (g + 1) * group; b += 32) {
      __m512i sum[Planes][2];                             // per plane, the even and the odd inputs' sums
      for (int p = 0; p < Planes; ++p) sum[p][0] = sum[p][1] = _mm512_setzero_si512();
      for (int64_t k = b; k < b + 32; k += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(codes + ahead + k * 4), _MM_HINT_T0);   // the next tile's line
        const __m512i v = _mm512_loadu_si512(codes + k * 4);
        const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int p = 0; p < Planes; ++p) {
          const int8_t* xk = spread + p * K * 8 + k * 8;
          sum[p][0] = _mm512_dpbusd_epi32(sum[p][0], lo, _mm512_loadu_si512(xk));
          sum[p][1] = _mm512_dpbusd_epi32(sum[p][1], hi, _mm512_loadu_si512(xk + 64));
        }
      }
      __m512 dot;
      if constexpr (Planes == 1) {
        dot = _mm512_cvtepi32_ps(_mm512_add_epi32(sum[0][0], sum[0][1]));
      } else {
        const __m512i high = _mm512_add_epi32(sum[0][0], sum[0][1]);
        const __m512i rest = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(sum[1][0], sum[1][1]), 8),
                                              _mm512_add_epi32(sum[2][0], sum[2][1]));
        dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(high), place, _mm512_cvtepi32_ps(rest));
      }
      acc = _mm512_fmadd_ps(dot, _mm512_set1_ps(dx[b / 32]), acc);
    }
    const int64_t at = (tile * G + g) * 8;
    const __m256 scale8 = terms8(terms.scale, terms.half, at);
    const __m512 scales = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(scale8)));
    total = _mm512_fmadd_ps(acc, scales, total);
    off = _mm256_fmadd_ps(terms8(terms.offset, terms.half, at), _mm256_set1_ps(xsum[g]), off);
  }
  _mm256_storeu_ps(out, _mm256_add_ps(halves_sum(total), off));
}

// tiles [t0, t1) of y (M, N) for the int8 dot-product loops (W4A8; int4 with float x as three planes), one tile at
// a time (xq: each row of x as `Tile` reads it, `spread` bytes an input: 8, or 24 for three planes)
template <void (*Tile)(const int8_t*, const float*, const float*, int64_t, const uint8_t*, Terms, int64_t, int64_t,
                       float*), int64_t spread = 1>
void rows_int4t_a8(const int8_t* xq, const float* dx, const float* xsum, int64_t M, int64_t K, const uint8_t* w,
                   Terms terms, int64_t group, float* y, int64_t N, int64_t t0, int64_t t1) {
  const int64_t G = K / group, B = K / 32;
  float out[8];
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t m = 0; m < M; ++m) {
      Tile(xq + m * K * spread, dx + m * B, xsum + m * G, K, w, terms, group, t, out);
      std::memcpy(y + m * N + t * 8, out, 8 * sizeof(float));
    }
}

// ref::int4_tiles_a8 by vpdpbusd, xq in int4t_spread's layout (K·8 bytes a row of x)
void int4_tiles_a8(const int8_t* xq, const float* dx, const float* xsum, int64_t M, int64_t K, const uint8_t* w,
                   Terms terms, int64_t group, float* y, int64_t N, int64_t t0, int64_t t1) {
  rows_int4t_a8<int4t_dp_avx512<1>, 8>(xq, dx, xsum, M, K, w, terms, group, y, N, t0, t1);
}

// x as three int8 planes for the int8 dot-product loops on int4 tiles with float x, one row of x: per block of 32
// inputs, with 2^(E-1) ≤ max |x| < 2^E, X = round(x·2^(22-E)) (|X| ≤ 2^22: the block's largest input keeps 23
// bits, as float32 keeps 24) is split into balanced base-256 digits, X = a·2^16 + b·2^8 + c, and dx = 2^(E-22)
// (exact: powers of two). digits holds the a, b and c planes of K bytes each, one after the other, each in the
// tiled order (each chunk of 8 as its 4 even, then its 4 odd inputs). x must be finite.
LLMINFER_ON_AVX2 void int4_x_digits(const float* x, int64_t K, int8_t* digits, float* dx) {
  const __m256i chunk = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256i half = _mm256_set1_epi32(128), byte = _mm256_set1_epi32(255);
  // the low byte of each 32-bit lane to the bottom of its 128-bit half, then the two halves' four bytes side by side
  const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                             0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i join = _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1);
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + b * 32;
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    int E;
    std::frexp(_mm_cvtss_f32(h), &E);                                          // amax < 2^E (0 for amax = 0)
    E = std::max(E, -100);                                                     // 2^(22-E) a normal float
    const __m256 to_int = _mm256_set1_ps(std::ldexp(1.f, 22 - E));
    dx[b] = std::ldexp(1.f, E - 22);
    for (int i = 0; i < 4; ++i) {
      const __m256i X = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_permutevar8x32_ps(v[i], chunk), to_int));
      const __m256i c = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(X, half), byte), half);
      const __m256i X1 = _mm256_srai_epi32(_mm256_sub_epi32(X, c), 8);
      const __m256i bb = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(X1, half), byte), half);
      const __m256i a = _mm256_srai_epi32(_mm256_sub_epi32(X1, bb), 8);
      const __m256i plane[3] = {a, bb, c};
      for (int p = 0; p < 3; ++p) {
        const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(plane[p], low_bytes), join);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(digits + p * K + b * 32 + 8 * i),
                         _mm256_castsi256_si128(bytes));
      }
    }
  }
}

// ref::int4_tiles with float x by three int8 planes (`int4_x_digits`) and vpdpbusd; x finite. Each thread lays out
// its own planes (24 bytes an input: cheaper to write again than to read from the core that wrote them).
void int4_planes(const Weight& W, const float* x, const float* xsum, int64_t M, float* y, int64_t t0, int64_t t1) {
  const int64_t N = W.N, K = W.K, B = K / 32;
  thread_local std::vector<int8_t> digits, spread;
  thread_local std::vector<float> dx;
  digits.resize(M * 3 * K);
  dx.resize(M * B);
  for (int64_t m = 0; m < M; ++m) int4_x_digits(x + m * K, K, digits.data() + m * 3 * K, dx.data() + m * B);
  spread.resize(M * 3 * K * 8);
  for (int64_t p = 0; p < M * 3; ++p) int4t_spread(digits.data() + p * K, K, spread.data() + p * K * 8);
  rows_int4t_a8<int4t_dp_avx512<3>, 24>(spread.data(), dx.data(), xsum, M, K, static_cast<const uint8_t*>(W.w),
                                        W.terms, W.group, y, N, t0, t1);
}

#undef LLMINFER_TARGET
}  // namespace llminfer_cpu::avx512

namespace llminfer_cpu::avx512_bf16 {

using V = V16;
#define LLMINFER_TARGET __attribute__((target(LLMINFER_AVX512 ",avx512bf16")))
#define LLMINFER_ROWS_ONLY                   // the loops' templates only, for BF16DP
#include "cpu_vec.h"
#undef LLMINFER_ROWS_ONLY

// bfloat16 weights by vdpbf16ps: x as bfloat16, 32 inputs a step in pairs, the products summed in float32. Taken
// only where x is bfloat16 already (`bfloat16_exact`), so rounding it changes nothing.
struct BF16DP {
  using X = uint16_t;
  using XV = __m512bh;
  using WV = __m512bh;
  static constexpr int P = 1;
  static constexpr int64_t kStep = 32, kBytes = 2;
  LLMINFER_TARGET static void load_w(const void* w, int64_t i, WV (&out)[P]) {
    out[0] = (__m512bh)_mm512_loadu_si512(static_cast<const uint16_t*>(w) + i);
  }
  LLMINFER_TARGET static void load_x(const uint16_t* x, int64_t k, XV (&out)[P]) {
    out[0] = (__m512bh)_mm512_loadu_si512(x + k);
  }
  LLMINFER_TARGET static __m512 madd(__m512 acc, WV w, XV x) { return _mm512_dpbf16_ps(acc, w, x); }
  static float tail(const uint16_t* x, const void* w, int64_t row, int64_t j) {
    return weight_at<WKind::BF16>(x, j) * weight_at<WKind::BF16>(w, row + j);
  }
};

void dense_rows(const Weight& W, const uint16_t* xb, int64_t M, float* y, int64_t n0, int64_t n1) {
  rows_by<BF16DP>(xb, M, W, y, n0, n1);
}

#undef LLMINFER_TARGET
}  // namespace llminfer_cpu::avx512_bf16
#endif

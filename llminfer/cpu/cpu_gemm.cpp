// The blocked matrix multiply of the native CPU kernels: products for many rows of x (a prefill). Chapter 08.
//
// With a hundred rows of x each weight is used a hundred times, and the speed is how many multiply-adds a cycle the
// core sustains. The AVX2 tile computes 6 outputs (6 rows of W) for 16 tokens at once, in 12 registers: per input k,
// it broadcasts W[n..n+5][k] and multiplies them into x's 16 tokens at k, laid out for it once per product ("packed":
// 16 tokens of one input contiguous), 12 multiply-adds for 8 loads. float32 rows of W are read in place; the other
// formats widen each block of 6 rows to float32 once, which all the token tiles then share. Long inputs are split into
// chunks so that a chunk of packed x stays in L2.

#include <atomic>
#include <memory>

#include "cpu_kernels.h"

namespace llminfer_cpu {

constexpr int64_t kGemmTile = 16;   // tokens of one packed tile
constexpr int64_t kGemmRowsW = 6;   // rows of W of one tile
constexpr int64_t kGemmPackedBytes = 384 << 10;  // packed x of one chunk, all token tiles: within L2

// inputs per chunk for a product of M rows and K inputs, packed x `bytes` an element: as few equal chunks as keep
// packed x within kGemmPackedBytes (256 to 1024 float32 inputs, twice as many bfloat16 ones), a multiple of 32
inline int64_t gemm_chunk(int64_t M, int64_t K, int64_t tokens, int64_t bytes) {
  const int64_t padded = (M + tokens - 1) / tokens * tokens, wide = 4 / bytes;
  const int64_t limit = std::clamp<int64_t>(kGemmPackedBytes / (padded * bytes) / 32 * 32, 256 * wide, 1024 * wide);
  const int64_t chunks = (K + limit - 1) / limit;
  return ((K + chunks - 1) / chunks + 31) / 32 * 32;
}

// Tokens per group where packed x needs chunks of K and the outputs outgrow kGemmPackedBytes (the chunks' partial
// sums would leave L2 between chunks): the tokens then go in equal groups of whole tiles, each in as few chunks as
// its packed x allows; M otherwise
inline int64_t gemm_token_group(int64_t M, int64_t N, int64_t K, int64_t tokens, int64_t bytes) {
  if (gemm_chunk(M, K, tokens, bytes) >= K || M * N * 4 <= kGemmPackedBytes) return M;
  const int64_t most = std::max<int64_t>(tokens, kGemmPackedBytes / (K * bytes) / tokens * tokens);
  const int64_t groups = (M + most - 1) / most;
  return ((M + groups - 1) / groups + tokens - 1) / tokens * tokens;
}

#ifdef LLMINFER_X86
// y[j][0..5] (+)= column j of the 6 x 8 block (r0 .. r5) for tokens j < rows, y rows `ldy` floats apart
LLMINFER_ON_AVX2 inline void store_tile_half(__m256 r0, __m256 r1, __m256 r2, __m256 r3, __m256 r4, __m256 r5, float* y,
                                             int64_t ldy, int64_t rows, bool accumulate) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  constexpr int lo = _MM_SHUFFLE(1, 0, 1, 0), hi = _MM_SHUFFLE(3, 2, 3, 2);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, lo), s1 = _mm256_shuffle_ps(t0, t2, hi);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, lo), s3 = _mm256_shuffle_ps(t1, t3, hi);
  const __m256 s4 = _mm256_shuffle_ps(t4, zero, lo), s5 = _mm256_shuffle_ps(t4, zero, hi);
  const __m256 s6 = _mm256_shuffle_ps(t5, zero, lo), s7 = _mm256_shuffle_ps(t5, zero, hi);
  // token j: outputs 0..3 in the first 128 bits of c[j], outputs 4, 5 in the first 64 bits of its second half
  const __m256 c[8] = {_mm256_permute2f128_ps(s0, s4, 0x20), _mm256_permute2f128_ps(s1, s5, 0x20),
                       _mm256_permute2f128_ps(s2, s6, 0x20), _mm256_permute2f128_ps(s3, s7, 0x20),
                       _mm256_permute2f128_ps(s0, s4, 0x31), _mm256_permute2f128_ps(s1, s5, 0x31),
                       _mm256_permute2f128_ps(s2, s6, 0x31), _mm256_permute2f128_ps(s3, s7, 0x31)};
  for (int64_t j = 0; j < rows; ++j) {
    float* dst = y + j * ldy;
    __m128 low = _mm256_castps256_ps128(c[j]), high = _mm256_extractf128_ps(c[j], 1);
    if (accumulate) {
      low = _mm_add_ps(low, _mm_loadu_ps(dst));
      high = _mm_add_ps(high, _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dst + 4))));
    }
    _mm_storeu_ps(dst, low);
    _mm_store_sd(reinterpret_cast<double*>(dst + 4), _mm_castps_pd(high));
  }
}

// out[i·ldo + j] = in[j·ldi + i] for an 8 x 8 block
LLMINFER_ON_AVX2 void transpose8x8(const float* in, int64_t ldi, float* out, int64_t ldo) {
  __m256 r[8], t[8];
  for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(in + j * ldi);
  for (int j = 0; j < 8; j += 2) t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]), t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
  for (int j = 0; j < 8; j += 4)
    for (int h = 0; h < 2; ++h) {
      r[j + h] = _mm256_shuffle_ps(t[j + h], t[j + h + 2], _MM_SHUFFLE(1, 0, 1, 0));
      r[j + h + 2] = _mm256_shuffle_ps(t[j + h], t[j + h + 2], _MM_SHUFFLE(3, 2, 3, 2));
    }
  // r[i] (i < 4): column order[i] of rows 0-3 in its low half, column order[i] + 4 in its high half; r[i + 4]: rows 4-7
  const int order[4] = {0, 2, 1, 3};
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(out + order[i] * ldo, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(out + (order[i] + 4) * ldo, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// Where the next block's rows lie in W as stored: `spans` runs of `bytes`, `stride` apart, from p. A float tile
// given one fetches it into L2 a line every other step, so that the next block finds its rows there.
struct Ahead {
  const char* p = nullptr;
  int64_t stride = 0, bytes = 0, spans = 0;
  int64_t line = 0, span = 0;                // the next line to fetch
  inline void step() {
    if (!p) return;
    _mm_prefetch(p + span * stride + line, _MM_HINT_T1);
    if ((line += 64) >= bytes) {
      line = 0;
      if (++span == spans) p = nullptr;
    }
  }
};

// y (rows <= 16 tokens, 6 outputs, rows `ldy` apart) (+)= packed x[0..kc)[0..16) · W[0..5][0..kc)ᵀ, W rows
// `ldw` floats apart
LLMINFER_ON_AVX2 void gemm_tile_6x16(const float* w, int64_t ldw, const float* xp, int64_t kc, float* y, int64_t ldy,
                                     int64_t rows, bool accumulate, const Ahead& next) {
  Ahead ahead = next;
  // twelve named accumulators: as an array, the compiler spills them to the stack every step
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0, a4 = a0,
         b4 = a0, a5 = a0, b5 = a0;
  const float *r0 = w, *r1 = w + ldw, *r2 = w + 2 * ldw, *r3 = w + 3 * ldw, *r4 = w + 4 * ldw, *r5 = w + 5 * ldw;
#define LLMINFER_ROW(i)                               \
  {                                                   \
    const __m256 s = _mm256_broadcast_ss(r##i + k);   \
    a##i = _mm256_fmadd_ps(s, x0, a##i);              \
    b##i = _mm256_fmadd_ps(s, x1, b##i);              \
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 x0 = _mm256_load_ps(xp + k * kGemmTile), x1 = _mm256_load_ps(xp + k * kGemmTile + 8);
    if (k & 1) ahead.step();
    LLMINFER_ROW(0) LLMINFER_ROW(1) LLMINFER_ROW(2) LLMINFER_ROW(3) LLMINFER_ROW(4) LLMINFER_ROW(5)
  }
#undef LLMINFER_ROW
  // out (tokens, outputs): each half of 8 tokens transposed in registers, 6 outputs a token stored at once
  store_tile_half(a0, a1, a2, a3, a4, a5, y, ldy, std::min<int64_t>(rows, 8), accumulate);
  if (rows > 8) store_tile_half(b0, b1, b2, b3, b4, b5, y + 8 * ldy, ldy, rows - 8, accumulate);
}

// rows n .. n + r - 1 (r <= 6) of W, inputs [k0, k0 + kc), as float32 into out (row i at out + i·kc); int4
// chunks start and end on a multiple of 32 inputs (a group is a multiple of 32)
__attribute__((target("avx2,fma,f16c"))) void widen_rows(const Weight& W, int64_t n, int64_t r, int64_t k0, int64_t kc,
                                                     float* out) {
  const int64_t K = W.K;
  for (int64_t i = 0; i < r; ++i) {
    const int64_t row = n + i;
    float* o = out + i * kc;
    int64_t k = 0;
    if (W.format == Weight::F32) {
      std::memcpy(o, static_cast<const float*>(W.w) + row * K + k0, kc * sizeof(float));
    } else if (W.format == Weight::BF16) {
      const uint16_t* src = static_cast<const uint16_t*>(W.w) + row * K + k0;
      for (; k + 8 <= kc; k += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
        _mm256_storeu_ps(o + k, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
      }
      for (; k < kc; ++k) o[k] = weight_at<WKind::BF16>(src, k);
    } else if (W.format == Weight::I8) {
      const int8_t* src = static_cast<const int8_t*>(W.w) + row * K + k0;
      const float* scales = W.scale + row * (K / W.group);    // one a row, or one a group (a multiple of 16)
      while (k + 8 <= kc) {                                   // a group (or what of it the chunk holds) at a time
        const int64_t g = (k0 + k) / W.group, end = std::min(kc, (g + 1) * W.group - k0);
        if (end < k + 8) break;                               // (the loop below ends on the group's end)
        const __m256 s = _mm256_set1_ps(scales[g]);
        for (; k + 8 <= end; k += 8) {
          const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + k));
          _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s));
        }
      }
      for (; k < kc; ++k) o[k] = static_cast<float>(src[k]) * scales[(k0 + k) / W.group];
    } else {                                      // int4 in tiles of 8 rows: one 32-bit word, 8 inputs
      const int64_t G = K / W.group;
      const uint8_t* src = static_cast<const uint8_t*>(W.w) + (row / 8) * (K / 8) * 32 + (row % 8) * 4;
      const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), low = _mm256_set1_epi32(0xF);
      while (k + 8 <= kc) {                                   // a group (or what of it the chunk holds) at a time
        const int64_t g = (k0 + k) / W.group, end = std::min(kc, (g + 1) * W.group - k0);
        const int64_t s_at = ((row / 8) * G + g) * 8 + row % 8;
        const __m256 s = _mm256_set1_ps(term_f16c(W.terms.scale, W.terms.half, s_at));
        const __m256 z = _mm256_set1_ps(term_f16c(W.terms.offset, W.terms.half, s_at));
        for (; k + 8 <= end; k += 8) {
          int32_t word;
          std::memcpy(&word, src + (k0 + k) * 4, 4);
          const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), low);
          _mm256_storeu_ps(o + k, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s, z));
        }
      }
    }
  }
}

// widen_rows for int4 tiles, 16 inputs a step: one 64-byte load holds two chunks of 8 inputs of all 8 rows of the
// tile, a permute puts this row's word of each in 8 lanes, a variable shift its nibbles (the same floats, q·s + z by
// one FMA, in a third of the instructions)
__attribute__((target("avx2,fma,f16c,avx512f"))) void widen_int4_tiles_avx512(const Weight& W, int64_t n, int64_t r,
                                                                            int64_t k0, int64_t kc, float* out) {
  const int64_t K = W.K, G = K / W.group;
  const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  const __m512i low = _mm512_set1_epi32(0xF), eight = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);
  for (int64_t i = 0; i < r; ++i) {
    const int64_t row = n + i;
    const uint8_t* src = static_cast<const uint8_t*>(W.w) + (row / 8) * (K / 8) * 32;
    const __m512i words = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(row % 8)), eight);
    float* o = out + i * kc;
    for (int64_t k = 0; k < kc;) {                           // a group (or what of it the chunk holds) at a time
      const int64_t g = (k0 + k) / W.group, end = std::min(kc, (g + 1) * W.group - k0);
      const int64_t s_at = ((row / 8) * G + g) * 8 + row % 8;
      const __m512 s = _mm512_set1_ps(term_f16c(W.terms.scale, W.terms.half, s_at));
      const __m512 z = _mm512_set1_ps(term_f16c(W.terms.offset, W.terms.half, s_at));
      for (; k < end; k += 16) {
        const __m512i both = _mm512_loadu_si512(src + (k0 + k) * 4);
        const __m512i q = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(words, both), shifts), low);
        _mm512_storeu_ps(o + k, _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s, z));
      }
    }
  }
}

// AVX-512: tiles of rows of W by 16-lane registers of tokens. float32: 6 rows by 64 tokens (24 accumulators), W
// widened as for AVX2. bfloat16 (AVX512-BF16): one vdpbf16ps multiplies a pair of inputs into 16 tokens, W's rows read
// in place (each 32-bit word a pair of inputs, broadcast), x packed as bfloat16 pairs, taken only where x is bfloat16
// already (a bfloat16 model's activations), so the numbers are the widening path's up to the order of the sums.

// y (rows <= 32 tokens, R <= 16 outputs, rows `ldy` apart) (+)= the accumulators (a: tokens 0..15, b: 16..31):
// each half transposed in registers, then a token's R outputs stored at once (masked)
template <int R>
LLMINFER_ON_AVX512 inline void store_tile_x32(const __m512 (&a)[R], const __m512 (&b)[R], float* y, int64_t ldy,
                                              int64_t rows, bool accumulate) {
  static_assert(R <= 16);
  const __mmask16 mask = static_cast<__mmask16>((1u << R) - 1);
  for (int64_t h = 0; h < 2 && 16 * h < rows; ++h) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = i < R ? (h ? b[i] : a[i]) : _mm512_setzero_ps();
    transpose16(r);
    const int64_t n = std::min<int64_t>(16, rows - 16 * h);
    for (int64_t j = 0; j < n; ++j) {
      float* dst = y + (16 * h + j) * ldy;
      const __m512 v = accumulate ? _mm512_add_ps(r[j], _mm512_maskz_loadu_ps(mask, dst)) : r[j];
      _mm512_mask_storeu_ps(dst, mask, v);
    }
  }
}

// y (rows <= 16·V tokens, R outputs, rows `ldy` apart) (+)= packed x[0..kc)[0..16·V) · W[0..R)[0..kc)ᵀ, W rows `ldw`
// floats apart: R·V accumulators, each broadcast of W multiplied into V registers of x.
template <int R, int V>
LLMINFER_ON_AVX512 void gemm_tile_avx512(const float* w, int64_t ldw, const float* xp, int64_t kc, float* y,
                                         int64_t ldy, int64_t rows, bool accumulate, const Ahead& next) {
  static_assert(V % 2 == 0 && R * V + V < 32);       // accumulators, x and a broadcast in the 32 registers
  Ahead ahead = next;                                 // (a copy: passed by value, the caller's stores stalled)
  __m512 a[V][R];
#pragma GCC unroll 16
  for (int v = 0; v < V; ++v)
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) a[v][i] = _mm512_setzero_ps();
  const float* r[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) r[i] = w + i * ldw;
#pragma GCC unroll 2
  for (int64_t k = 0; k < kc; ++k) {
    __m512 x[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) x[v] = _mm512_load_ps(xp + (k * V + v) * 16);
    if (k & 1) ahead.step();
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m512 s = _mm512_set1_ps(r[i][k]);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) a[v][i] = _mm512_fmadd_ps(s, x[v], a[v][i]);
    }
  }
  for (int v = 0; v < V && 16 * v < rows; v += 2)       // 32 tokens at a time
    store_tile_x32<R>(a[v], a[v + 1], y + 16 * v * ldy, ldy, std::min<int64_t>(32, rows - 16 * v), accumulate);
}

// w: R bfloat16 rows `ldw` elements apart; xp: kc / 2 steps of 32 tokens' input pairs (64 bfloat16 a step). 12 rows:
// 24 accumulators, each pair of x registers loaded serving 24 vdpbf16ps. `next`, where not null: the next block's rows,
// fetched into L1 a line of each every 16 steps (the driver passes it on a block's first token tile).
template <int R>
__attribute__((target(LLMINFER_AVX512 ",avx512bf16"))) void gemm_tile_x32_bf16dp(
    const uint16_t* w, int64_t ldw, const uint16_t* xp, int64_t kc, float* y, int64_t ldy, int64_t rows,
    bool accumulate, const uint16_t* next) {
  static_assert(R % 3 == 0);
  __m512 a[R], b[R];
#pragma GCC unroll 12
  for (int i = 0; i < R; ++i) a[i] = b[i] = _mm512_setzero_ps();
  // row i's pair at rows3[i / 3] + (i % 3)·L: a pointer for each three rows, so that the addresses fit the registers
  const int64_t L = ldw * 2;
  const char* rows3[R / 3];
  for (int g = 0; g < R / 3; ++g) rows3[g] = reinterpret_cast<const char*>(w) + 3 * g * L;
  for (int64_t k0 = 0; k0 < kc; k0 += 32) {
    if (next) {                                 // a line of each of the next block's rows, 32 inputs on
      const char* at = reinterpret_cast<const char*>(next + k0);
      for (int i = 0; i < R; ++i, at += L) _mm_prefetch(at, _MM_HINT_T0);
    }
    const int64_t k1 = std::min<int64_t>(kc, k0 + 32);
    for (int64_t k = k0; k < k1; k += 2) {
      const __m512bh x0 = (__m512bh)_mm512_load_si512(xp + k * 32), x1 = (__m512bh)_mm512_load_si512(xp + k * 32 + 32);
#pragma GCC unroll 12
      for (int i = 0; i < R; ++i) {
        int32_t pair;
        std::memcpy(&pair, rows3[i / 3] + (i % 3) * L + 2 * k, 4);
        const __m512bh s = (__m512bh)_mm512_set1_epi32(pair);
        a[i] = _mm512_dpbf16_ps(a[i], s, x0);
        b[i] = _mm512_dpbf16_ps(b[i], s, x1);
      }
    }
  }
  store_tile_x32<R>(a, b, y, ldy, rows, accumulate);
}

// The MLP's activations in place of a product's output: W holds gate's rows then up's, and act (M, N / 2) receives
// gated(gate, up), which is never written out
struct GatedOut {
  float* act;
  bool bf16;
};

// The AMX tile configuration (8 tiles of 16 rows of 64 bytes): the thread's, which torch's oneDNN sets too, so a
// thread loads it before its share of a product's tiles and releases the tiles after (TileAMX::begin, end). A constant:
// as a local filled in before ldtilecfg, GCC dropped the stores it did not see the instruction read.
struct alignas(64) AmxConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t tile_rows[16];
};
alignas(64) constexpr AmxConfig kAmxConfig = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64},
                                              {16, 16, 16, 16, 16, 16, 16, 16}};

__attribute__((target(LLMINFER_AVX512 ",amx-tile,amx-bf16"))) void amx_begin() { _tile_loadconfig(&kAmxConfig); }

__attribute__((target(LLMINFER_AVX512 ",amx-tile,amx-bf16"))) void amx_end() { _tile_release(); }

// AMX: 32 bfloat16 rows of w (`ldw` elements apart, read in place as two 16-row A tiles: rows 0-15, and the 16 rows
// `upper` rows on) by 32 tokens of xp (the bfloat16 tile's packed pairs: 16 pairs by 16 tokens is a B tile as it
// lies) into 4 C tiles of 16 x 16 float32 (row, token), 32 inputs a step; each C tile transposed in registers and
// stored a token at a time (y, rows `ldy` apart). With `gate`, the first 16 rows are gate rows and the other 16 their
// up rows (`upper` = the MLP's width): SwiGLU of each pair of C tiles as they lie, then one transpose, into gate->act.
__attribute__((target(LLMINFER_AVX512 ",amx-tile,amx-bf16"))) void gemm_tile_x32_amx(
    const uint16_t* w, int64_t ldw, int64_t upper, const uint16_t* xp, int64_t kc, float* y, int64_t ldy,
    int64_t rows, bool accumulate, const GatedOut* gate) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t stride = ldw * 2;
  for (int64_t k = 0; k < kc; k += 32) {
    _tile_loadd(4, w + k, stride);
    _tile_loadd(5, w + upper * ldw + k, stride);
    _tile_loadd(6, xp + k * 32, 128);
    _tile_loadd(7, xp + k * 32 + 32, 128);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c[4][16 * 16];
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
  if (gate) {
    for (int h = 0; h < 2; ++h) {                 // tokens 16 * h on: gate rows in c[h], their up rows in c[h + 2]
      const int64_t j0 = 16 * h, n = std::min<int64_t>(16, rows - j0);
      if (n <= 0) continue;
      __m512 r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = V16::gated(_mm512_load_ps(c[h] + 16 * i), _mm512_load_ps(c[h + 2] + 16 * i), gate->bf16);
      transpose16(r);                             // r[j]: token j0 + j's 16 activations
      for (int64_t j = 0; j < n; ++j) _mm512_storeu_ps(y + (j0 + j) * ldy, r[j]);
    }
    return;
  }
  for (int q = 0; q < 4; ++q) {                  // q: rows 16 * (q / 2) on, tokens 16 * (q % 2) on
    const int64_t j0 = 16 * (q % 2), n = std::min<int64_t>(16, rows - j0);
    if (n <= 0) continue;
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(c[q] + 16 * i);
    transpose16(r);                              // r[j]: token j0 + j's 16 rows
    float* out = y + j0 * ldy + 16 * (q / 2);
    for (int64_t j = 0; j < n; ++j) {
      const __m512 v = accumulate ? _mm512_add_ps(_mm512_loadu_ps(out + j * ldy), r[j]) : r[j];
      _mm512_storeu_ps(out + j * ldy, v);
    }
  }
}

// Tokens [0, rows) of x (rows <= 32, K inputs, bfloat16 values held as float32) as a packed tile of the bfloat16
// kernel: word [pair][j] holds inputs 2·pair and 2·pair + 1 of token j. 16 pairs of 16 tokens at a time: each token's
// 32 inputs made 16 words by vcvtne2ps2bf16 (exact on bfloat16 values), then transposed in registers. Returns false,
// the tile unfinished, where an input is not a bfloat16 value.
__attribute__((target(LLMINFER_AVX512 ",avx512bf16"))) bool pack_bf16_pairs(const float* src, int64_t rows,
                                                                              int64_t K, uint32_t* words) {
  const int64_t pairs = K / 2, whole = pairs - pairs % 16;
  __m512i low = _mm512_setzero_si512();                      // every input's low 16 bits, or-ed
  for (int64_t j0 = 0; j0 < rows; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, rows - j0);
    for (int64_t p0 = 0; p0 < whole; p0 += 16) {
      __m512 r[16];
      for (int64_t j = 0; j < 16; ++j) {
        if (j >= n) {
          r[j] = _mm512_setzero_ps();
          continue;
        }
        const float* at = src + (j0 + j) * K + 2 * p0;
        const __m512 a = _mm512_loadu_ps(at), b = _mm512_loadu_ps(at + 16);
        low = _mm512_or_si512(low, _mm512_or_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)));
        r[j] = _mm512_castsi512_ps((__m512i)_mm512_cvtne2ps_pbh(b, a));
      }
      transpose16(r);
      for (int64_t i = 0; i < 16; ++i) _mm512_storeu_ps(reinterpret_cast<float*>(words + (p0 + i) * 32 + j0), r[i]);
    }
  }
  if (_mm512_test_epi32_mask(low, _mm512_set1_epi32(0xFFFF))) return false;
  for (int64_t pair = whole; pair < pairs; ++pair)           // the last pairs, a word at a time
    for (int64_t j = 0; j < rows; ++j) {
      uint32_t a, b;
      std::memcpy(&a, src + j * K + 2 * pair, 4);
      std::memcpy(&b, src + j * K + 2 * pair + 1, 4);
      if ((a | b) & 0xFFFFu) return false;
      words[pair * 32 + j] = (a >> 16) | (b & 0xFFFF0000u);
    }
  return true;
}

// Four blocks of 12 valid floats, 16 apart, as three vectors of 16 (a block's 12, then the next's first 4, ...)
struct Packed48 {
  __m512 v[3];
};
LLMINFER_ON_AVX512 inline Packed48 pack48(__m512 a, __m512 b, __m512 c, __m512 e) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19);
  const __m512i second = _mm512_setr_epi32(4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i third = _mm512_setr_epi32(8, 9, 10, 11, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27);
  return {{_mm512_permutex2var_ps(a, first, b), _mm512_permutex2var_ps(b, second, c),
           _mm512_permutex2var_ps(c, third, e)}};
}

// The outputs of 4 blocks of 12 rows of W for M tokens, each token's 4 × 12 held 16 floats apart (`panel`, 64 floats
// a token), written to y's 48 columns (rows `ldy` apart), three 16-float vectors a token
LLMINFER_ON_AVX512 void panel_out(const float* panel, int64_t M, float* y, int64_t ldy) {
  for (int64_t m = 0; m < M; ++m) {
    const float* p = panel + m * 64;
    const Packed48 o = pack48(_mm512_load_ps(p), _mm512_load_ps(p + 16), _mm512_load_ps(p + 32),
                              _mm512_load_ps(p + 48));
    for (int i = 0; i < 3; ++i) _mm512_storeu_ps(y + m * ldy + 16 * i, o.v[i]);
  }
}

// SwiGLU of a panel's outputs (`panel_out`'s layout), where its 4 blocks are 24 gate rows then their 24 up rows: each
// token's 24 activations into act, rows `lda` apart, two tokens (three vectors of gates and of ups) at a time
LLMINFER_ON_AVX512 void panel_gated(const float* panel, int64_t M, bool bf16, float* act, int64_t lda) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) {
    const float *p = panel + m * 64, *q = p + 64;
    const Packed48 g = pack48(_mm512_load_ps(p), _mm512_load_ps(p + 16), _mm512_load_ps(q), _mm512_load_ps(q + 16));
    const Packed48 u = pack48(_mm512_load_ps(p + 32), _mm512_load_ps(p + 48), _mm512_load_ps(q + 32),
                              _mm512_load_ps(q + 48));
    const __m512 a0 = V16::gated(g.v[0], u.v[0], bf16), a1 = V16::gated(g.v[1], u.v[1], bf16),
                 a2 = V16::gated(g.v[2], u.v[2], bf16);
    float *d = act + m * lda, *e = d + lda;                  // token m's 24, then token m + 1's
    _mm512_storeu_ps(d, a0);
    _mm256_storeu_ps(d + 16, _mm512_castps512_ps256(a1));
    _mm256_storeu_ps(e, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a1), 1)));
    _mm512_storeu_ps(e + 8, a2);
  }
  if (m < M) {                                               // an odd last token
    alignas(64) float g[32] = {}, u[32] = {}, out[32];
    const float* p = panel + m * 64;
    std::memcpy(g, p, 48), std::memcpy(g + 12, p + 16, 48);
    std::memcpy(u, p + 32, 48), std::memcpy(u + 12, p + 48, 48);
    for (int i = 0; i < 2; ++i)
      _mm512_store_ps(out + 16 * i, V16::gated(_mm512_load_ps(g + 16 * i), _mm512_load_ps(u + 16 * i), bf16));
    std::memcpy(act + m * lda, out, 24 * sizeof(float));
  }
}

// The tile kernels, as the driver below takes them: tokens a tile, the element type of packed x and of the rows of
// W the tile reads (kPair inputs a packed step: 1 for float32, 2 for bfloat16 pairs); begin() and end() bracket a
// thread's share of a product (AMX: the tile configuration)
struct TileNoSetup {
  static void begin() {}
  static void end() {}
};
struct TileAVX2 : TileNoSetup {
  using T = float;
  static constexpr int64_t kTokens = 16, kPair = 1, kRows = 6;
  static void tile(const T* w, int64_t ldw, const T* xp, int64_t kc, float* y, int64_t ldy, int64_t rows, bool acc,
                   const Ahead& ahead) {
    gemm_tile_6x16(w, ldw, xp, kc, y, ldy, rows, acc, ahead);
  }
};
struct TileAVX512 : TileNoSetup {
  using T = float;
  static constexpr int64_t kTokens = 64, kPair = 1, kRows = 6;
  static void tile(const T* w, int64_t ldw, const T* xp, int64_t kc, float* y, int64_t ldy, int64_t rows, bool acc,
                   const Ahead& ahead) {
    gemm_tile_avx512<6, 4>(w, ldw, xp, kc, y, ldy, rows, acc, ahead);
  }
};
struct TileBF16DP : TileNoSetup {
  using T = uint16_t;
  static constexpr int64_t kTokens = 32, kPair = 2, kRows = 12;
  static void tile(const T* w, int64_t ldw, const T* xp, int64_t kc, float* y, int64_t ldy, int64_t rows, bool acc,
                   const Ahead& ahead) {
    gemm_tile_x32_bf16dp<12>(w, ldw, xp, kc, y, ldy, rows, acc, reinterpret_cast<const uint16_t*>(ahead.p));
  }
};
struct TileAMX {                                // the bfloat16 tile's packed x, by AMX tiles 32 rows at a time
  using T = uint16_t;
  static constexpr int64_t kTokens = 32, kPair = 2, kRows = 32;
  static void begin() { amx_begin(); }
  static void end() { amx_end(); }
  static void tile(const T* w, int64_t ldw, const T* xp, int64_t kc, float* y, int64_t ldy, int64_t rows, bool acc,
                   const Ahead&) {
    gemm_tile_x32_amx(w, ldw, 16, xp, kc, y, ldy, rows, acc, nullptr);
  }
  // 16 gate rows at w and their 16 up rows `hidden` rows on: SwiGLU's activations into act (rows `lda` apart)
  static void gated(const T* w, int64_t ldw, int64_t hidden, const T* xp, int64_t kc, const GatedOut& gate,
                    float* act, int64_t lda, int64_t rows) {
    gemm_tile_x32_amx(w, ldw, hidden, xp, kc, act, lda, rows, false, &gate);
  }
};

// The next block's rows n .. n + r - 1 of W, inputs [k0, k0 + kc), where they lie as stored
Ahead block_ahead(const Weight& W, int64_t n, int64_t r, int64_t k0, int64_t kc) {
  const int64_t K = W.K;
  const char* w = static_cast<const char*>(W.w);
  if (W.format == Weight::I4)                    // the tiles of 8 rows that hold them, 4 bytes an input
    return Ahead{w + (n / 8) * (K / 8) * 32 + k0 * 4, (K / 8) * 32, kc * 4, (n + r - 1) / 8 - n / 8 + 1};
  const int64_t size = W.format == Weight::F32 ? 4 : W.format == Weight::BF16 ? 2 : 1;
  return Ahead{w + (n * K + k0) * size, K * size, kc * size, r};
}

template <class T>
struct AlignedBuffer {
  T* data = nullptr;
  explicit AlignedBuffer(size_t n) {
    data = static_cast<T*>(std::aligned_alloc(64, std::max<size_t>(64, ((n * sizeof(T) + 63) / 64) * 64)));
    TORCH_CHECK(data != nullptr, "llminfer: out of memory for ", n, " elements of ", sizeof(T), " bytes");
  }
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
};

// The calling thread's buffer for packed x, kept between products up to kScratchBytes (fresh pages each product
// were zeroed by the kernel at first touch); larger ones are allocated per product
constexpr size_t kScratchBytes = size_t(16) << 20;

struct PackedX {
  std::unique_ptr<AlignedBuffer<char>> own;     // a product too large for the kept buffer
  void* data;
  explicit PackedX(size_t bytes) {
    thread_local std::unique_ptr<AlignedBuffer<char>> kept;
    thread_local size_t kept_bytes = 0;
    if (bytes > kScratchBytes) {
      own = std::make_unique<AlignedBuffer<char>>(bytes);
    } else if (bytes > kept_bytes) {
      kept.reset();
      kept = std::make_unique<AlignedBuffer<char>>(bytes), kept_bytes = bytes;
    }
    data = own ? own->data : kept->data;
  }
};

// y (M, N) = x (M, K) · Wᵀ by tiles of `Tile`: x packed once (tile t: element (k, j) at [k / P][j][k % P]), W read in
// place where the tile takes its format as it is and widened (or copied) a block of rows at a time otherwise. Returns
// false, having computed nothing, where the bfloat16 tile finds an input of x that is not a bfloat16 value. With
// `gate`, SwiGLU's activations instead of y (null), where the tile's panels (or AMX tiles, 16 gate rows and their up
// rows a block) take every row (else false, nothing computed).
template <class Tile>
bool gemm_blocked(const float* x, int64_t M, const Weight& W, float* y, const GatedOut* gate = nullptr) {
  using T = typename Tile::T;
  constexpr int64_t TT = Tile::kTokens, P = Tile::kPair, RW = Tile::kRows;
  constexpr bool kBF16 = std::is_same_v<T, uint16_t>;
  const int64_t N = W.N, K = W.K;
  const int64_t tiles = (M + TT - 1) / TT;
  const bool in_place = kBF16 ? W.format == Weight::BF16 : W.format == Weight::F32;
  const int64_t hidden = N / 2;
  const int64_t group = gemm_token_group(M, N, K, TT, sizeof(T));
  if (group < M) {                               // the tokens in groups, one after the other
    for (int64_t g0 = 0; g0 < M; g0 += group) {
      const GatedOut part{gate ? gate->act + g0 * hidden : nullptr, gate && gate->bf16};
      if (!gemm_blocked<Tile>(x + g0 * K, std::min(group, M - g0), W, y ? y + g0 * N : nullptr,
                              gate ? &part : nullptr))
        return false;
    }
    return true;
  }
  const int64_t chunk = gemm_chunk(M, K, TT, sizeof(T));
  // SwiGLU by AMX tiles: block b is the 16 gate rows from 16·b and their 16 up rows, in one chunk
  constexpr bool kAMX = std::is_same_v<Tile, TileAMX>;
  const bool amx_gate = kAMX && gate != nullptr;
  if (amx_gate && !(in_place && N % 2 == 0 && hidden % 16 == 0 && chunk >= K)) return false;
  const int64_t blocks = amx_gate ? hidden / 16 : (N + RW - 1) / RW;   // the last may hold fewer than RW rows
  // the bfloat16 tile, in one chunk, stores into a thread's panel (4 blocks of outputs) that panel_out writes to y
  const bool panels = kBF16 && RW == 12 && TT == 32 && chunk >= K;
  // SwiGLU from the panels: a group of 4 blocks is 24 gate rows and the same 24 up rows (never written out)
  if (gate && !amx_gate && !(panels && in_place && N % (4 * RW) == 0)) return false;
  // block b's first row of W: the next RW rows, or with `gate` gate's or up's rows of the group b / 4
  const auto first_row = [&](int64_t b) {
    if (amx_gate) return 16 * b;
    return gate ? (b % 4 >= 2 ? hidden : 0) + b / 4 * 2 * RW + b % 2 * RW : b * RW;
  };
  PackedX packed(static_cast<size_t>(tiles * K * TT) * sizeof(T));
  T* xp = static_cast<T*>(packed.data);
  std::atomic<bool> exact{true};
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      T* dst = xp + t * K * TT;
      const int64_t rows = std::min<int64_t>(TT, M - t * TT);
      if (rows < TT) std::fill(dst, dst + K * TT, T(0));
      const float* src = x + t * TT * K;
      if constexpr (kBF16) {
        if (!pack_bf16_pairs(src, rows, K, reinterpret_cast<uint32_t*>(dst))) exact = false;
      } else {
        int64_t k = 0;
        if (has_avx2() && rows % 8 == 0)         // 8 tokens by 8 inputs at a time, transposed in registers
          for (; k + 8 <= K; k += 8)
            for (int64_t j = 0; j < rows; j += 8) transpose8x8(src + j * K + k, K, dst + k * TT + j, TT);
        for (; k < K; ++k)                       // written in order, read from the tile's rows at once
          for (int64_t j = 0; j < rows; ++j) dst[k * TT + j] = src[j * K + k];
      }
    }
  });
  if (!exact) return false;
  // with panels the threads take whole groups of 4 blocks
  const int64_t unit = panels ? 4 : 1;
  at::parallel_for(0, (blocks + unit - 1) / unit, 1, [&](int64_t u0, int64_t u1) {
    const int64_t b0 = u0 * unit, b1 = std::min(blocks, u1 * unit);
    AlignedBuffer<T> wide(static_cast<size_t>(RW * chunk));
    AlignedBuffer<float> panel(panels ? static_cast<size_t>(tiles * TT * 64) : 1);
    alignas(64) float part[TT * RW];
    Tile::begin();
    for (int64_t k0 = 0; k0 < K; k0 += chunk) {
      const int64_t kc = std::min<int64_t>(chunk, K - k0);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n = first_row(b), r = amx_gate ? RW : std::min<int64_t>(RW, N - n);
        const T* rows_of_w = wide.data;
        int64_t ldw = kc;
        // the rows of this thread's next block, for the first token tile to fetch ahead
        const Ahead next = b + 1 < b1 && first_row(b + 1) + RW <= N
                               ? block_ahead(W, first_row(b + 1), RW, k0, kc) : Ahead{};
        if (in_place && r == RW) {
          rows_of_w = static_cast<const T*>(W.w) + n * K + k0;
          ldw = K;
        } else {
          if constexpr (kBF16) {                   // (the bfloat16 tile takes bfloat16 weights only)
            for (int64_t i = 0; i < r; ++i)
              std::memcpy(wide.data + i * kc, static_cast<const uint16_t*>(W.w) + (n + i) * K + k0, kc * 2);
          } else {
            if (std::is_same_v<Tile, TileAVX512> && W.format == Weight::I4)
              widen_int4_tiles_avx512(W, n, r, k0, kc, wide.data);
            else
              widen_rows(W, n, r, k0, kc, wide.data);
          }
          std::fill(wide.data + r * kc, wide.data + RW * kc, T(0));
        }
        const int64_t g0 = b0 + (b - b0) / 4 * 4;      // this block's group of 4, from the thread's first block
        const bool grouped = panels && g0 + 4 <= b1 && (g0 + 4) * RW <= N;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t rows = std::min<int64_t>(TT, M - t * TT);
          const T* xt = xp + (t * K + k0) * TT;
          if constexpr (kAMX) {
            if (amx_gate) {                       // (y is null: the activations go to gate->act)
              Tile::gated(rows_of_w, ldw, hidden, xt, kc, *gate, gate->act + t * TT * hidden + n, hidden, rows);
              continue;
            }
          }
          float* yt = y + t * TT * N + n;
          if (grouped) {
            Tile::tile(rows_of_w, ldw, xt, kc, panel.data + t * TT * 64 + (b - g0) * 16, 64, rows, false,
                       t == 0 ? next : Ahead{});
          } else if (r == RW) {
            Tile::tile(rows_of_w, ldw, xt, kc, yt, N, rows, k0 > 0, t == 0 ? next : Ahead{});
          } else {                                // the last rows of W: through a small buffer
            Tile::tile(rows_of_w, ldw, xt, kc, part, RW, rows, false, Ahead{});
            for (int64_t j = 0; j < rows; ++j)
              for (int64_t i = 0; i < r; ++i)
                yt[j * N + i] = (k0 > 0 ? yt[j * N + i] : 0.f) + part[j * RW + i];
          }
        }
        if (grouped && b - g0 == 3) {
          if (gate) panel_gated(panel.data, M, gate->bf16, gate->act + g0 / 4 * 2 * RW, hidden);
          else panel_out(panel.data, M, y + g0 * RW, N);
        }
      }
    }
    Tile::end();
  });
  return true;
}

void gemm_blocked(const float* x, int64_t M, const Weight& W, float* y) {
  const int64_t bits = features();
  if (W.format == Weight::BF16 && (bits & kAMXBF16) && W.K % 32 == 0 && gemm_blocked<TileAMX>(x, M, W, y)) return;
  if (W.format == Weight::BF16 && (bits & kAVX512BF16) && W.K % 2 == 0 && gemm_blocked<TileBF16DP>(x, M, W, y)) return;
  if (bits & kAVX512) {
    gemm_blocked<TileAVX512>(x, M, W, y);
    return;
  }
  gemm_blocked<TileAVX2>(x, M, W, y);
}

bool gemm_blocked_gated(const float* x, int64_t M, const Weight& W, bool bf16, float* act) {
  const GatedOut gate{act, bf16};
  if (W.format != Weight::BF16) return false;
  // the tiles gemm_blocked takes for these weights: AMX's where the CPU has them and K fits them, else vdpbf16ps
  if ((features() & kAMXBF16) && W.K % 32 == 0) return gemm_blocked<TileAMX>(x, M, W, nullptr, &gate);
  return (features() & kAVX512BF16) && W.K % 2 == 0 && gemm_blocked<TileBF16DP>(x, M, W, nullptr, &gate);
}
#endif

}  // namespace llminfer_cpu

// Shared by the native CPU kernels, one torch extension built from several units. Chapter 08, Appendix A1.
//
//   cpu_ref.cpp        ref::     the portable reference of each product loop (plain C++, any CPU)
//   cpu_vec.h                    the loops written once over the vector type (V8, V16), included by:
//   cpu_avx2.cpp       avx2::    AVX2 + FMA, 8 floats a register
//   cpu_avx512.cpp     avx512::  AVX-512, 16 floats (and VNNI's int8 dot products); avx512_bf16:: (vdpbf16ps)
//   cpu_matvec.cpp     y = x · Wᵀ for a few rows of x: the instruction sets in use and the dispatch to those loops
//   cpu_gemm.cpp       the blocked matrix multiply for many rows of x (a prefill, a large batch)
//   cpu_attention.cpp  attention against a K/V cache read in place, contiguous or paged
//   cpu_layers.cpp     a prepared layer stack, one call a step over contiguous or paged K/V
//   cpu_ops.cpp        the ops' schemas, registered with torch

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LLMINFER_X86 1
#endif

namespace llminfer_cpu {

enum class WKind { F32, BF16, I8 };

template <WKind kind>
inline float weight_at(const void* w, int64_t i) {
  if constexpr (kind == WKind::F32) {
    return static_cast<const float*>(w)[i];
  } else if constexpr (kind == WKind::BF16) {
    uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(w)[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return static_cast<float>(static_cast<const int8_t*>(w)[i]);
  }
}

// Whether every one of n floats is a bfloat16 value (its low 16 bits zero): then rounding x to bfloat16, as the
// vdpbf16ps loops do, changes nothing, so no path rounds x behind the caller's back.
inline bool bfloat16_exact(const float* x, int64_t n) {
  uint32_t low = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, 4);
    low |= bits & 0xFFFFu;
  }
  return low == 0;
}

template <WKind kind>
constexpr int64_t wbytes() { return kind == WKind::F32 ? 4 : kind == WKind::BF16 ? 2 : 1; }

// The instruction sets the kernels may use in this process: set once, before the first product, by
// llminfer/cpu/__init__.py (the op set_cpu_features) from the CPU's flags or LLMINFER_ISA, each bit checked against
// the CPU itself; until then the AVX2 + FMA loops run where the CPU has them.
enum Feature : int64_t {
  kAVX2 = 1,          // AVX2 + FMA: 8-lane float loops, maddubs/madd integer dot products
  kAVX512 = 2,        // AVX-512 F/BW/VL: 16-lane float loops
  kAVX512VNNI = 4,    // vpdpbusd: int8 dot products in one instruction
  kAVX512BF16 = 8,    // vdpbf16ps: bfloat16 pairs multiplied and added into float32
  kAMXBF16 = 32,      // AMX tiles with AMX-BF16: a prefill's bfloat16 products (the OS grants the tile state)
};
int64_t features();
inline bool has(Feature f) { return (features() & f) != 0; }
inline bool has_avx2() { return has(kAVX2); }

// Each weight format's decode loops may run a lower level than the process's own: the level the static table
// DECODE_LOOPS (llminfer/cpu/__init__.py) names for the CPU's class. Everything else runs the process's own level.
enum MatvecKind : int64_t { kMatvecF32 = 0, kMatvecBF16, kMatvecI8, kMatvecI4, kMatvecI4A8, kMatvecKinds };
int64_t matvec_features(int64_t kind);   // the bits the loops for weights of `kind` run
// Sets the features and each format's decode loops' bits (by MatvecKind; empty: the process's own); returns the bits
// the CPU, or the features for a format's loops, lack (nothing is set then)
int64_t set_features(int64_t bits, const std::vector<int64_t>& decode);

#ifdef LLMINFER_X86
#define LLMINFER_AVX2 "avx2,fma"
#define LLMINFER_AVX512 "avx2,fma,avx512f,avx512bw,avx512vl"   // the target of the 16-lane loops
#define LLMINFER_ON_AVX2 __attribute__((target(LLMINFER_AVX2)))
#define LLMINFER_ON_AVX512 __attribute__((target(LLMINFER_AVX512)))

template <WKind kind>
LLMINFER_ON_AVX2 inline __m256 wload8(const void* w, int64_t i) {
  if constexpr (kind == WKind::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(w) + i);
  } else if constexpr (kind == WKind::BF16) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(w) + i));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
}

template <WKind kind>
LLMINFER_ON_AVX512 inline __m512 wload16(const void* w, int64_t i) {
  if constexpr (kind == WKind::F32) {
    return _mm512_loadu_ps(static_cast<const float*>(w) + i);
  } else if constexpr (kind == WKind::BF16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(w) + i));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
}

LLMINFER_ON_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
LLMINFER_ON_AVX512 inline float hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }
// the two 256-bit halves of v added
LLMINFER_ON_AVX512 inline __m256 halves_sum(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
// [Σ a, Σ b, Σ c, Σ d]: 8 lanes by hsum8 each; 16 lanes in one tree of adds
LLMINFER_ON_AVX2 inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  return _mm_setr_ps(hsum8(a), hsum8(b), hsum8(c), hsum8(d));
}
LLMINFER_ON_AVX512 inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(halves_sum(a), halves_sum(b)),
                                  _mm256_hadd_ps(halves_sum(c), halves_sum(d)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// The vector width a loop is written over, once, as a macro: V8 is AVX2 + FMA (8 floats a register), V16 AVX-512
// (16), the same operations under the same names. exp is the Cephes polynomial (relative error about 1e-7);
// bf16_round rounds as c10::BFloat16 does (to nearest, ties to even; a NaN to 0x7FC0), still float32; gated is
// silu(g)·u, rounded as the bfloat16 modules round where bf16 (gated() in cpu_layers.cpp).
#define LLMINFER_VEC(NAME, F, I, LANES, TARGET, SFX, HSUM, WLOAD, FLOOR, NAN_AS)                               \
  struct NAME {                                                                                               \
    using Vec = F;                                                                                            \
    static constexpr int64_t kLanes = LANES;                                                                  \
    __attribute__((target(TARGET))) static F zero() { return _mm##SFX##_setzero_ps(); }                        \
    __attribute__((target(TARGET))) static F set1(float v) { return _mm##SFX##_set1_ps(v); }                   \
    __attribute__((target(TARGET))) static F load(const float* p) { return _mm##SFX##_loadu_ps(p); }           \
    __attribute__((target(TARGET))) static void store(float* p, F v) { _mm##SFX##_storeu_ps(p, v); }           \
    __attribute__((target(TARGET))) static F add(F a, F b) { return _mm##SFX##_add_ps(a, b); }                 \
    __attribute__((target(TARGET))) static F sub(F a, F b) { return _mm##SFX##_sub_ps(a, b); }                 \
    __attribute__((target(TARGET))) static F mul(F a, F b) { return _mm##SFX##_mul_ps(a, b); }                 \
    __attribute__((target(TARGET))) static F fmadd(F a, F b, F c) { return _mm##SFX##_fmadd_ps(a, b, c); }     \
    __attribute__((target(TARGET))) static float hsum(F v) { return HSUM(v); }                                 \
    template <WKind kind>                                                                                     \
    __attribute__((target(TARGET))) static F wload(const void* w, int64_t i) { return WLOAD<kind>(w, i); }     \
    __attribute__((target(TARGET))) static F exp(F x) {                                                        \
      x = _mm##SFX##_max_ps(_mm##SFX##_min_ps(x, set1(88.3762626647949f)), set1(-88.3762626647949f));         \
      const F fx = FLOOR(fmadd(x, set1(1.44269504088896341f), set1(0.5f)));                                    \
      x = _mm##SFX##_fnmadd_ps(fx, set1(0.693359375f), x);                                                     \
      x = _mm##SFX##_fnmadd_ps(fx, set1(-2.12194440e-4f), x);                                                  \
      F y = set1(1.9875691500e-4f);                                                                            \
      y = fmadd(y, x, set1(1.3981999507e-3f));                                                                 \
      y = fmadd(y, x, set1(8.3334519073e-3f));                                                                 \
      y = fmadd(y, x, set1(4.1665795894e-2f));                                                                 \
      y = fmadd(y, x, set1(1.6666665459e-1f));                                                                 \
      y = fmadd(y, x, set1(5.0000001201e-1f));                                                                 \
      y = fmadd(y, mul(x, x), add(x, set1(1.f)));                                                              \
      const I n = _mm##SFX##_slli_epi32(                                                                       \
          _mm##SFX##_add_epi32(_mm##SFX##_cvttps_epi32(fx), _mm##SFX##_set1_epi32(127)), 23);                  \
      return mul(y, _mm##SFX##_castsi##SFX##_ps(n));                                                           \
    }                                                                                                         \
    __attribute__((target(TARGET))) static F bf16_round(F v) {                                                 \
      const I bits = _mm##SFX##_castps_si##SFX(v), one = _mm##SFX##_set1_epi32(1);                              \
      const I up = _mm##SFX##_add_epi32(bits, _mm##SFX##_add_epi32(                                            \
          _mm##SFX##_and_si##SFX(_mm##SFX##_srli_epi32(bits, 16), one), _mm##SFX##_set1_epi32(0x7FFF)));      \
      const I rounded = _mm##SFX##_and_si##SFX(up, _mm##SFX##_set1_epi32(static_cast<int>(0xFFFF0000u)));      \
      return NAN_AS(v, _mm##SFX##_castsi##SFX##_ps(rounded),                                                   \
                    _mm##SFX##_castsi##SFX##_ps(_mm##SFX##_set1_epi32(0x7FC00000)));                           \
    }                                                                                                         \
    __attribute__((target(TARGET))) static F gated(F g, F u, bool bf16) {                                      \
      const F v = bf16 ? bf16_round(g) : g;                                                                    \
      const F a = _mm##SFX##_div_ps(v, add(set1(1.f), exp(sub(zero(), v))));                                   \
      return bf16 ? bf16_round(mul(bf16_round(a), bf16_round(u))) : mul(a, u);                                 \
    }                                                                                                         \
    /* p[0..n) rounded to bfloat16 (gated(g, u) into out), kLanes at a time; each returns how far it got */    \
    __attribute__((target(TARGET))) static int64_t round_row(float* p, int64_t n) {                            \
      int64_t i = 0;                                                                                          \
      for (; i + LANES <= n; i += LANES) store(p + i, bf16_round(load(p + i)));                                \
      return i;                                                                                               \
    }                                                                                                         \
    __attribute__((target(TARGET))) static int64_t gated_row(const float* g, const float* u, int64_t n,         \
                                                             bool bf16, float* out) {                         \
      int64_t i = 0;                                                                                          \
      for (; i + LANES <= n; i += LANES) store(out + i, gated(load(g + i), load(u + i), bf16));                \
      return i;                                                                                               \
    }                                                                                                         \
  };
#define LLMINFER_NAN8(v, r, nan) _mm256_blendv_ps(r, nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q))
#define LLMINFER_NAN16(v, r, nan) _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan)
#define LLMINFER_FLOOR16(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
LLMINFER_VEC(V8, __m256, __m256i, 8, LLMINFER_AVX2, 256, hsum8, wload8, _mm256_floor_ps, LLMINFER_NAN8)
LLMINFER_VEC(V16, __m512, __m512i, 16, LLMINFER_AVX512, 512, hsum16, wload16, LLMINFER_FLOOR16, LLMINFER_NAN16)
#undef LLMINFER_VEC
#undef LLMINFER_NAN8
#undef LLMINFER_NAN16
#undef LLMINFER_FLOOR16

// r[i] <- column i of the 16 x 16 block of 32-bit lanes whose row j is r[j]
// the 64-bit lanes of a and b interleaved: the low ones of each 128-bit lane (pd_lo), or the high ones (pd_hi)
LLMINFER_ON_AVX512 inline __m512 pd_lo(__m512 a, __m512 b) {
  return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}
LLMINFER_ON_AVX512 inline __m512 pd_hi(__m512 a, __m512 b) {
  return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}

LLMINFER_ON_AVX512 inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {                          // pairs of rows interleaved
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {                          // then fours: a 128-bit lane holds a column of 4 rows
    r[g] = pd_lo(t[g], t[g + 2]), r[g + 1] = pd_hi(t[g], t[g + 2]);
    r[g + 2] = pd_lo(t[g + 1], t[g + 3]), r[g + 3] = pd_hi(t[g + 1], t[g + 3]);
  }
  for (int m = 0; m < 4; ++m) {                              // then the four groups of rows' 128-bit lanes gathered
    const __m512 v = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x88), v2 = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xDD);
    const __m512 w = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x88), w2 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xDD);
    t[m] = _mm512_shuffle_f32x4(v, w, 0x88), t[8 + m] = _mm512_shuffle_f32x4(v, w, 0xDD);
    t[4 + m] = _mm512_shuffle_f32x4(v2, w2, 0x88), t[12 + m] = _mm512_shuffle_f32x4(v2, w2, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#endif

// The scale and offset of each group of an int4 weight in tiles: float32, or float16 (as GGUF's Q4_0 and Q4_1 store
// theirs: a group of 32 weights in 20 bytes rather than 24)
struct Terms {
  const void* scale = nullptr;
  const void* offset = nullptr;
  bool half = false;
};

// entry i of a scale or offset table
inline float term_at(const void* p, bool half, int64_t i) {
  return half ? static_cast<float>(c10::Half(static_cast<const uint16_t*>(p)[i], c10::Half::from_bits()))
              : static_cast<const float*>(p)[i];
}
#ifdef LLMINFER_X86
// entries i..i+7 (one vcvtph2ps for float16: F16C, which the avx2 level requires)
__attribute__((target("avx2,fma,f16c"))) inline __m256 terms8(const void* p, bool half, int64_t i) {
  return half ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)))
              : _mm256_loadu_ps(static_cast<const float*>(p) + i);
}
// entry i, by one vcvtph2ps for float16
__attribute__((target("f16c"))) inline float term_f16c(const void* p, bool half, int64_t i) {
  return half ? _cvtsh_ss(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}
// entry i of both tables (and the 8 after it, one line) into the cache ahead of use
inline void prefetch_terms(const Terms& t, int64_t i) {
  const int64_t bytes = t.half ? 2 : 4;
  _mm_prefetch(static_cast<const char*>(t.scale) + i * bytes, _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(t.offset) + i * bytes, _MM_HINT_T0);
}
#endif

// one weight matrix in any of the four formats
struct Weight {
  enum Format { F32, BF16, I8, I4 } format;
  const void* w;
  const float* scale = nullptr;    // int8: (N, K / group), group = K for one scale a row
  int64_t N = 0, K = 0, group = 0;
  bool int8_activations = false;   // int4 only: x rounded to int8 per block of 32, integer dot products (W4A8)
  Terms terms;                     // int4 (codes (N/8, K/8, 32) in tiles of 8 rows): scale, offset (N/8, G, 8)
};

// A linear given as its parts, checked (`op` names the caller in errors): [weight] (float32 or bfloat16), [codes,
// scale] (int8, a scale a row or (N, K/group)) or [codes, scale, offset] (int4 in tiles of 8 rows: (N/8, K/8, 32)
// codes with (N/8, K/group, 8) scales and offsets; group 0: read from their shape), with float activations until the
// caller sets int8_activations.
Weight weight_from_parts(at::TensorList parts, const char* op, int64_t group = 0);

// The threads of a decode step's one parallel region (run_layers): this is thread `id` of `size`. A loop given a
// Team runs only this thread's share of its range; a loop given none splits it over torch's threads itself.
struct Team {
  int64_t id, size;
};

// fn(a, b) over [begin, end): this thread's share where there is a team, else split over torch's threads
template <typename Fn>
void split_range(const Team* team, int64_t begin, int64_t end, int64_t grain, const Fn& fn) {
  if (!team) return at::parallel_for(begin, end, grain, fn);
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t used = std::max<int64_t>(1, std::min<int64_t>(team->size, (n + grain - 1) / grain));
  const int64_t chunk = (n + used - 1) / used, first = begin + team->id * chunk;
  if (team->id < used && first < end) fn(first, std::min(end, first + chunk));
}

// A residual add after a product: x (M, N) += y, where y's columns are done (each term and the sum rounded to
// bfloat16 where the model is; y is rounded in place). Each thread adds the columns it computed.
struct Residual {
  float* x;
  bool bf16;
};

// y (M, N) = x (M, K) · Wᵀ, all float32 and contiguous: the matrix-vector loops for a few rows, the blocked kernel
// for many. With a team (a few rows only), this thread's share of W's rows; with a residual, then residual.x += y.
void linear_rows(const Weight& W, const float* x, int64_t M, float* y, const Team* team = nullptr,
                 const Residual* residual = nullptr);

// Products of up to this many rows of x take the matrix-vector loops, more rows the blocked kernel (set in
// llminfer/cpu/__init__.py, MAX_TOKENS, which passes it to the compiler)
#ifndef LLMINFER_MATVEC_MAX_ROWS
#error "build with -DLLMINFER_MATVEC_MAX_ROWS=n (llminfer/cpu/__init__.py does)"
#endif
constexpr int64_t kMatvecMaxRows = LLMINFER_MATVEC_MAX_ROWS;

#ifdef LLMINFER_X86
// y (M, N) = x (M, K) · Wᵀ for the many rows of a prefill, W in any format, by the widest blocked tile this process
// runs (cpu_gemm.cpp)
void gemm_blocked(const float* x, int64_t M, const Weight& W, float* y);
// The MLP's activations act (M, N / 2) = gated(gate, up) of the product by W (gate's N / 2 rows, then up's), gate and
// up never written out, where the bfloat16 tiles take the product so (AVX512-BF16 or AMX); false, nothing computed,
// otherwise
bool gemm_blocked_gated(const float* x, int64_t M, const Weight& W, bool bf16, float* act);
#endif

// The product loops under the same names at each level, each loading a weight once for all M rows of x:
// y (M, N) = x (M, K) · Wᵀ for rows [n0, n1) of W (tiles [t0, t1) of 8 rows for int4); int4_tiles_a8 with x rounded
// to int8 per block of 32 (xq, steps dx), xsum the group sums of x
#define LLMINFER_PRODUCT_LOOPS                                                                                 \
  void dense_rows(const Weight& W, const float* x, int64_t M, float* y, int64_t n0, int64_t n1);               \
  void int4_tiles(const Weight& W, const float* x, const float* xsum, int64_t M, float* y, int64_t t0, int64_t t1); \
  void int4_tiles_a8(const int8_t* xq, const float* dx, const float* xsum, int64_t M, int64_t K, const uint8_t* w, \
                     Terms terms, int64_t group, float* y, int64_t N, int64_t t0, int64_t t1);
// The attention loops of the vector levels (cpu_vec.h): scores[g·ss + j] = scale · (q[g] · k_j) and acc[g·D + d] +=
// Σ_j p[g·ps + j] · v_j[d] for G query heads (up to 4) against n K or V rows `stride` bytes apart
#define LLMINFER_ATTENTION_LOOPS                                                                               \
  template <WKind kind>                                                                                        \
  void group_scores(int64_t G, const float* const* q, const char* k, int64_t stride, int64_t n, int64_t D,     \
                    float scale, float* scores, int64_t ss, const char* v, int64_t vstride);                   \
  template <WKind kind>                                                                                        \
  void group_values(int64_t G, const float* p, int64_t ps, const char* v, int64_t stride, int64_t n, int64_t D, \
                    float* acc);

namespace ref {                              // cpu_ref.cpp: what the vector loops compute faster
LLMINFER_PRODUCT_LOOPS
void quantize_x_blocks(const float* x, int64_t n_blocks, int8_t* xq, float* dx);
}  // namespace ref
#ifdef LLMINFER_X86
namespace avx2 {                             // cpu_avx2.cpp; int4_tiles reads x placed (int4t_x in cpu_matvec.cpp)
LLMINFER_PRODUCT_LOOPS
LLMINFER_ATTENTION_LOOPS
void quantize_x_blocks(const float* x, int64_t n_blocks, int8_t* xq, float* dx);
float exp_shifted(float* s, int64_t n, float best);   // s[j] <- exp(s[j] - best), 0 where -inf; returns their sum
}  // namespace avx2
namespace avx512 {                           // cpu_avx512.cpp
LLMINFER_PRODUCT_LOOPS                       // (int4_tiles_a8: AVX512-VNNI, xq in int4t_spread's layout)
LLMINFER_ATTENTION_LOOPS
void bf16_rows(const Weight& W, const float* xp, int64_t M, float* y, int64_t n0, int64_t n1);   // xp: even_odd(x)
void int4t_spread(const int8_t* xq, int64_t K, int8_t* spread);
// AVX512-VNNI: int4 with float x (finite) as three int8 planes
void int4_planes(const Weight& W, const float* x, const float* xsum, int64_t M, float* y, int64_t t0, int64_t t1);
}  // namespace avx512
namespace avx512_bf16 {                      // cpu_avx512.cpp: x as bfloat16, by vdpbf16ps
void dense_rows(const Weight& W, const uint16_t* xb, int64_t M, float* y, int64_t n0, int64_t n1);
}  // namespace avx512_bf16
#endif
#undef LLMINFER_PRODUCT_LOOPS
#undef LLMINFER_ATTENTION_LOOPS

// x as contiguous float32
std::vector<float> x_as_float(const at::Tensor& x);
// float32 values -> a new tensor of `sizes` in `like`'s dtype (float32 or bfloat16)
at::Tensor result(const float* y, at::IntArrayRef sizes, const at::Tensor& like);
// p[0..n) rounded to bfloat16 in place (static_cast<float>(c10::BFloat16(v)) for each); as bfloat16 into out
void round_bf16(float* p, int64_t n);
void to_bf16(const float* p, int64_t n, uint16_t* out);

// Where the queries and the cache live. q and out are float32 (b, h, t, d) with the strides given (unit along d); k
// and v are (b, h_kv, slot, d) of `kind`, unit stride along d. Query (b, h, t) sees the slots j < n_keys with
// mask[b, h, t, j] true, or (without a mask) j <= last[t].
struct AttentionProblem {
  int64_t B, H, Hkv, Tq, D, n_keys;
  const float* q;
  int64_t qs0, qs1, qs2;
  const char *k, *v;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  const bool* mask = nullptr;
  int64_t ms0 = 0, ms1 = 0, ms2 = 0, ms3 = 0;
  const int64_t* last = nullptr;
  // paged: query t reads the K/V of sequence seq[t] through its block table, tables + seq[t]·table_stride, a block
  // of block_size positions at a time (k is then the pool: position rows ks2 apart, heads ks1 apart)
  const int64_t* tables = nullptr;
  const int64_t* seq = nullptr;
  int64_t table_stride = 0, block_size = 0;
  // each query's keys in one task, not split into blocks over the threads (the caller shares out the queries); with
  // key_block, where the keys reach kSplitKeys, in blocks of key_block keys instead, merged in order, so that the
  // numbers do not depend on who computes which block
  bool whole = false;
  int64_t key_block = 0;
  float scale;
  float* out;
  int64_t os0, os1, os2;
};

// softmax(q·kᵀ·scale)·v for every query of P, in float32 (cpu_attention.cpp)
template <WKind kind>
void attend(const AttentionProblem& P);

// From this many cached positions on, a decode step's attention is split into blocks of kDecodeKeyBlock keys that
// its threads share, rather than by K/V heads (set in llminfer/cpu/__init__.py, SPLIT_KEYS)
#ifndef LLMINFER_SPLIT_KEYS
#error "build with -DLLMINFER_SPLIT_KEYS=n (llminfer/cpu/__init__.py does)"
#endif
constexpr int64_t kSplitKeys = LLMINFER_SPLIT_KEYS, kDecodeKeyBlock = 256;
// the blocks of key_block keys a query's n_keys go in where they reach kSplitKeys, else 1 (the whole row)
inline int64_t fixed_key_blocks(int64_t n_keys, int64_t key_block) {
  return key_block > 0 && n_keys >= kSplitKeys ? (n_keys + key_block - 1) / key_block : 1;
}

// attend's parts, a task of P being a row (batch, K/V head, query) and a block of its keys: for each task and query
// head of its group, the block's highest score, sum of exponentials and unnormalised weighted sum of V (D floats),
// laid out from `store`, which holds floats(P, blocks)
struct AttentionParts {
  float *best, *total, *acc;
  static int64_t floats(const AttentionProblem& P, int64_t blocks) { return P.B * P.H * P.Tq * blocks * (P.D + 2); }
  AttentionParts(const AttentionProblem& P, int64_t blocks, float* store) {
    const int64_t n = P.B * P.H * P.Tq * blocks;
    best = store, total = store + n, acc = store + 2 * n;
  }
};
// the blocks of keys each row of P is split into
int64_t attention_blocks(const AttentionProblem& P);
// the parts of tasks [task0, task1) (task = row · blocks + block)
template <WKind kind>
void attend_tasks(const AttentionProblem& P, int64_t blocks, int64_t task0, int64_t task1, const AttentionParts& parts);
// the outputs of rows [r0, r1) of P from their blocks' parts, merged in order (the online softmax of chapter 07)
void attend_merge(const AttentionProblem& P, int64_t blocks, int64_t r0, int64_t r1, const AttentionParts& parts);

// checks block tables (S, W), token_seq (N,) and positions (N,) against a pool; returns the longest context
int64_t check_block_tables(const at::Tensor& tables, const at::Tensor& token_seq, const at::Tensor& positions,
                           int64_t num_blocks, int64_t block_size, const char* op);

// the ops (registered in cpu_ops.cpp)
at::Tensor gemv(const at::Tensor& x, at::TensorList parts, int64_t group, bool int8_activations);
// reads every byte of data once on every thread with loads of `width` bytes (64, 32 or 8; 0: the widest in use);
// returns a checksum (the bandwidth probe)
int64_t stream_read(const at::Tensor& data, int64_t width);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_in, const at::Tensor& v_in,
                            const c10::optional<at::Tensor>& mask_in, double scale);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& block_tables, const at::Tensor& token_seq, const at::Tensor& positions,
                           double scale);
// the native-call contract (cpu_layers.cpp): a layer stack's fields and caches kept in this process's table
// (returns its number), one step through it, its release, and the names of a layer's fields in their order
int64_t prepare_stack(const c10::List<c10::optional<at::Tensor>>& tensors, at::ArrayRef<double> eps,
                      at::IntArrayRef activations, int64_t n_heads, double scale, int64_t cache_kind,
                      at::TensorList k_caches, at::TensorList v_caches);
at::Tensor run_stack(int64_t id, const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& positions, const c10::optional<at::Tensor>& token_seq,
                     const c10::optional<at::Tensor>& block_tables);
void release_stack(int64_t id);
std::vector<std::string> layer_fields();

}  // namespace llminfer_cpu

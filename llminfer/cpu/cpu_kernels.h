// Shared by the native CPU kernels, one torch extension built from several units by job. Chapter 08.
//
//   cpu_ref.cpp        the portable reference of each product loop (plain C++, any CPU)
//   cpu_avx2.cpp       its loops for AVX2 + FMA, cpu_avx512.cpp for AVX-512 (and VNNI, BF16), under its names; the
//                      loops both share are written once over the vector width (cpu_vec.h)
//   cpu_matvec.cpp     y = x · Wᵀ for a few rows of x: the instruction sets in use and the dispatch to those loops
//   cpu_gemm.cpp       the blocked matrix multiply for many rows of x (a prefill, a large batch)
//   cpu_attention.cpp  decode attention against a K/V cache read in place
//   cpu_layers.cpp     a prepared layer stack, one call a step over contiguous or paged K/V
//   cpu_ops.cpp        the ops' schemas, registered with torch
//
// This header holds what several units use: the weight formats, the vector helpers, and the declarations.

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
#include <cstring>
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
// vdpbf16ps loops do, changes nothing. A bfloat16 model's activations are; float32 ones mostly are not, and take
// the loops that widen the weights instead, so no path rounds x behind the caller's back.
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
// llminfer/cpu/__init__.py (the op set_cpu_features) from the CPU's flags or LLMINFER_ISA; until then the AVX2 +
// FMA loops run where the CPU has them. Each bit is also checked against the CPU itself when it is set.
enum Feature : int64_t {
  kAVX2 = 1,          // AVX2 + FMA: 8-lane float loops, maddubs/madd integer dot products
  kAVX512 = 2,        // AVX-512 F/BW/VL: 16-lane float loops
  kAVX512VNNI = 4,    // vpdpbusd (AVX512-VNNI + VL; 512-bit for int4 tiles): int8 dot products in one instruction
  kAVX512BF16 = 8,    // vdpbf16ps: bfloat16 pairs multiplied and added into float32
  kAMXBF16 = 32,      // AMX tiles with AMX-BF16: a prefill's bfloat16 products by tdpbf16ps (the OS must grant the
                      // tile state: arch_prctl(ARCH_REQ_XCOMP_PERM), asked once when the CPU is read)
};
int64_t features();
inline bool has(Feature f) { return (features() & f) != 0; }
// Whether the AVX2 + FMA loops run
inline bool has_avx2() { return has(kAVX2); }

// Each weight format's decode (matrix-vector) loops may run a lower level than the process's own: the static table
// in llminfer/cpu/__init__.py (DECODE_LOOPS) names the one that won each format's decode steps in the records of the
// CPU's class. The blocked kernel, attention and the layers' other loops run the process's own level.
enum MatvecKind : int64_t { kMatvecF32 = 0, kMatvecBF16, kMatvecI8, kMatvecI4, kMatvecI4A8, kMatvecKinds };
// the bits the matrix-vector loops for weights of `kind` run (within features())
int64_t matvec_features(int64_t kind);
// Sets the features (bits of Feature) and each format's decode loops' bits (by MatvecKind; empty: the process's
// own); returns the bits the CPU, or the features for a format's loops, lack (nothing is set then)
int64_t set_features(int64_t bits, const std::vector<int64_t>& decode);

#ifdef LLMINFER_X86
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

template <WKind kind>
__attribute__((target("avx2,fma"))) inline __m256 wload8(const void* w, int64_t i) {
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

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 floats rounded to bfloat16 as c10::BFloat16 rounds them (to nearest, ties to even; a NaN to 0x7FC0), as the
// 32-bit patterns of the rounded values (the low 16 bits zero)
__attribute__((target("avx2,fma"))) inline __m256i bf16_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  const __m256i rounded = _mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded),
                                              _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan));
}

// AVX-512 F/BW/VL, the target of the 16-lane loops (compiled for it; they run only where the CPU has it)
#define LLMINFER_AVX512 "avx2,fma,avx512f,avx512bw,avx512vl"

__attribute__((target(LLMINFER_AVX512))) inline float hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }

// the two 256-bit halves of v added
__attribute__((target(LLMINFER_AVX512))) inline __m256 halves_sum(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// 16 weights from element i of w, widened to float32
template <WKind kind>
__attribute__((target(LLMINFER_AVX512))) inline __m512 wload16(const void* w, int64_t i) {
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

// The vector width a loop is written over, once, as a macro of (V, target): V8 is AVX2 + FMA (8 floats a register),
// V16 AVX-512 (16), the same operations under the same names
#define LLMINFER_VEC(NAME, F, LANES, TARGET, SFX, HSUM, WLOAD)                                                 \
  struct NAME {                                                                                               \
    using Vec = F;                                                                                            \
    static constexpr int64_t kLanes = LANES;                                                                  \
    __attribute__((target(TARGET))) static F zero() { return _mm##SFX##_setzero_ps(); }                        \
    __attribute__((target(TARGET))) static F set1(float v) { return _mm##SFX##_set1_ps(v); }                   \
    __attribute__((target(TARGET))) static F load(const float* p) { return _mm##SFX##_loadu_ps(p); }           \
    __attribute__((target(TARGET))) static F add(F a, F b) { return _mm##SFX##_add_ps(a, b); }                 \
    __attribute__((target(TARGET))) static F fmadd(F a, F b, F c) { return _mm##SFX##_fmadd_ps(a, b, c); }     \
    __attribute__((target(TARGET))) static float hsum(F v) { return HSUM(v); }                                 \
    template <WKind kind>                                                                                     \
    __attribute__((target(TARGET))) static F wload(const void* w, int64_t i) { return WLOAD<kind>(w, i); }     \
  };
LLMINFER_VEC(V8, __m256, 8, "avx2,fma", 256, llminfer_cpu::hsum, wload8)
LLMINFER_VEC(V16, __m512, 16, LLMINFER_AVX512, 512, llminfer_cpu::hsum16, wload16)
#undef LLMINFER_VEC

// the 64-bit lanes of a and b interleaved: the low ones of each 128-bit lane (pd_lo), or the high ones (pd_hi)
__attribute__((target(LLMINFER_AVX512))) inline __m512 pd_lo(__m512 a, __m512 b) {
  return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}
__attribute__((target(LLMINFER_AVX512))) inline __m512 pd_hi(__m512 a, __m512 b) {
  return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}

// r[i] <- column i of the 16 x 16 block of 32-bit lanes whose row j is r[j]
__attribute__((target(LLMINFER_AVX512))) inline void transpose16(__m512 (&r)[16]) {
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

// exp(x) for 8 floats: the Cephes polynomial (relative error about 1e-7)
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

// exp8's polynomial on 16 floats, operation for operation (the same bits in each lane)
__attribute__((target(LLMINFER_AVX512))) inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(n));
}

// bf16_bits8 on 16 floats
__attribute__((target(LLMINFER_AVX512))) inline __m512 bf16_round16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  const __m512i rounded = _mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC00000)));
}

// gated() on 16 lanes (silu(g) · u, rounded as the bfloat16 modules round where bf16), gated_avx2's operations
__attribute__((target(LLMINFER_AVX512))) inline __m512 gated16(__m512 g, __m512 u, bool bf16) {
  const __m512 v = bf16 ? bf16_round16(g) : g;
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), v));
  const __m512 a = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return bf16 ? bf16_round16(_mm512_mul_ps(bf16_round16(a), bf16_round16(u))) : _mm512_mul_ps(a, u);
}
#endif

// The scale and offset of each group of an int4 weight in tiles: float32, or float16 (2 bytes each, as GGUF's
// Q4_0 and Q4_1 store theirs: the quantized layers keep them so when the values are float16 ones, which cuts a
// group of 32 weights from 24 bytes to 20)
struct Terms {
  const void* scale = nullptr;
  const void* offset = nullptr;
  bool half = false;
};

inline float half_bits_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
// entry i of a scale or offset table
inline float term_at(const void* p, bool half, int64_t i) {
  return half ? half_bits_to_float(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}
#ifdef LLMINFER_X86
// entries i..i+7 (one vcvtph2ps for float16: F16C, which every AVX2 CPU has and the avx2 level requires)
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

// a weight from its tensors, checked (`op` names the caller in errors)
Weight dense_weight(const at::Tensor& w, const char* op);
Weight int8_weight(const at::Tensor& w, const at::Tensor& scale, const char* op);  // scale (N,) or (N, K/group)
Weight int4_weight(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& offset, int64_t group,
                   const char* op);
// A linear given as its parts: [weight] (float32 or bfloat16), [codes, scale] (int8, the group size read from
// the scale's shape) or [codes, scale, offset] (int4 in tiles of 8 rows: (N/8, K/8, 32) codes with (N/8, G, 8)
// scales, likewise), with float activations (the caller sets int8_activations for W4A8).
Weight weight_from_parts(at::TensorList parts, const char* op);

// The threads of a decode step's one parallel region (run_layers): this is thread `id` of `size`. A loop given a
// Team runs only this thread's share of its range, the share at::parallel_for would give it; a loop given none
// splits its range over torch's threads itself (a parallel region of its own).
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

// y (M, N) = x (M, K) · Wᵀ, all float32 and contiguous: the matrix-vector loops for a few rows, the blocked
// kernel for many. With a team (a few rows only), this thread's share of W's rows; with a residual, then
// residual.x += y on them.
void linear_rows(const Weight& W, const float* x, int64_t M, float* y, const Team* team = nullptr,
                 const Residual* residual = nullptr);

// Products of up to this many rows of x take the matrix-vector loops, more rows the blocked kernel. The value
// is set in one place, llminfer/cpu/__init__.py (MAX_TOKENS), which passes it to the compiler.
#ifndef LLMINFER_MATVEC_MAX_ROWS
#error "build with -DLLMINFER_MATVEC_MAX_ROWS=n (llminfer/cpu/__init__.py does)"
#endif
constexpr int64_t kMatvecMaxRows = LLMINFER_MATVEC_MAX_ROWS;

#ifdef LLMINFER_X86
// y (M, N) = x (M, K) · Wᵀ for the many rows of a prefill, W in any format, by the widest blocked tile this
// process runs (AVX2, AVX-512, AVX512-BF16 for bfloat16 weights; cpu_gemm.cpp)
void gemm_blocked(const float* x, int64_t M, const Weight& W, float* y);
// The MLP's activations act (M, N / 2) = gated(gate, up) of the product by W (gate's N / 2 rows, then up's), gate
// and up never written out, where the bfloat16 tile takes the product in panels (bfloat16 weights, AVX512-BF16, one
// chunk of inputs, N / 2 a multiple of 24); false, nothing computed, otherwise
bool gemm_blocked_gated(const float* x, int64_t M, const Weight& W, bool bf16, float* act);
#endif

// The portable reference of each product loop (cpu_ref.cpp), what the vector loops compute faster
namespace ref {
void dense_rows(const Weight& W, const float* x, int64_t M, float* y, int64_t n0, int64_t n1);
void int4_tiles(const Weight& W, const float* x, const float* xsum, int64_t M, float* y, int64_t t0, int64_t t1);
void int4_tiles_a8(const int8_t* xq, const float* dx, const float* xsum, int64_t M, int64_t K, const uint8_t* w,
                   Terms terms, int64_t group, float* y, int64_t N, int64_t t0, int64_t t1);
void quantize_x_blocks(const float* x, int64_t n_blocks, int8_t* xq, float* dx);
}  // namespace ref

// The per-instruction-set loops under the reference's names, each loading a weight once for all M rows of x
#ifdef LLMINFER_X86
namespace avx2 {                             // cpu_avx2.cpp; int4_tiles reads x placed (int4t_x in cpu_matvec.cpp)
void dense_rows(const Weight& W, const float* x, int64_t M, float* y, int64_t n0, int64_t n1);
void int4_tiles(const Weight& W, const float* xs, const float* xsum, int64_t M, float* y, int64_t t0, int64_t t1);
void int4_tiles_a8(const int8_t* xq, const float* dx, const float* xsum, int64_t M, int64_t K, const uint8_t* w,
                   Terms terms, int64_t group, float* y, int64_t N, int64_t t0, int64_t t1);
void quantize_x_blocks(const float* x, int64_t n_blocks, int8_t* xq, float* dx);
}  // namespace avx2
namespace avx512 {                           // cpu_avx512.cpp
void dense_rows(const Weight& W, const float* x, int64_t M, float* y, int64_t n0, int64_t n1);
void bf16_rows(const Weight& W, const float* xp, int64_t M, float* y, int64_t n0, int64_t n1);   // xp: even_odd(x)
void int4_tiles(const Weight& W, const float* x, const float* xsum, int64_t M, float* y, int64_t t0, int64_t t1);
// AVX512-VNNI: W4A8 with xq in int4t_spread's layout (K·8 bytes a row), and int4 with float x (finite) as planes
void int4_tiles_a8(const int8_t* xq, const float* dx, const float* xsum, int64_t M, int64_t K, const uint8_t* w,
                   Terms terms, int64_t group, float* y, int64_t N, int64_t t0, int64_t t1);
void int4t_spread(const int8_t* xq, int64_t K, int8_t* spread);
void int4_planes(const Weight& W, const float* x, const float* xsum, int64_t M, float* y, int64_t t0, int64_t t1);
}  // namespace avx512
namespace avx512_bf16 {                      // cpu_avx512.cpp: x as bfloat16
void dense_rows(const Weight& W, const uint16_t* xb, int64_t M, float* y, int64_t n0, int64_t n1);
}  // namespace avx512_bf16
#endif

// x as contiguous float32
std::vector<float> x_as_float(const at::Tensor& x);
// float32 values -> a new tensor of `sizes` in `like`'s dtype (float32 or bfloat16)
at::Tensor result(const float* y, at::IntArrayRef sizes, const at::Tensor& like);
// p[0..n) rounded to bfloat16 in place: static_cast<float>(c10::BFloat16(v)) for each, 8 at a time with AVX2
void round_bf16(float* p, int64_t n);
// p[0..n) as bfloat16 (c10::BFloat16(v) for each) into out
void to_bf16(const float* p, int64_t n, uint16_t* out);

// Where the queries and the cache live. q and out are float32 (b, h, t, d) with the strides given (unit
// along d); k and v are (b, h_kv, slot, d) of `kind`, unit stride along d. Query (b, h, t) sees the slots
// j < n_keys with mask[b, h, t, j] true, or (without a mask) j <= last[t].
struct AttentionProblem {
  int64_t B, H, Hkv, Tq, D, n_keys;
  const float* q;
  int64_t qs0, qs1, qs2;
  const char *k, *v;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  const bool* mask = nullptr;
  int64_t ms0 = 0, ms1 = 0, ms2 = 0, ms3 = 0;
  const int64_t* last = nullptr;
  // paged: query t reads the K/V of sequence seq[t] through its block table, tables + seq[t]·table_stride, a
  // block of block_size positions at a time (k is then the pool: position rows ks2 apart, heads ks1 apart)
  const int64_t* tables = nullptr;
  const int64_t* seq = nullptr;
  int64_t table_stride = 0, block_size = 0;
  // each query's keys in one task, not split into blocks over the threads (the caller shares out the queries); with
  // key_block, where the keys reach kSplitKeys, in blocks of key_block keys instead, merged in order, so that the
  // numbers do not depend on who computes which block (a decode step's threads share out the blocks)
  bool whole = false;
  int64_t key_block = 0;
  float scale;
  float* out;
  int64_t os0, os1, os2;
};

// softmax(q·kᵀ·scale)·v for every query of P, in float32 (cpu_attention.cpp)
template <WKind kind>
void attend(const AttentionProblem& P);

// The cached positions from which a decode step's attention is split into blocks of kDecodeKeyBlock keys that its
// threads share (`AttentionProblem::key_block`), rather than by K/V heads. Set in one place, llminfer/cpu/__init__.py
// (SPLIT_KEYS), which passes it to the compiler.
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
  static int64_t floats(const AttentionProblem& P, int64_t blocks) {
    return P.B * P.H * P.Tq * blocks * (P.D + 2);
  }
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
at::Tensor gemv_f32(const at::Tensor& x, const at::Tensor& w);
at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w);
at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);
at::Tensor gemv_int4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& offset,
                     int64_t group);
at::Tensor gemv_int4_a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& offset,
                        int64_t group);
// reads every byte of data once on every thread with loads of `width` bytes (64, 32 or 8; 0: the widest in use);
// returns a checksum (the bandwidth probe)
int64_t stream_read(const at::Tensor& data, int64_t width);
// y (M, N) = x · Wᵀ for the int8-activation path of an int4 weight (cpu_matvec.cpp)
void linear_rows_a8(const Weight& W, const float* x, int64_t M, float* y, const Team* team = nullptr,
                    const Residual* residual = nullptr);
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

// Matrix-vector kernels for decode on a CPU: y = x · Wᵀ for a few rows of x and a weight W held as
// float32, bfloat16, int8 (one scale per output channel) or int4 (a scale and zero point per group of
// inputs). Chapter 08.
//
// A decode step multiplies one activation vector by every weight matrix, so its speed is how fast the
// weights stream from memory. These loops read each weight row once, in order, four rows at a time
// (four streams for the prefetchers), widen the weights to float32 in registers and multiply-add them
// into float32 accumulators. Nothing is repacked: they read the checkpoint's own row-major layout
// (int4 as two codes a byte, the even input in the low nibble). x stays in cache for the whole matrix.
//
// On top of them: decode attention against the K/V cache read in place, and whole decoder layers
// (decode_layer, decode_layers) that run a step's norms, products, RoPE, cache write, attention and SwiGLU
// without returning to Python between them. A prefill goes through the same layers: with many rows of x
// each weight is reused, and a blocked matrix-matrix kernel (gemm_avx2) does its products in every format.
//
// Built once by llminfer/kernels/cpu.py with torch's extension builder. The AVX2 versions are chosen at
// run time when the CPU has AVX2 and FMA; elsewhere the portable loops run (the compiler vectorises them).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LLMINFER_X86 1
#endif

namespace {

enum class WKind { F32, BF16, I8 };

// ---------------------------------------------------------------------------------------------------
// portable loops

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

// rows [n0, n1) of y (M, N) for one of the three dense-row formats; w is (N, K) row-major
template <WKind kind>
void rows_portable(const float* x, int64_t M, int64_t K, const void* w, const float* scale, float* y,
                   int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        for (int j = 0; j < 8; ++j) acc[j] += xm[k + j] * weight_at<kind>(w, n * K + k + j);
      float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
      for (; k < K; ++k) sum += xm[k] * weight_at<kind>(w, n * K + k);
      y[m * N + n] = scale ? sum * scale[n] : sum;
    }
  }
}

// int4: xp is x with each block of 32 inputs reordered as its 16 even then its 16 odd entries, so the
// low and high nibbles of 16 packed bytes meet 16 consecutive floats each. For a group of g inputs,
//   sum_k w_k x_k = scale · sum_k q_k x_k + (zero - 8·scale) · sum_k x_k
// so the loop accumulates q·x and the group sums of x (xsum, per row of x) are added at the end.
void rows_int4_portable(const float* xp, const float* xsum, int64_t M, int64_t K, const uint8_t* w,
                        const float* scale, const float* offset, int64_t group, float* y, int64_t N,
                        int64_t n0, int64_t n1) {
  const int64_t G = K / group;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * (K / 2);
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = xp + m * K;
      float total = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        float acc = 0.f;
        for (int64_t b = g * group; b < (g + 1) * group; b += 32) {
          const uint8_t* bytes = row + b / 2;
          for (int j = 0; j < 16; ++j) {
            acc += static_cast<float>(bytes[j] & 0xF) * xm[b + j];
            acc += static_cast<float>(bytes[j] >> 4) * xm[b + 16 + j];
          }
        }
        total += acc * scale[n * G + g] + offset[n * G + g] * xsum[m * G + g];
      }
      y[m * N + n] = total;
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// AVX2 + FMA

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

template <WKind kind>
constexpr int64_t wbytes() { return kind == WKind::F32 ? 4 : kind == WKind::BF16 ? 2 : 1; }

// While R rows are read, the next R rows (contiguous after them, `ahead`) are prefetched at the same
// pace, one block ahead: the hardware prefetcher alone ramps up too slowly on rows a few KB long.
template <WKind kind, int R>
__attribute__((target("avx2,fma"))) void dot_rows_avx2(const float* x, int64_t K, const void* w, int64_t n,
                                                        float* out, const char* ahead) {
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  constexpr int64_t step_bytes = 16 * wbytes<kind>() * R;        // bytes of the block read per step
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if (ahead) {
      for (int64_t line = 0; line < step_bytes; line += 64)
        _mm_prefetch(ahead + k * wbytes<kind>() * R + line, _MM_HINT_T0);
    }
    __m256 x0 = load8(x + k), x1 = load8(x + k + 8);
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm256_fmadd_ps(wload8<kind>(w, (n + r) * K + k), x0, a0[r]);
      a1[r] = _mm256_fmadd_ps(wload8<kind>(w, (n + r) * K + k + 8), x1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float s = hsum(_mm256_add_ps(a0[r], a1[r]));
    for (int64_t j = k; j < K; ++j) s += x[j] * weight_at<kind>(w, (n + r) * K + j);
    out[r] = s;
  }
}

template <WKind kind>
__attribute__((target("avx2,fma"))) void rows_avx2(const float* x, int64_t M, int64_t K, const void* w,
                                                    const float* scale, float* y, int64_t N, int64_t n0,
                                                    int64_t n1) {
  float out[4];
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const char* ahead = n + 8 <= n1 ? static_cast<const char*>(w) + (n + 4) * K * wbytes<kind>() : nullptr;
    for (int64_t m = 0; m < M; ++m) {
      dot_rows_avx2<kind, 4>(x + m * K, K, w, n, out, m == 0 ? ahead : nullptr);
      for (int r = 0; r < 4; ++r) y[m * N + n + r] = scale ? out[r] * scale[n + r] : out[r];
    }
  }
  for (; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      dot_rows_avx2<kind, 1>(x + m * K, K, w, n, out, nullptr);
      y[m * N + n] = scale ? out[0] * scale[n] : out[0];
    }
  }
}

// int4, R rows: per group, q·x in a vector accumulator, scaled into the row's accumulator by one FMA
template <int R>
__attribute__((target("avx2,fma"))) void int4_rows_avx2(const float* xp, const float* xsum, int64_t K,
                                                         const uint8_t* w, const float* scale,
                                                         const float* offset, int64_t group, int64_t n,
                                                         float* out, const char* ahead) {
  const int64_t G = K / group;
  const __m128i low = _mm_set1_epi8(0x0F);
  __m256 total[R];
  float extra[R];
  for (int r = 0; r < R; ++r) { total[r] = _mm256_setzero_ps(); extra[r] = 0.f; }
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[R], acc2[R];                                    // low and high nibbles: two chains a row
    for (int r = 0; r < R; ++r) acc[r] = acc2[r] = _mm256_setzero_ps();
    for (int64_t b = g * group; b < (g + 1) * group; b += 32) {
      if (ahead) _mm_prefetch(ahead + b / 2 * R, _MM_HINT_T0);   // 16 bytes a row per step: R·16 ahead
      __m256 x0 = load8(xp + b), x1 = load8(xp + b + 8), x2 = load8(xp + b + 16), x3 = load8(xp + b + 24);
      for (int r = 0; r < R; ++r) {
        __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n + r) * (K / 2) + b / 2));
        __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), x0, acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), x1, acc[r]);
        acc2[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), x2, acc2[r]);
        acc2[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), x3, acc2[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      total[r] = _mm256_fmadd_ps(_mm256_add_ps(acc[r], acc2[r]), _mm256_set1_ps(scale[(n + r) * G + g]), total[r]);
      extra[r] += offset[(n + r) * G + g] * xsum[g];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(total[r]) + extra[r];
}

__attribute__((target("avx2,fma"))) void rows_int4_avx2(const float* xp, const float* xsum, int64_t M,
                                                         int64_t K, const uint8_t* w, const float* scale,
                                                         const float* offset, int64_t group, float* y,
                                                         int64_t N, int64_t n0, int64_t n1) {
  const int64_t G = K / group;
  float out[4];
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const char* ahead = n + 8 <= n1 ? reinterpret_cast<const char*>(w + (n + 4) * (K / 2)) : nullptr;
    for (int64_t m = 0; m < M; ++m) {
      int4_rows_avx2<4>(xp + m * K, xsum + m * G, K, w, scale, offset, group, n, out, m == 0 ? ahead : nullptr);
      for (int r = 0; r < 4; ++r) y[m * N + n + r] = out[r];
    }
  }
  for (; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      int4_rows_avx2<1>(xp + m * K, xsum + m * G, K, w, scale, offset, group, n, out, nullptr);
      y[m * N + n] = out[0];
    }
  }
}

// LLMINFER_CPU_KERNELS_PORTABLE=1 runs the portable loops on any CPU (how the tests check them on x86)
bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          !(std::getenv("LLMINFER_CPU_KERNELS_PORTABLE") &&
                            std::string(std::getenv("LLMINFER_CPU_KERNELS_PORTABLE")) == "1");
  return yes;
}
#else
bool has_avx2() { return false; }
#endif


#ifdef LLMINFER_X86
// scores[j] = scale · (q · k_j) for n keys whose rows lie `stride` bytes apart, four keys at a time
template <WKind kind>
__attribute__((target("avx2,fma"))) void key_scores_avx2(const float* q, const char* k, int64_t stride, int64_t n,
                                                          int64_t D, float scale, float* scores) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    const char* r = k + j * stride;
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = load8(q + d);
      a0 = _mm256_fmadd_ps(wload8<kind>(r, d), qv, a0);
      a1 = _mm256_fmadd_ps(wload8<kind>(r + stride, d), qv, a1);
      a2 = _mm256_fmadd_ps(wload8<kind>(r + 2 * stride, d), qv, a2);
      a3 = _mm256_fmadd_ps(wload8<kind>(r + 3 * stride, d), qv, a3);
    }
    scores[j] = hsum(a0) * scale, scores[j + 1] = hsum(a1) * scale;
    scores[j + 2] = hsum(a2) * scale, scores[j + 3] = hsum(a3) * scale;
  }
  for (; j < n; ++j) {
    __m256 a0 = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) a0 = _mm256_fmadd_ps(wload8<kind>(k + j * stride, d), load8(q + d), a0);
    scores[j] = hsum(a0) * scale;
  }
}

// acc[d] += Σ_j p[j] · v_j[d] over n value rows `stride` bytes apart, 32 columns of acc in registers at a time
template <WKind kind>
__attribute__((target("avx2,fma"))) void weighted_values_avx2(const float* p, const char* v, int64_t stride,
                                                               int64_t n, int64_t D, float* acc) {
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    __m256 a0 = load8(acc + d), a1 = load8(acc + d + 8), a2 = load8(acc + d + 16), a3 = load8(acc + d + 24);
    for (int64_t j = 0; j < n; ++j) {
      if (p[j] == 0.f) continue;
      const __m256 pj = _mm256_set1_ps(p[j]);
      const char* r = v + j * stride;
      a0 = _mm256_fmadd_ps(wload8<kind>(r, d), pj, a0);
      a1 = _mm256_fmadd_ps(wload8<kind>(r, d + 8), pj, a1);
      a2 = _mm256_fmadd_ps(wload8<kind>(r, d + 16), pj, a2);
      a3 = _mm256_fmadd_ps(wload8<kind>(r, d + 24), pj, a3);
    }
    _mm256_storeu_ps(acc + d, a0), _mm256_storeu_ps(acc + d + 8, a1);
    _mm256_storeu_ps(acc + d + 16, a2), _mm256_storeu_ps(acc + d + 24, a3);
  }
  for (; d < D; d += 8) {
    __m256 a0 = load8(acc + d);
    for (int64_t j = 0; j < n; ++j)
      if (p[j] != 0.f) a0 = _mm256_fmadd_ps(wload8<kind>(v + j * stride, d), _mm256_set1_ps(p[j]), a0);
    _mm256_storeu_ps(acc + d, a0);
  }
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

__attribute__((target("avx2,fma"))) float exp_shifted_avx2(float* s, int64_t n, float best) {
  const __m256 shift = _mm256_set1_ps(best), neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 v = _mm256_loadu_ps(s + j);
    __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(v, neg_inf, _CMP_EQ_OQ), exp8(_mm256_sub_ps(v, shift)));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = hsum(sum);
  for (; j < n; ++j) {
    s[j] = std::isinf(s[j]) ? 0.f : std::exp(s[j] - best);
    total += s[j];
  }
  return total;
}

#endif

// one weight matrix in any of the four formats
struct Weight {
  enum Format { F32, BF16, I8, I4 } format;
  const void* w;
  const float* scale = nullptr;    // int8: (N,); int4: (N, K / group)
  const float* offset = nullptr;   // int4: (N, K / group)
  int64_t N = 0, K = 0, group = 0;
};

// ---------------------------------------------------------------------------------------------------
// products for many rows of x (a prefill): a blocked kernel
//
// With a few rows of x each weight is used once and the loops above stream it. With a hundred rows each
// weight is used a hundred times, and the speed is how many multiply-adds a cycle the core sustains. The
// kernel below computes a tile of 6 outputs (6 rows of W) for 16 tokens at once, in 12 registers: per input
// k, it broadcasts W[n..n+5][k] and multiplies them into x's 16 tokens at k, which are laid out for it once
// per product ("packed": 16 tokens of one input contiguous). That is 12 multiply-adds for 8 loads, so the
// two FMA units stay busy. float32 rows of W are read in place (the checkpoint's row-major layout); the
// other formats widen each block of 6 rows to float32 once (a few KB), which all the token tiles then
// share. The six rows stay in L1 while the token tiles pass; long inputs are split into chunks so that a
// chunk of packed x stays in L2.

constexpr int64_t kGemmTile = 16;   // tokens of one packed tile
constexpr int64_t kGemmRowsW = 6;   // rows of W of one tile
constexpr int64_t kGemmChunk = 512; // inputs per chunk of a long product
constexpr int64_t kGemmMinRows = 16; // rows of x from which products take the blocked kernel

struct AlignedFloats {
  float* data = nullptr;
  explicit AlignedFloats(size_t n) {
    data = static_cast<float*>(std::aligned_alloc(64, std::max<size_t>(64, ((n * sizeof(float) + 63) / 64) * 64)));
    TORCH_CHECK(data != nullptr, "llminfer: out of memory for ", n, " floats");
  }
  ~AlignedFloats() { std::free(data); }
  AlignedFloats(const AlignedFloats&) = delete;
  AlignedFloats& operator=(const AlignedFloats&) = delete;
};

#ifdef LLMINFER_X86
// y[j][0..5] (+)= column j of the 6 x 8 block (r0 .. r5) for tokens j < rows, y rows `ldy` floats apart
__attribute__((target("avx2,fma"))) inline void store_tile_half(__m256 r0, __m256 r1, __m256 r2, __m256 r3, __m256 r4,
                                                                 __m256 r5, float* y, int64_t ldy, int64_t rows,
                                                                 bool accumulate) {
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

// y (rows <= 16 tokens, 6 outputs, rows `ldy` apart) (+)= packed x[0..kc)[0..16) · W[0..5][0..kc)ᵀ, W rows
// `ldw` floats apart
__attribute__((target("avx2,fma"))) void gemm_tile_6x16(const float* w, int64_t ldw, const float* xp, int64_t kc,
                                                         float* y, int64_t ldy, int64_t rows, bool accumulate) {
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
    LLMINFER_ROW(0) LLMINFER_ROW(1) LLMINFER_ROW(2) LLMINFER_ROW(3) LLMINFER_ROW(4) LLMINFER_ROW(5)
  }
#undef LLMINFER_ROW
  // out (tokens, outputs): each half of 8 tokens transposed in registers, 6 outputs a token stored at once
  // (a scalar store per element cost about a tenth of the product)
  store_tile_half(a0, a1, a2, a3, a4, a5, y, ldy, std::min<int64_t>(rows, 8), accumulate);
  if (rows > 8) store_tile_half(b0, b1, b2, b3, b4, b5, y + 8 * ldy, ldy, rows - 8, accumulate);
}

// rows n .. n + r - 1 (r <= 6) of W, inputs [k0, k0 + kc), as float32 into out (row i at out + i·kc); int4
// chunks start and end on a multiple of 32 inputs (a group is a multiple of 32)
__attribute__((target("avx2,fma"))) void widen_rows(const Weight& W, int64_t n, int64_t r, int64_t k0, int64_t kc,
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
      const float scale = W.scale[row];
      const __m256 s = _mm256_set1_ps(scale);
      for (; k + 8 <= kc; k += 8) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + k));
        _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s));
      }
      for (; k < kc; ++k) o[k] = static_cast<float>(src[k]) * scale;
    } else {                                      // int4: byte j holds input 2j (low nibble) and 2j + 1
      const int64_t G = K / W.group;
      const uint8_t* src = static_cast<const uint8_t*>(W.w) + row * (K / 2);
      const __m128i low = _mm_set1_epi8(0x0F);
      for (; k + 32 <= kc; k += 32) {
        const int64_t at = k0 + k, g = at / W.group;
        const __m256 s = _mm256_set1_ps(W.scale[row * G + g]), z = _mm256_set1_ps(W.offset[row * G + g]);
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + at / 2));
        const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        const __m128i q[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};   // inputs in order
        for (int h = 0; h < 2; ++h) {
          const __m256 first = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q[h]));
          const __m256 second = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q[h], 8)));
          _mm256_storeu_ps(o + k + 16 * h, _mm256_fmadd_ps(first, s, z));
          _mm256_storeu_ps(o + k + 16 * h + 8, _mm256_fmadd_ps(second, s, z));
        }
      }
    }
  }
}

// y (M, N) = x (M, K) · Wᵀ for the many rows of a prefill, W in any format
void gemm_avx2(const float* x, int64_t M, const Weight& W, float* y) {
  const int64_t N = W.N, K = W.K;
  const int64_t tiles = (M + kGemmTile - 1) / kGemmTile;
  AlignedFloats packed(static_cast<size_t>(tiles * K * kGemmTile));
  float* xp = packed.data;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {     // tile t: xp[t][k][j] = x[16t + j][k]
    for (int64_t t = t0; t < t1; ++t) {
      float* dst = xp + t * K * kGemmTile;
      const int64_t rows = std::min<int64_t>(kGemmTile, M - t * kGemmTile);
      if (rows < kGemmTile) std::fill(dst, dst + K * kGemmTile, 0.f);
      for (int64_t j = 0; j < rows; ++j) {
        const float* src = x + (t * kGemmTile + j) * K;
        for (int64_t k = 0; k < K; ++k) dst[k * kGemmTile + j] = src[k];
      }
    }
  });
  const int64_t blocks = (N + kGemmRowsW - 1) / kGemmRowsW;        // the last may hold fewer than 6 rows
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    AlignedFloats wide(static_cast<size_t>(kGemmRowsW * std::min(K, kGemmChunk)));
    alignas(64) float part[kGemmTile * kGemmRowsW];
    for (int64_t k0 = 0; k0 < K; k0 += kGemmChunk) {
      const int64_t kc = std::min<int64_t>(kGemmChunk, K - k0);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n = b * kGemmRowsW, r = std::min<int64_t>(kGemmRowsW, N - n);
        const float* rows_of_w = wide.data;
        int64_t ldw = kc;
        if (W.format == Weight::F32 && r == kGemmRowsW) {
          rows_of_w = static_cast<const float*>(W.w) + n * K + k0;
          ldw = K;
        } else {
          widen_rows(W, n, r, k0, kc, wide.data);
          std::fill(wide.data + r * kc, wide.data + kGemmRowsW * kc, 0.f);
        }
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t rows = std::min<int64_t>(kGemmTile, M - t * kGemmTile);
          const float* xt = xp + (t * K + k0) * kGemmTile;
          float* yt = y + t * kGemmTile * N + n;
          if (r == kGemmRowsW) {
            gemm_tile_6x16(rows_of_w, ldw, xt, kc, yt, N, rows, k0 > 0);
          } else {                                // the last rows of W: through a small buffer
            gemm_tile_6x16(rows_of_w, ldw, xt, kc, part, kGemmRowsW, rows, false);
            for (int64_t j = 0; j < rows; ++j)
              for (int64_t i = 0; i < r; ++i)
                yt[j * N + i] = (k0 > 0 ? yt[j * N + i] : 0.f) + part[j * kGemmRowsW + i];
          }
        }
      }
    }
  });
}
#endif

// ---------------------------------------------------------------------------------------------------
// one weight matrix in any of the four formats, and its product with a few float32 rows

constexpr int64_t kGrain = 64;   // output rows a thread takes at least


Weight dense_weight(const at::Tensor& w, const char* op) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), op, ": the weight must be a contiguous (N, K) matrix, got ",
              w.sizes());
  TORCH_CHECK(w.device().is_cpu(), op, ": the weight must be on the CPU, got ", w.device());
  Weight W{w.scalar_type() == at::kFloat ? Weight::F32 : w.scalar_type() == at::kBFloat16 ? Weight::BF16 : Weight::I8,
           w.data_ptr()};
  W.N = w.size(0);
  W.K = w.size(1);
  return W;
}

Weight int8_weight(const at::Tensor& w, const at::Tensor& scale, const char* op) {
  TORCH_CHECK(w.scalar_type() == at::kChar, op, ": the codes must be int8, got ", w.scalar_type());
  Weight W = dense_weight(w, op);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == W.N, op,
              ": scale must be float32 with one entry per output row (", W.N, ")");
  W.scale = scale.data_ptr<float>();
  return W;
}

Weight int4_weight(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& offset, int64_t group,
                   const char* op) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(), op,
              ": the codes must be contiguous (N, K/2) uint8 on the CPU");
  const int64_t N = w.size(0), K = w.size(1) * 2;
  TORCH_CHECK(group > 0 && group % 32 == 0 && K % group == 0, op, ": group ", group,
              " must be a multiple of 32 that divides ", K);
  for (const at::Tensor* t : {&scale, &offset})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == N * (K / group), op,
                ": scale and offset must be contiguous float32 (", N, ", ", K / group, ")");
  Weight W{Weight::I4, w.data_ptr()};
  W.scale = scale.data_ptr<float>();
  W.offset = offset.data_ptr<float>();
  W.N = N;
  W.K = K;
  W.group = group;
  return W;
}

// A linear given as its parts: [weight] (float32 or bfloat16), [codes, scale] (int8) or [nibbles, scale,
// offset] (int4, the group size read from the scale's shape).
Weight weight_from_parts(at::TensorList parts, const char* op) {
  TORCH_CHECK(!parts.empty() && parts.size() <= 3, op, ": a linear is [weight], [codes, scale] or "
              "[nibbles, scale, offset], got ", parts.size(), " tensors");
  const at::Tensor& w = parts[0];
  if (parts.size() == 1) {
    TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, op,
                ": a one-tensor linear must be float32 or bfloat16, got ", w.scalar_type());
    return dense_weight(w, op);
  }
  if (parts.size() == 2) return int8_weight(w, parts[1], op);
  TORCH_CHECK(parts[1].dim() == 2 && parts[1].size(1) > 0, op, ": int4 scales must be (N, groups)");
  return int4_weight(w, parts[1], parts[2], w.size(1) * 2 / parts[1].size(1), op);
}

// y (M, N) = x (M, K) · Wᵀ, all float32 and contiguous; rows of W split over torch's threads
void linear_rows(const Weight& W, const float* x, int64_t M, float* y) {
  const int64_t N = W.N, K = W.K;
  const bool avx2 = has_avx2();
#ifdef LLMINFER_X86
  if (avx2 && M >= kGemmMinRows) return gemm_avx2(x, M, W, y);
#endif
  if (W.format == Weight::I4) {
    // x with each block of 32 inputs as its 16 even then 16 odd entries, and the group sums of x
    const int64_t G = K / W.group;
    std::vector<float> xp(M * K), xsum(M * G, 0.f);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t b = 0; b < K; b += 32) {
        for (int j = 0; j < 16; ++j) {
          xp[m * K + b + j] = x[m * K + b + 2 * j];
          xp[m * K + b + 16 + j] = x[m * K + b + 2 * j + 1];
        }
      }
      for (int64_t k = 0; k < K; ++k) xsum[m * G + k / W.group] += x[m * K + k];
    }
    const uint8_t* wp = static_cast<const uint8_t*>(W.w);
    at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
#ifdef LLMINFER_X86
      if (avx2) rows_int4_avx2(xp.data(), xsum.data(), M, K, wp, W.scale, W.offset, W.group, y, N, n0, n1);
      else
#endif
      rows_int4_portable(xp.data(), xsum.data(), M, K, wp, W.scale, W.offset, W.group, y, N, n0, n1);
    });
    return;
  }
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    if (avx2) {
#ifdef LLMINFER_X86
      if (W.format == Weight::F32) rows_avx2<WKind::F32>(x, M, K, W.w, W.scale, y, N, n0, n1);
      else if (W.format == Weight::BF16) rows_avx2<WKind::BF16>(x, M, K, W.w, W.scale, y, N, n0, n1);
      else rows_avx2<WKind::I8>(x, M, K, W.w, W.scale, y, N, n0, n1);
#endif
    } else if (W.format == Weight::F32) {
      rows_portable<WKind::F32>(x, M, K, W.w, W.scale, y, N, n0, n1);
    } else if (W.format == Weight::BF16) {
      rows_portable<WKind::BF16>(x, M, K, W.w, W.scale, y, N, n0, n1);
    } else {
      rows_portable<WKind::I8>(x, M, K, W.w, W.scale, y, N, n0, n1);
    }
  });
}

// ---------------------------------------------------------------------------------------------------
// the matrix-vector ops

void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be on the CPU, got ", x.device());
  TORCH_CHECK(x.dim() == 2, op, ": x must be (tokens, in_features), got ", x.sizes());
  TORCH_CHECK(x.size(1) == K, op, ": x has ", x.size(1), " inputs, the weight ", K);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
}

// x as contiguous float32
std::vector<float> x_as_float(const at::Tensor& x) {
  at::Tensor xc = x.contiguous();
  std::vector<float> out(xc.numel());
  if (xc.scalar_type() == at::kFloat) {
    std::memcpy(out.data(), xc.data_ptr<float>(), out.size() * sizeof(float));
  } else {
    const c10::BFloat16* p = xc.data_ptr<c10::BFloat16>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(p[i]);
  }
  return out;
}

// float32 values -> a new tensor of `sizes` in `like`'s dtype (float32 or bfloat16)
at::Tensor result(const float* y, at::IntArrayRef sizes, const at::Tensor& like) {
  at::Tensor out = at::empty(sizes, like.options());
  const int64_t n = out.numel();
  if (like.scalar_type() == at::kFloat) {
    std::memcpy(out.data_ptr<float>(), y, n * sizeof(float));
  } else {
    c10::BFloat16* p = out.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < n; ++i) p[i] = c10::BFloat16(y[i]);
  }
  return out;
}

at::Tensor gemv(const at::Tensor& x, const Weight& W, const char* op) {
  check_x(x, W.K, op);
  const int64_t M = x.size(0);
  std::vector<float> xf = x_as_float(x), y(M * W.N);
  linear_rows(W, xf.data(), M, y.data());
  return result(y.data(), {M, W.N}, x);
}

at::Tensor gemv_f32(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat, "gemv_f32: the weight must be float32, got ", w.scalar_type());
  return gemv(x, dense_weight(w, "gemv_f32"), "gemv_f32");
}

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "gemv_bf16: the weight must be bfloat16, got ", w.scalar_type());
  return gemv(x, dense_weight(w, "gemv_bf16"), "gemv_bf16");
}

at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  return gemv(x, int8_weight(w, scale, "gemv_int8"), "gemv_int8");
}

at::Tensor gemv_int4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& offset,
                     int64_t group) {
  return gemv(x, int4_weight(w, scale, offset, group, "gemv_int4"), "gemv_int4");
}


// ---------------------------------------------------------------------------------------------------
// decode attention: a few queries against a K/V cache, read in place. Scores, softmax and the weighted
// sum of V are computed in float32, and positions a query may not see are skipped. A query with no
// visible key gives NaN, as softmax over nothing does.

template <WKind kind>
void key_scores(const float* q, const char* k, int64_t stride, int64_t n, int64_t D, float scale, float* scores,
                bool avx2) {
#ifdef LLMINFER_X86
  if (avx2) return key_scores_avx2<kind>(q, k, stride, n, D, scale, scores);
#endif
  for (int64_t j = 0; j < n; ++j) {
    float s = 0.f;
    for (int64_t d = 0; d < D; ++d) s += q[d] * weight_at<kind>(k + j * stride, d);
    scores[j] = s * scale;
  }
}

template <WKind kind>
void weighted_values(const float* p, const char* v, int64_t stride, int64_t n, int64_t D, float* acc, bool avx2) {
#ifdef LLMINFER_X86
  if (avx2) return weighted_values_avx2<kind>(p, v, stride, n, D, acc);
#endif
  for (int64_t j = 0; j < n; ++j)
    if (p[j] != 0.f)
      for (int64_t d = 0; d < D; ++d) acc[d] += p[j] * weight_at<kind>(v + j * stride, d);
}

// scores[j] <- exp(scores[j] - best), 0 where scores[j] is -inf; returns their sum
inline float softmax_numerators(float* scores, int64_t n, float best, bool avx2) {
#ifdef LLMINFER_X86
  if (avx2) return exp_shifted_avx2(scores, n, best);
#endif
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = std::isinf(scores[j]) ? 0.f : std::exp(scores[j] - best);
    total += scores[j];
  }
  return total;
}

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
  float scale;
  float* out;
  int64_t os0, os1, os2;
};

// The work is split into tasks of (batch, K/V head, query position, block of keys): the query heads that
// share the K/V head are done together, so each key and value row is read once for all of them, and the
// keys are split into blocks so that both a long cache and a few heads spread over every thread. Each task
// keeps its block's running maximum, sum of exponentials and unnormalised weighted sum of V; the blocks of
// one query are then merged by rescaling to a common maximum (the online softmax of chapter 07).
template <WKind kind>
void attend(const AttentionProblem& P) {
  const int64_t group = P.H / P.Hkv, D = P.D, Tk = P.n_keys, esize = wbytes<kind>();
  const bool avx2 = has_avx2() && D % 8 == 0;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t rows = P.B * P.Hkv * P.Tq;
  // about four tasks a thread, blocks of at least 64 keys
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((4 * at::get_num_threads() + rows - 1) / rows,
                                                                  (Tk + 63) / 64));
  const int64_t block = (Tk + blocks - 1) / blocks;
  std::vector<float> part_best(rows * blocks * group), part_total(rows * blocks * group),
      part_acc(rows * blocks * group * D);
  at::parallel_for(0, rows * blocks, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> scores(group * block);
    for (int64_t task = r0; task < r1; ++task) {
      const int64_t r = task / blocks, c = task % blocks;
      const int64_t b = r / (P.Hkv * P.Tq), hk = (r / P.Tq) % P.Hkv, t = r % P.Tq;
      const float* qrow[64];
      for (int64_t g = 0; g < group; ++g) qrow[g] = P.q + b * P.qs0 + (hk * group + g) * P.qs1 + t * P.qs2;
      float* best = part_best.data() + task * group;
      float* total = part_total.data() + task * group;
      float* acc = part_acc.data() + task * group * D;
      std::fill(best, best + group, neg_inf);
      std::fill(total, total + group, 0.f);
      std::fill(acc, acc + group * D, 0.f);
      const int64_t begin = c * block;
      const int64_t end = std::min<int64_t>(std::min<int64_t>(Tk, begin + block), P.mask ? Tk : P.last[t] + 1);
      if (end <= begin) continue;
      const int64_t n = end - begin;
      const char* krows = P.k + (b * P.ks0 + hk * P.ks1 + begin * P.ks2) * esize;
      const char* vrows = P.v + (b * P.vs0 + hk * P.vs1 + begin * P.vs2) * esize;
      for (int64_t g = 0; g < group; ++g) {
        float* sc = scores.data() + g * block;
        key_scores<kind>(qrow[g], krows, P.ks2 * esize, n, D, P.scale, sc, avx2);
        if (P.mask) {
          const bool* m = P.mask + b * P.ms0 + (hk * group + g) * P.ms1 + t * P.ms2;
          for (int64_t j = 0; j < n; ++j)
            if (!m[(begin + j) * P.ms3]) sc[j] = neg_inf;
        }
        for (int64_t j = 0; j < n; ++j) best[g] = std::max(best[g], sc[j]);
        if (best[g] == neg_inf) continue;
        total[g] = softmax_numerators(sc, n, best[g], avx2);
        weighted_values<kind>(sc, vrows, P.vs2 * esize, n, D, acc + g * D, avx2);
      }
    }
  });
  for (int64_t r = 0; r < rows; ++r) {                       // merge the blocks of each query
    const int64_t b = r / (P.Hkv * P.Tq), hk = (r / P.Tq) % P.Hkv, t = r % P.Tq;
    for (int64_t g = 0; g < group; ++g) {
      float top = neg_inf;
      for (int64_t c = 0; c < blocks; ++c) top = std::max(top, part_best[(r * blocks + c) * group + g]);
      float* o = P.out + b * P.os0 + (hk * group + g) * P.os1 + t * P.os2;
      std::fill(o, o + D, 0.f);
      float sum = 0.f;
      if (top != neg_inf) {
        for (int64_t c = 0; c < blocks; ++c) {
          const int64_t idx = (r * blocks + c) * group + g;
          if (part_best[idx] == neg_inf) continue;
          const float w = std::exp(part_best[idx] - top);
          sum += w * part_total[idx];
          const float* acc = part_acc.data() + idx * D;
          for (int64_t d = 0; d < D; ++d) o[d] += w * acc[d];
        }
      }
      const float inv = sum > 0.f ? 1.f / sum : std::numeric_limits<float>::quiet_NaN();
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
}

// q (B, H, Tq, D); k, v (B, Hkv, Tk, D) with unit stride along D; an optional boolean mask broadcastable to
// (B, H, Tq, Tk) (True = may attend), else the causal rule (query i sees keys 0 .. Tk - Tq + i).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_in, const at::Tensor& v_in,
                            const c10::optional<at::Tensor>& mask_in, double scale) {
  const char* op = "decode_attention";
  TORCH_CHECK(q.dim() == 4 && k_in.dim() == 4 && v_in.dim() == 4, op, ": q, k and v must be (B, heads, T, D)");
  TORCH_CHECK(q.device().is_cpu() && k_in.device().is_cpu() && v_in.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k_in.scalar_type() && q.scalar_type() == v_in.scalar_type() &&
              (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16), op,
              ": q, k and v must share one dtype, float32 or bfloat16");
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3);
  TORCH_CHECK(k_in.size(0) == B && v_in.sizes() == k_in.sizes() && k_in.size(3) == D && k_in.size(1) > 0 &&
              H % k_in.size(1) == 0 && H / k_in.size(1) <= 64 && k_in.size(2) >= Tq, op, ": shapes q ", q.sizes(),
              ", k ", k_in.sizes(), ", v ", v_in.sizes(), " do not fit (B, H, Tq, D) against (B, H_kv, Tk >= Tq, D) "
              "with H a multiple of H_kv (at most 64 query heads per K/V head)");
  const at::Tensor k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const at::Tensor v = v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  const int64_t Tk = k.size(2);
  std::vector<float> qf = x_as_float(q), out(B * H * Tq * D);
  std::vector<int64_t> last(Tq);
  for (int64_t t = 0; t < Tq; ++t) last[t] = Tk - Tq + t;
  AttentionProblem P{B, H, k.size(1), Tq, D, Tk, qf.data(), H * Tq * D, Tq * D, D,
                     static_cast<const char*>(k.data_ptr()), static_cast<const char*>(v.data_ptr()),
                     k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2)};
  at::Tensor mask;
  if (mask_in.has_value()) {
    TORCH_CHECK(mask_in->scalar_type() == at::kBool, op, ": the mask must be boolean (True = may attend)");
    mask = mask_in->expand({B, H, Tq, Tk});
    P.mask = mask.data_ptr<bool>();
    P.ms0 = mask.stride(0), P.ms1 = mask.stride(1), P.ms2 = mask.stride(2), P.ms3 = mask.stride(3);
  }
  P.last = last.data();
  P.scale = static_cast<float>(scale);
  P.out = out.data();
  P.os0 = H * Tq * D, P.os1 = Tq * D, P.os2 = D;
  if (q.scalar_type() == at::kFloat) attend<WKind::F32>(P);
  else attend<WKind::BF16>(P);
  return result(out.data(), q.sizes(), q);
}


// ---------------------------------------------------------------------------------------------------
// one decoder layer for a few tokens, in one call:
//   h = rmsnorm(x); q, k, v = h · W_qkvᵀ (+ bias); RoPE on q and k; k, v written into the cache at their
//   positions; attention of q over the slots up to each token's position; x += attention · W_oᵀ;
//   h = rmsnorm(x); x += (silu(gate) · up) · W_downᵀ with gate, up = h · W_gate_upᵀ.
// The same arithmetic as the layer's modules, in float32, rounded to the model's dtype where the modules
// round (each product, the norm, RoPE, the attention output, each sum), so bfloat16 matches them to
// within a rounding step.

inline float round_to(float v, bool bf16) { return bf16 ? static_cast<float>(c10::BFloat16(v)) : v; }

template <typename T>
inline const T* ptr_as(const at::Tensor& t) { return static_cast<const T*>(t.data_ptr()); }

#ifdef LLMINFER_X86
__attribute__((target("avx2,fma"))) void silu_avx2(const float* g, int64_t n, float* out) {
  const __m256 one = _mm256_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(g + i);
    _mm256_storeu_ps(out + i, _mm256_div_ps(v, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), v)))));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(std::min(-g[i], 88.f)));
}
#endif

// out = g · sigmoid(g); exp's argument is capped (glibc's exp is slow on overflow, and g/inf is 0 anyway)
void silu(const float* g, int64_t n, float* out) {
#ifdef LLMINFER_X86
  if (has_avx2()) return silu_avx2(g, n, out);
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.f + std::exp(std::min(-g[i], 88.f)));
}

// fn(m) for every row m < M: inline for a decode step's few rows, split over the threads for a prefill's
template <typename Fn>
void for_rows(int64_t M, const Fn& fn) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) fn(m);
  });
}

// rows of x (M, dim) -> weight · (x / rms(x)), each rounded as RMSNorm rounds
void rms_norm(const float* x, int64_t M, int64_t dim, const at::Tensor& weight, double eps, bool bf16, float* out) {
  // float32 weights read in place; bfloat16 ones widened once per call
  const std::vector<float> widened = weight.scalar_type() == at::kFloat ? std::vector<float>() : x_as_float(weight);
  const float* w = weight.scalar_type() == at::kFloat ? ptr_as<float>(weight) : widened.data();
  for_rows(M, [&](int64_t m) {
    const float* row = x + m * dim;
    double ss[4] = {0.0, 0.0, 0.0, 0.0};              // four chains: one would wait on each add
    int64_t i = 0;
    for (; i + 4 <= dim; i += 4)
      for (int j = 0; j < 4; ++j) ss[j] += static_cast<double>(row[i + j]) * row[i + j];
    for (; i < dim; ++i) ss[0] += static_cast<double>(row[i]) * row[i];
    const double total = (ss[0] + ss[1]) + (ss[2] + ss[3]);
    const float inv = 1.f / std::sqrt(static_cast<float>(total / dim) + static_cast<float>(eps));
    float* o = out + m * dim;
    if (bf16)
      for (int64_t i = 0; i < dim; ++i) o[i] = round_to(w[i] * round_to(row[i] * inv, true), true);
    else
      for (int64_t i = 0; i < dim; ++i) o[i] = w[i] * (row[i] * inv);
  });
}

// One layer's weights and cache, checked against the step's shapes.
struct Layer {
  const at::Tensor* input_norm;
  const at::Tensor* post_norm;
  double eps1, eps2;
  Weight qkv, o, gate_up, down;
  std::vector<float> bias;              // the qkv bias, or empty
  at::Tensor* k_cache;
  at::Tensor* v_cache;
};

// The step's shapes: x (B, T, dim) in `dtype`, H query heads, positions (T,) and cos, sin (T, D).
struct Step {
  int64_t B, T, dim, H, Hkv = 0, S = 0, D = 0, last_pos = 0;
  at::ScalarType dtype;
  const int64_t* pos;
  std::vector<float> cos, sin;
  float scale;
};

Step check_step(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                const at::Tensor& k_cache, int64_t n_heads, double scale, const char* op) {
  TORCH_CHECK(x.dim() == 3 && x.device().is_cpu(), op, ": x must be a (B, T, dim) CPU tensor, got ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": x must be float32 or bfloat16, got ", dtype);
  Step st{x.size(0), x.size(1), x.size(2), n_heads};
  st.dtype = dtype;
  TORCH_CHECK(k_cache.dim() == 4, op, ": a cache must be (B, H_kv, slots, D), got ", k_cache.sizes());
  st.Hkv = k_cache.size(1), st.S = k_cache.size(2), st.D = k_cache.size(3);
  TORCH_CHECK(st.H > 0 && st.Hkv > 0 && st.H % st.Hkv == 0 && st.H / st.Hkv <= 64 && st.D % 2 == 0, op, ": ", st.H,
              " query heads do not share ", st.Hkv, " K/V heads of size ", st.D);
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == st.T && positions.scalar_type() == at::kLong &&
              positions.is_contiguous() && positions.device().is_cpu(), op, ": positions must be (T=", st.T,
              ",) int64 on the CPU, got ", positions.sizes(), " ", positions.scalar_type());
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == st.T && cos.size(1) == st.D && sin.sizes() == cos.sizes() &&
              cos.scalar_type() == dtype && sin.scalar_type() == dtype, op, ": cos and sin must be (T, D) in x's dtype");
  st.pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < st.T; ++t) {
    TORCH_CHECK(st.pos[t] >= 0 && st.pos[t] < st.S, op, ": position ", st.pos[t], " is outside the cache's 0..",
                st.S - 1);
    st.last_pos = std::max(st.last_pos, st.pos[t]);
  }
  st.cos = x_as_float(cos);
  st.sin = x_as_float(sin);
  st.scale = static_cast<float>(scale);
  return st;
}

Layer check_layer(const Step& st, const at::Tensor& input_norm, double eps1, const at::Tensor& post_norm,
                  double eps2, at::TensorList qkv, const at::Tensor* qkv_bias, at::TensorList o,
                  at::TensorList gate_up, at::TensorList down, at::Tensor& k_cache, at::Tensor& v_cache,
                  const char* op) {
  const bool bf16 = st.dtype == at::kBFloat16;
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->dim() == 4 && c->size(0) == st.B && c->size(1) == st.Hkv && c->size(2) == st.S &&
                c->size(3) == st.D && c->is_contiguous() && c->scalar_type() == st.dtype && c->device().is_cpu(), op,
                ": the caches must be contiguous (B=", st.B, ", H_kv=", st.Hkv, ", slots=", st.S, ", D=", st.D,
                ") CPU tensors of x's dtype, got ", c->sizes(), " ", c->scalar_type());
  for (const at::Tensor* n : {&input_norm, &post_norm})
    TORCH_CHECK(n->numel() == st.dim && n->is_contiguous() && n->scalar_type() == st.dtype, op,
                ": the norm weights must be contiguous (", st.dim, ",) in x's dtype");
  Layer L{&input_norm, &post_norm, eps1, eps2, weight_from_parts(qkv, op), weight_from_parts(o, op),
          weight_from_parts(gate_up, op), weight_from_parts(down, op), {}, &k_cache, &v_cache};
  for (const Weight* W : {&L.qkv, &L.o, &L.gate_up, &L.down})
    TORCH_CHECK(W->format == Weight::I8 || W->format == Weight::I4 || (W->format == Weight::BF16) == bf16, op,
                ": a float weight must have x's dtype");
  const int64_t qsize = st.H * st.D, kvsize = st.Hkv * st.D;
  TORCH_CHECK(L.qkv.K == st.dim && L.qkv.N == qsize + 2 * kvsize && L.o.K == qsize && L.o.N == st.dim &&
              L.gate_up.K == st.dim && L.gate_up.N % 2 == 0 && L.down.K == L.gate_up.N / 2 && L.down.N == st.dim,
              op, ": the weights (qkv ", L.qkv.N, "x", L.qkv.K, ", o ", L.o.N, "x", L.o.K, ", gate_up ", L.gate_up.N,
              "x", L.gate_up.K, ", down ", L.down.N, "x", L.down.K, ") do not fit dim ", st.dim, " with ", st.H,
              " + 2x", st.Hkv, " heads of ", st.D);
  if (qkv_bias) {
    TORCH_CHECK(qkv_bias->numel() == L.qkv.N && qkv_bias->scalar_type() == st.dtype, op,
                ": the qkv bias must be (", L.qkv.N, ",) in x's dtype");
    L.bias = x_as_float(*qkv_bias);
  }
  return L;
}

// x += y over M rows of dim, each term and the sum rounded to the model's dtype (the residual adds)
void add_rows(float* x, const float* y, int64_t M, int64_t dim, bool bf16) {
  for_rows(M, [&](int64_t m) {
    float* xr = x + m * dim;
    const float* yr = y + m * dim;
    if (bf16)
      for (int64_t i = 0; i < dim; ++i) xr[i] = round_to(xr[i] + round_to(yr[i], true), true);
    else
      for (int64_t i = 0; i < dim; ++i) xr[i] += yr[i];
  });
}

// x (B·T, dim) float32, rounded to the model's dtype, through one layer in place
void run_layer(const Step& st, const Layer& L, std::vector<float>& x) {
  const bool bf16 = st.dtype == at::kBFloat16;
  const int64_t B = st.B, T = st.T, M = B * T, dim = st.dim, H = st.H, Hkv = st.Hkv, S = st.S, D = st.D;
  const int64_t qsize = H * D, kvsize = Hkv * D, N = L.qkv.N, hidden = L.gate_up.N / 2;
  std::vector<float> h(M * dim), qkv(M * N), att(M * qsize), proj(M * dim), gu(M * L.gate_up.N), act(M * hidden);
  // attention
  rms_norm(x.data(), M, dim, *L.input_norm, L.eps1, bf16, h.data());
  linear_rows(L.qkv, h.data(), M, qkv.data());
  const int64_t half = D / 2;
  for_rows(M, [&](int64_t m) {
    std::vector<float> rotated(D);
    float* row = qkv.data() + m * N;
    const float *c = st.cos.data() + (m % T) * D, *s = st.sin.data() + (m % T) * D;
    if (!L.bias.empty())
      for (int64_t i = 0; i < N; ++i) row[i] = round_to(round_to(row[i], bf16) + L.bias[i], bf16);
    else if (bf16)
      for (int64_t i = 0; i < N; ++i) row[i] = round_to(row[i], true);
    for (int64_t head = 0; head < H + Hkv; ++head) {        // the q heads, then the k heads
      float* v = row + head * D;
      for (int64_t d = 0; d < D; ++d) {
        const float other = d < half ? -v[d + half] : v[d - half];
        rotated[d] = round_to(round_to(v[d] * c[d], bf16) + round_to(other * s[d], bf16), bf16);
      }
      std::copy(rotated.begin(), rotated.end(), v);
    }
  });
  for (int64_t m = 0; m < M; ++m) {                          // k, v into the cache at their positions
    const int64_t b = m / T, t = m % T;
    const float* row = qkv.data() + m * N;
    for (int64_t hk = 0; hk < Hkv; ++hk) {
      const int64_t slot = ((b * Hkv + hk) * S + st.pos[t]) * D;
      const float *kr = row + qsize + hk * D, *vr = row + qsize + kvsize + hk * D;
      if (bf16) {
        c10::BFloat16 *kd = L.k_cache->data_ptr<c10::BFloat16>() + slot;
        c10::BFloat16 *vd = L.v_cache->data_ptr<c10::BFloat16>() + slot;
        for (int64_t d = 0; d < D; ++d) kd[d] = c10::BFloat16(kr[d]), vd[d] = c10::BFloat16(vr[d]);
      } else {
        std::memcpy(L.k_cache->data_ptr<float>() + slot, kr, D * sizeof(float));
        std::memcpy(L.v_cache->data_ptr<float>() + slot, vr, D * sizeof(float));
      }
    }
  }
  AttentionProblem P{B, H, Hkv, T, D, st.last_pos + 1, qkv.data(), T * N, D, N,
                     static_cast<const char*>(L.k_cache->data_ptr()), static_cast<const char*>(L.v_cache->data_ptr()),
                     Hkv * S * D, S * D, D, Hkv * S * D, S * D, D};
  P.last = st.pos;
  P.scale = st.scale;
  P.out = att.data();
  P.os0 = T * qsize, P.os1 = D, P.os2 = qsize;
  if (bf16) attend<WKind::BF16>(P);
  else attend<WKind::F32>(P);
  if (bf16)
    for (float& a : att) a = round_to(a, true);
  linear_rows(L.o, att.data(), M, proj.data());
  add_rows(x.data(), proj.data(), M, dim, bf16);
  // MLP
  rms_norm(x.data(), M, dim, *L.post_norm, L.eps2, bf16, h.data());
  linear_rows(L.gate_up, h.data(), M, gu.data());
  for_rows(M, [&](int64_t m) {
    const float *g = gu.data() + m * L.gate_up.N, *u = g + hidden;
    float* a = act.data() + m * hidden;
    silu(g, hidden, a);
    if (bf16)
      for (int64_t i = 0; i < hidden; ++i) a[i] = round_to(round_to(a[i], true) * round_to(u[i], true), true);
    else
      for (int64_t i = 0; i < hidden; ++i) a[i] *= u[i];
  });
  linear_rows(L.down, act.data(), M, proj.data());
  add_rows(x.data(), proj.data(), M, dim, bf16);
}

at::Tensor decode_layer(const at::Tensor& x_in, const at::Tensor& input_norm, double eps1,
                        const at::Tensor& post_norm, double eps2, at::TensorList qkv,
                        const c10::optional<at::Tensor>& qkv_bias, at::TensorList o_parts,
                        at::TensorList gate_up_parts, at::TensorList down_parts, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                        const at::Tensor& positions, int64_t n_heads, double scale) {
  const char* op = "decode_layer";
  const Step st = check_step(x_in, cos, sin, positions, k_cache, n_heads, scale, op);
  const Layer L = check_layer(st, input_norm, eps1, post_norm, eps2, qkv, qkv_bias ? &*qkv_bias : nullptr, o_parts,
                              gate_up_parts, down_parts, k_cache, v_cache, op);
  std::vector<float> x = x_as_float(x_in);
  run_layer(st, L, x);
  return result(x.data(), x_in.sizes(), x_in);
}

// Every layer of a stack in one call. `tensors` holds, layer after layer: the two norm weights, then the
// parts of qkv, [the qkv bias], o, gate_up and down; `layout` holds five counts a layer (qkv parts, 1 if a
// bias follows else 0, o parts, gate_up parts, down parts) and `eps` the two norms' epsilons.
at::Tensor decode_layers(const at::Tensor& x_in, at::TensorList tensors, at::IntArrayRef layout,
                         at::ArrayRef<double> eps, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& positions,
                         int64_t n_heads, double scale) {
  const char* op = "decode_layers";
  const int64_t n_layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(n_layers > 0 && static_cast<int64_t>(v_caches.size()) == n_layers &&
              static_cast<int64_t>(layout.size()) == 5 * n_layers && static_cast<int64_t>(eps.size()) == 2 * n_layers,
              op, ": ", n_layers, " K caches, ", v_caches.size(), " V caches, ", layout.size(), " layout entries and ",
              eps.size(), " epsilons do not describe the same number of layers (5 layout entries and 2 epsilons each)");
  const Step st = check_step(x_in, cos, sin, positions, k_caches[0], n_heads, scale, op);
  std::vector<Layer> layers;
  size_t next = 0;
  auto take = [&](int64_t n) {
    TORCH_CHECK(n >= 0 && next + n <= tensors.size(), op, ": the layout asks for more tensors than the ",
                tensors.size(), " given");
    at::TensorList part = tensors.slice(next, n);
    next += n;
    return part;
  };
  for (int64_t l = 0; l < n_layers; ++l) {
    const int64_t* c = layout.data() + 5 * l;
    at::TensorList norms = take(2), qkv = take(c[0]), bias = take(c[1]), o = take(c[2]), gu = take(c[3]),
                   down = take(c[4]);
    layers.push_back(check_layer(st, norms[0], eps[2 * l], norms[1], eps[2 * l + 1], qkv,
                                 bias.empty() ? nullptr : &bias[0], o, gu, down,
                                 const_cast<at::Tensor&>(k_caches[l]), const_cast<at::Tensor&>(v_caches[l]), op));
  }
  TORCH_CHECK(next == tensors.size(), op, ": ", tensors.size() - next, " tensors are left over after the layout");
  std::vector<float> x = x_as_float(x_in);
  for (const Layer& L : layers) run_layer(st, L, x);
  return result(x.data(), x_in.sizes(), x_in);
}

bool uses_avx2() { return has_avx2(); }

}  // namespace

TORCH_LIBRARY(llminfer, m) {
  m.def("gemv_f32(Tensor x, Tensor w) -> Tensor");
  m.def("gemv_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("gemv_int8(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("gemv_int4(Tensor x, Tensor w, Tensor scale, Tensor offset, int group) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  m.def("decode_layer(Tensor x, Tensor input_norm, float eps1, Tensor post_norm, float eps2, Tensor[] qkv, "
        "Tensor? qkv_bias, Tensor[] o, Tensor[] gate_up, Tensor[] down, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor positions, int n_heads, float scale) -> Tensor");
  m.def("decode_layers(Tensor x, Tensor[] tensors, int[] layout, float[] eps, Tensor cos, Tensor sin, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor positions, int n_heads, float scale) -> Tensor");
  m.def("cpu_kernel_isa() -> str", []() -> std::string { return uses_avx2() ? "avx2+fma" : "portable"; });
}

TORCH_LIBRARY_IMPL(llminfer, CPU, m) {
  m.impl("gemv_f32", &gemv_f32);
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("gemv_int8", &gemv_int8);
  m.impl("gemv_int4", &gemv_int4);
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_layers", &decode_layers);
}

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
template <WKind kind>
__attribute__((target("avx2,fma"))) float kv_dot_avx2(const float* q, const void* k, int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    a0 = _mm256_fmadd_ps(wload8<kind>(k, d), load8(q + d), a0);
    a1 = _mm256_fmadd_ps(wload8<kind>(k, d + 8), load8(q + d + 8), a1);
  }
  for (; d < D; d += 8) a0 = _mm256_fmadd_ps(wload8<kind>(k, d), load8(q + d), a0);
  return hsum(_mm256_add_ps(a0, a1));
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

template <WKind kind>
__attribute__((target("avx2,fma"))) void kv_axpy_avx2(float p, const void* v, float* out, int64_t D) {
  const __m256 pp = _mm256_set1_ps(p);
  for (int64_t d = 0; d < D; d += 8)
    _mm256_storeu_ps(out + d, _mm256_fmadd_ps(wload8<kind>(v, d), pp, _mm256_loadu_ps(out + d)));
}
#endif

// ---------------------------------------------------------------------------------------------------
// the ops

constexpr int64_t kGrain = 64;   // output rows a thread takes at least

void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be on the CPU, got ", x.device());
  TORCH_CHECK(x.dim() == 2, op, ": x must be (tokens, in_features), got ", x.sizes());
  TORCH_CHECK(x.size(1) == K, op, ": x has ", x.size(1), " inputs, the weight ", K);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
}

// x as contiguous float32 (M, K)
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

// y (M, N) float32 -> a tensor in x's dtype
at::Tensor result(const std::vector<float>& y, int64_t M, int64_t N, const at::Tensor& x) {
  at::Tensor out = at::empty({M, N}, x.options());
  if (x.scalar_type() == at::kFloat) {
    std::memcpy(out.data_ptr<float>(), y.data(), y.size() * sizeof(float));
  } else {
    c10::BFloat16* p = out.data_ptr<c10::BFloat16>();
    for (size_t i = 0; i < y.size(); ++i) p[i] = c10::BFloat16(y[i]);
  }
  return out;
}

template <WKind kind>
at::Tensor dense_gemv(const at::Tensor& x, const at::Tensor& w, const float* scale, const char* op) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), op, ": the weight must be a contiguous (N, K) matrix");
  const int64_t N = w.size(0), K = w.size(1), M = x.size(0);
  check_x(x, K, op);
  std::vector<float> xf = x_as_float(x), y(M * N);
  const void* wp = w.data_ptr();
  const bool avx2 = has_avx2();
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
#ifdef LLMINFER_X86
    if (avx2) return rows_avx2<kind>(xf.data(), M, K, wp, scale, y.data(), N, n0, n1);
#endif
    rows_portable<kind>(xf.data(), M, K, wp, scale, y.data(), N, n0, n1);
  });
  (void)avx2;
  return result(y, M, N, x);
}

at::Tensor gemv_f32(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat, "gemv_f32: the weight must be float32, got ", w.scalar_type());
  return dense_gemv<WKind::F32>(x, w, nullptr, "gemv_f32");
}

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "gemv_bf16: the weight must be bfloat16, got ", w.scalar_type());
  return dense_gemv<WKind::BF16>(x, w, nullptr, "gemv_bf16");
}

at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(w.scalar_type() == at::kChar, "gemv_int8: the codes must be int8, got ", w.scalar_type());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == w.size(0),
              "gemv_int8: scale must be float32 with one entry per output row (", w.size(0), ")");
  return dense_gemv<WKind::I8>(x, w, scale.data_ptr<float>(), "gemv_int8");
}

at::Tensor gemv_int4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& offset,
                     int64_t group) {
  const char* op = "gemv_int4";
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), op,
              ": the codes must be contiguous (N, K/2) uint8");
  const int64_t N = w.size(0), K = w.size(1) * 2, M = x.size(0);
  check_x(x, K, op);
  TORCH_CHECK(group > 0 && group % 32 == 0 && K % group == 0, op, ": group ", group,
              " must be a multiple of 32 that divides ", K);
  const int64_t G = K / group;
  for (const at::Tensor* t : {&scale, &offset})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == N * G, op,
                ": scale and offset must be contiguous float32 (", N, ", ", G, ")");
  std::vector<float> xf = x_as_float(x), xp(M * K), xsum(M * G, 0.f), y(M * N);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < K; b += 32) {
      for (int j = 0; j < 16; ++j) {
        xp[m * K + b + j] = xf[m * K + b + 2 * j];
        xp[m * K + b + 16 + j] = xf[m * K + b + 2 * j + 1];
      }
    }
    for (int64_t k = 0; k < K; ++k) xsum[m * G + k / group] += xf[m * K + k];
  }
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float *sp = scale.data_ptr<float>(), *op_ = offset.data_ptr<float>();
  const bool avx2 = has_avx2();
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
#ifdef LLMINFER_X86
    if (avx2) return rows_int4_avx2(xp.data(), xsum.data(), M, K, wp, sp, op_, group, y.data(), N, n0, n1);
#endif
    rows_int4_portable(xp.data(), xsum.data(), M, K, wp, sp, op_, group, y.data(), N, n0, n1);
  });
  (void)avx2;
  return result(y, M, N, x);
}


// ---------------------------------------------------------------------------------------------------
// decode attention: a few queries against a K/V cache, read in place. q (B, H, Tq, D); k, v (B, Hkv, Tk, D)
// with unit stride along D; an optional boolean mask broadcastable to (B, H, Tq, Tk) (True = may attend),
// else the causal rule (query i sees keys 0 .. Tk - Tq + i). Scores, softmax and the weighted sum of V are
// computed in float32, positions a mask hides are skipped. A row with no visible key gives NaN, as softmax
// over nothing does.

template <WKind kind>
inline float kv_dot(const float* q, const char* k, int64_t D, bool avx2) {
#ifdef LLMINFER_X86
  if (avx2) return kv_dot_avx2<kind>(q, k, D);
#endif
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d) s += q[d] * weight_at<kind>(k, d);
  return s;
}

template <WKind kind>
inline void kv_axpy(float p, const char* v, float* out, int64_t D, bool avx2) {
#ifdef LLMINFER_X86
  if (avx2) return kv_axpy_avx2<kind>(p, v, out, D);
#endif
  for (int64_t d = 0; d < D; ++d) out[d] += p * weight_at<kind>(v, d);
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

// One (batch, K/V head, query position): the `group` query heads that share the K/V head, together, so
// each key and value row is read once for all of them.
template <WKind kind>
void attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const bool* mask,
                 const int64_t* mstride, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Tk = k.size(2), group = H / Hkv;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2), qs3 = q.stride(3);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const void* qp = q.data_ptr();
  void* op = out.data_ptr();
  const int64_t esize = wbytes<kind>();
  const bool avx2 = has_avx2() && D % 8 == 0;
  const float fscale = static_cast<float>(scale), neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * Hkv * Tq, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> qf(group * D), acc(group * D), scores(group * Tk), best(group), total(group);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / (Hkv * Tq), hk = (r / Tq) % Hkv, t = r % Tq;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = weight_at<kind>(qp, b * qs0 + (hk * group + g) * qs1 + t * qs2 + d * qs3);
      std::fill(best.begin(), best.end(), neg_inf);
      for (int64_t j = 0; j < Tk; ++j) {
        const char* krow = kp + (b * ks0 + hk * ks1 + j * ks2) * esize;
        for (int64_t g = 0; g < group; ++g) {
          const bool visible = mask ? mask[b * mstride[0] + (hk * group + g) * mstride[1] + t * mstride[2] +
                                           j * mstride[3]]
                                    : j <= Tk - Tq + t;
          float sc = neg_inf;
          if (visible) {
            sc = kv_dot<kind>(qf.data() + g * D, krow, D, avx2) * fscale;
            best[g] = std::max(best[g], sc);
          }
          scores[g * Tk + j] = sc;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < group; ++g)
        total[g] = best[g] == neg_inf ? 0.f : softmax_numerators(scores.data() + g * Tk, Tk, best[g], avx2);
      for (int64_t j = 0; j < Tk; ++j) {
        const char* vrow = vp + (b * vs0 + hk * vs1 + j * vs2) * esize;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * Tk + j];
          if (p != 0.f) kv_axpy<kind>(p, vrow, acc.data() + g * D, D, avx2);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inv = total[g] > 0.f ? 1.f / total[g] : std::numeric_limits<float>::quiet_NaN();
        const int64_t base = ((b * H + hk * group + g) * Tq + t) * D;
        for (int64_t d = 0; d < D; ++d) {
          if constexpr (kind == WKind::F32) static_cast<float*>(op)[base + d] = acc[g * D + d] * inv;
          else static_cast<c10::BFloat16*>(op)[base + d] = c10::BFloat16(acc[g * D + d] * inv);
        }
      }
    }
  });
}

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
              H % k_in.size(1) == 0 && k_in.size(2) >= Tq, op, ": shapes q ", q.sizes(), ", k ", k_in.sizes(),
              ", v ", v_in.sizes(), " do not fit (B, H, Tq, D) against (B, H_kv, Tk >= Tq, D) with H a multiple of H_kv");
  const at::Tensor k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const at::Tensor v = v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  at::Tensor mask;
  int64_t mstride[4] = {0, 0, 0, 0};
  if (mask_in.has_value()) {
    TORCH_CHECK(mask_in->scalar_type() == at::kBool, op, ": the mask must be boolean (True = may attend)");
    mask = mask_in->expand({B, H, Tq, k.size(2)});
    for (int i = 0; i < 4; ++i) mstride[i] = mask.stride(i);
  }
  at::Tensor out = at::empty({B, H, Tq, D}, q.options());
  const bool* mp = mask_in.has_value() ? mask.data_ptr<bool>() : nullptr;
  if (q.scalar_type() == at::kFloat) attend_rows<WKind::F32>(q, k, v, mp, mstride, scale, out);
  else attend_rows<WKind::BF16>(q, k, v, mp, mstride, scale, out);
  return out;
}

bool uses_avx2() { return has_avx2(); }

}  // namespace

TORCH_LIBRARY(llminfer, m) {
  m.def("gemv_f32(Tensor x, Tensor w) -> Tensor");
  m.def("gemv_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("gemv_int8(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("gemv_int4(Tensor x, Tensor w, Tensor scale, Tensor offset, int group) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  m.def("cpu_kernel_isa() -> str", []() -> std::string { return uses_avx2() ? "avx2+fma" : "portable"; });
}

TORCH_LIBRARY_IMPL(llminfer, CPU, m) {
  m.impl("gemv_f32", &gemv_f32);
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("gemv_int8", &gemv_int8);
  m.impl("gemv_int4", &gemv_int4);
  m.impl("decode_attention", &decode_attention);
}

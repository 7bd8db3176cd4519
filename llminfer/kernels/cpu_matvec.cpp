// Matrix-vector kernels for decode on a CPU: y = x · Wᵀ for a few rows of x and a weight W held as
// float32, bfloat16, int8 (one scale per output channel) or int4 (a scale and zero point per group of
// inputs). Chapter 08.
//
// A decode step multiplies one activation vector by every weight matrix, so its speed is how fast the
// weights stream from memory. These loops read each weight row once, in order, four rows at a time
// (four streams for the prefetchers), widen the weights to float32 in registers and multiply-add them
// into float32 accumulators. Nothing is repacked: they read the checkpoint's own row-major layout
// (int4 as two codes a byte, the even input in the low nibble). x stays in cache for the whole matrix.
// With many rows of x, `linear_rows` hands the product to the blocked kernel (cpu_gemm.cpp).
//
// The AVX2 versions are chosen at run time when the CPU has AVX2 and FMA; elsewhere the portable loops run
// (the compiler vectorises them).

#include "cpu_kernels.h"

namespace llminfer_cpu {

// ---------------------------------------------------------------------------------------------------
// portable loops

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
  if (avx2 && M > kMatvecMaxRows) return gemm_avx2(x, M, W, y);
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


}  // namespace llminfer_cpu

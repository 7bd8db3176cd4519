// Matrix-vector kernels for decode on a CPU: y = x · Wᵀ for a few rows of x and a weight W held as float32,
// bfloat16, int8 (a scale per output channel or per group of inputs) or int4 (a scale and offset per group of inputs,
// in tiles of 8 rows). Chapter 08.
//
// A decode step multiplies one activation vector by every weight matrix, so its speed is how fast the weights stream
// from memory. These loops read each weight row once, in order, four rows at a time (four streams for the
// prefetchers), widen the weights to float32 in registers and multiply-add them into float32 accumulators. float32,
// bfloat16 and int8 are read in the checkpoint's row-major layout; int4 in tiles of 8 rows (one 32-bit word a row for
// 8 inputs, 8 rows side by side), where one AND and one conversion per 8 codes serve 8 rows at once. x stays in cache
// for the whole matrix. With many rows of x, `linear_rows` hands the product to the blocked kernel (cpu_gemm.cpp).
// cpu_ref.cpp holds the portable reference of each loop.
//
// Each loop exists for several instruction sets, each compiled with its own target attribute (the file is built
// without -march, so it loads on any x86 CPU). Which may run is set once per process (`features()`, from the CPU's
// flags or LLMINFER_ISA), and which of them each format's decode loops use by the static table in
// llminfer/cpu/__init__.py (`matvec_features(kind)`):
//   AVX2 + FMA   8 floats a register; int4 codes isolated in place, 8 rows a register; W4A8 by maddubs + madd
//   AVX-512      16 floats a register (float32, int8, int4); bfloat16 32 weights a load, the even ones by a shift and
//                the odd by an AND
//   AVX512-VNNI  int4 (x as three int8 planes) and W4A8 by vpdpbusd on 512-bit registers
//   AVX512-BF16  bfloat16 weights by vdpbf16ps, where x is bfloat16 already (a bfloat16 model's activations)

#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include "cpu_kernels.h"

namespace llminfer_cpu {

// ---------------------------------------------------------------------------------------------------
// the instruction sets in use

namespace {
std::atomic<int64_t> g_features{-1};

#ifdef LLMINFER_X86
// Whether the CPU has AMX tiles with AMX-BF16 (CPUID leaf 7: EDX bits 22 and 24) and Linux lets this process use
// the tile data (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, asked once; a kernel without it refuses)
bool amx_bf16_granted() {
  static const bool granted = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
#ifdef __linux__
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return false;
#endif
  }();
  return granted;
}
#endif

int64_t cpu_supported() {
  int64_t bits = 0;
#ifdef LLMINFER_X86
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    bits |= kAVX2;
  if ((bits & kAVX2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    bits |= kAVX512;
  if ((bits & kAVX512) && __builtin_cpu_supports("avx512vnni")) bits |= kAVX512VNNI;
  if ((bits & kAVX512) && __builtin_cpu_supports("avx512bf16")) bits |= kAVX512BF16;
  if ((bits & kAVX512BF16) && amx_bf16_granted()) bits |= kAMXBF16;
#endif
  return bits;
}
}  // namespace

int64_t features() {
  int64_t bits = g_features.load(std::memory_order_relaxed);
  if (bits < 0) {                                   // not set yet: AVX2 + FMA where the CPU has them
    bits = cpu_supported() & kAVX2;
    g_features.store(bits, std::memory_order_relaxed);
  }
  return bits;
}

namespace {
std::atomic<int64_t> g_matvec[kMatvecKinds] = {-1, -1, -1, -1, -1};
}

int64_t set_features(int64_t bits, const std::vector<int64_t>& decode) {
  TORCH_CHECK(decode.empty() || static_cast<int64_t>(decode.size()) == kMatvecKinds, "set_cpu_features: decode holds ",
              kMatvecKinds, " formats' bits, got ", decode.size());
  int64_t missing = bits & ~cpu_supported();
  for (const int64_t loop : decode) missing |= loop & ~bits;
  if (missing) return missing;
  g_features.store(bits, std::memory_order_relaxed);
  for (int64_t kind = 0; kind < kMatvecKinds; ++kind)
    g_matvec[kind].store(decode.empty() ? -1 : decode[kind], std::memory_order_relaxed);
  return 0;
}

int64_t matvec_features(int64_t kind) {
  const int64_t bits = g_matvec[kind].load(std::memory_order_relaxed);
  return bits < 0 ? features() : bits;
}

namespace {
int64_t matvec_kind(const Weight& W) {
  switch (W.format) {
    case Weight::F32: return kMatvecF32;
    case Weight::BF16: return kMatvecBF16;
    case Weight::I8: return kMatvecI8;
    default: return W.int8_activations ? kMatvecI4A8 : kMatvecI4;
  }
}
}  // namespace

// rows [n0, n1) of y (M, N) for the dense-row formats by `Dot`: Dot<4> takes four rows of W at a time against one
// row of xp (rows of x as Dot reads them) while the next four, contiguous after them (`ahead`), are prefetched at
// the same pace (the hardware prefetcher alone ramps up too slowly on rows a few KB long); Dot<1> the rest. An int8
// weight with one scale a row has it applied here.
template <typename X, void (*Dot4)(const X*, const Weight&, int64_t, float*, const char*),
          void (*Dot1)(const X*, const Weight&, int64_t, float*, const char*)>
void rows_by(const X* xp, int64_t M, const Weight& W, float* y, int64_t n0, int64_t n1) {
  const int64_t K = W.K, N = W.N;
  const int64_t row_bytes = K * (W.format == Weight::F32 ? 4 : W.format == Weight::BF16 ? 2 : 1);
  const float* row_scale = W.format == Weight::I8 && W.group == K ? W.scale : nullptr;
  float out[4];
  for (int64_t n = n0; n < n1;) {
    const int R = n + 4 <= n1 ? 4 : 1;
    const char* ahead = R == 4 && n + 8 <= n1 ? static_cast<const char*>(W.w) + (n + 4) * row_bytes : nullptr;
    for (int64_t m = 0; m < M; ++m) {
      (R == 4 ? Dot4 : Dot1)(xp + m * K, W, n, out, m == 0 ? ahead : nullptr);
      for (int r = 0; r < R; ++r) y[m * N + n + r] = row_scale ? out[r] * row_scale[n + r] : out[r];
    }
    n += R;
  }
}

#ifdef LLMINFER_X86
// R rows of a float32, bfloat16 or int8 weight against x, written once over the vector width V (V8: AVX2 + FMA,
// 8 floats a register; V16: AVX-512, 16): two chains a row, 2·V::kLanes inputs a step, the weights widened to float32
// in registers (bfloat16 on 512-bit registers takes bf16_rows_avx512 instead)
#define LLMINFER_DOT_ROWS(NAME, V, TARGET)                                                                      \
  template <WKind kind, int R>                                                                                  \
  __attribute__((target(TARGET))) void NAME(const float* x, const Weight& W, int64_t n, float* out,            \
                                            const char* ahead) {                                               \
    constexpr int64_t L = V::kLanes, step_bytes = 2 * L * wbytes<kind>() * R;                                  \
    const int64_t K = W.K;                                                                                     \
    typename V::Vec a0[R], a1[R];                                                                              \
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = V::zero();                                                     \
    int64_t k = 0;                                                                                             \
    for (; k + 2 * L <= K; k += 2 * L) {                                                                       \
      if (ahead)                                                                                               \
        for (int64_t line = 0; line < step_bytes; line += 64)                                                  \
          _mm_prefetch(ahead + k * wbytes<kind>() * R + line, _MM_HINT_T0);                                    \
      const typename V::Vec x0 = V::load(x + k), x1 = V::load(x + k + L);                                  \
      for (int r = 0; r < R; ++r) {                                                                            \
        a0[r] = V::fmadd(V::template wload<kind>(W.w, (n + r) * K + k), x0, a0[r]);                            \
        a1[r] = V::fmadd(V::template wload<kind>(W.w, (n + r) * K + k + L), x1, a1[r]);                        \
      }                                                                                                        \
    }                                                                                                          \
    for (int r = 0; r < R; ++r) {                                                                              \
      float s = V::hsum(V::add(a0[r], a1[r]));                                                                 \
      for (int64_t j = k; j < K; ++j) s += x[j] * weight_at<kind>(W.w, (n + r) * K + j);                       \
      out[r] = s;                                                                                              \
    }                                                                                                          \
  }
LLMINFER_DOT_ROWS(dot_rows_avx2, V8, "avx2,fma")
LLMINFER_DOT_ROWS(dot_rows_avx512, V16, LLMINFER_AVX512)
#undef LLMINFER_DOT_ROWS

// int8 with a scale per group of inputs (GGUF's Q8_0: groups of 32), R rows: per group q·x in two vector
// chains, scaled into the row's accumulator by one FMA
template <int R>
__attribute__((target("avx2,fma"))) void int8g_rows_avx2(const float* x, const Weight& W, int64_t n, float* out,
                                                          const char* ahead) {
  const int64_t K = W.K, group = W.group, G = K / group;
  __m256 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
      if (ahead && k % 64 == 0) {
        for (int64_t line = 0; line < 64 * R; line += 64) _mm_prefetch(ahead + k * R + line, _MM_HINT_T0);
      }
      const __m256 x0 = V8::load(x + k), x1 = V8::load(x + k + 8);
      for (int r = 0; r < R; ++r) {
        a0[r] = _mm256_fmadd_ps(V8::wload<WKind::I8>(W.w, (n + r) * K + k), x0, a0[r]);
        a1[r] = _mm256_fmadd_ps(V8::wload<WKind::I8>(W.w, (n + r) * K + k + 8), x1, a1[r]);
      }
    }
    for (int r = 0; r < R; ++r)
      total[r] = _mm256_fmadd_ps(_mm256_add_ps(a0[r], a1[r]), _mm256_set1_ps(W.scale[(n + r) * G + g]), total[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = V8::hsum(total[r]);
}

// ---------------------------------------------------------------------------------------------------
// int4 in tiles of 8 rows (the layout the quantized layers keep for these kernels): codes (N/8, K/8, 32) bytes,
// where tile t, chunk c holds, as 8 little-endian 32-bit words, rows 8t..8t+7's codes for inputs 8c..8c+7 (word
// j: row 8t+j, its nibble i the code of input 8c+i; the bytes are the row-major nibbles of that row, in place).
// scale and offset are (N/8, G, 8): the 8 rows of a tile next to each other for each group. One 32-byte load
// brings 64 codes, the lane of a row holding its 8 codes; each code is isolated in place by one AND (the last by
// one shift) and converted by one vcvtdq2ps (code i arrives as q·16^i, so x is read pre-scaled by 16^-i: an exact
// power of two), and multiplied into the 8 rows at once against x broadcast from L1. A tile's bytes are one stream.

// xs (M, K): x with input 8c+i multiplied by 16^-i (i < 7), and x itself for i = 7, whose code is shifted down to
// the bottom (q·2^28 does not fit a positive int32; one shift isolates it, where an AND would follow any other);
// made only where `placed` (for the AVX2 loop: the AVX-512 and portable ones read x itself); xsum (M, G) the
// group sums of x
struct Int4TX {
  std::vector<float> xs, xsum;
};

Int4TX int4t_x(const float* x, int64_t M, int64_t K, int64_t group, bool placed) {
  static const float kPlace[8] = {1.f, 1.f / 16, 1.f / 256, 1.f / 4096, 1.f / 65536, 1.f / 1048576,
                                  1.f / 16777216, 1.f};
  const int64_t G = K / group;
  Int4TX out;
  if (placed) out.xs.resize(M * K);
  out.xsum.assign(M * G, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {                    // (groups outside: no division per input)
      float sum = 0.f;
      for (int64_t k = g * group; k < (g + 1) * group; k += 8)
        for (int i = 0; i < 8; ++i) {
          if (placed) out.xs[m * K + k + i] = x[m * K + k + i] * kPlace[i];
          sum += x[m * K + k + i];
        }
      out.xsum[m * G + g] = sum;
    }
  return out;
}

#ifdef LLMINFER_X86
// T tiles (8T rows) for one row of x: out[8t + j] for row 8(tile + t) + j
template <int T>
__attribute__((target("avx2,fma,f16c"))) void int4t_tiles_avx2(const float* xs, const float* xsum, int64_t K,
                                                               const uint8_t* w, Terms terms, int64_t group,
                                                               int64_t tile, float* out) {
  const int64_t G = K / group;
  const __m256i mask[7] = {_mm256_set1_epi32(0xF), _mm256_set1_epi32(0xF0), _mm256_set1_epi32(0xF00),
                           _mm256_set1_epi32(0xF000), _mm256_set1_epi32(0xF0000), _mm256_set1_epi32(0xF00000),
                           _mm256_set1_epi32(0xF000000)};
  const uint8_t* codes[T];
  for (int t = 0; t < T; ++t) codes[t] = w + (tile + t) * (K / 8) * 32;
  const int64_t ahead = T * (K / 8) * 32;                 // bytes from a tile to the one T tiles on
  __m256 total[T], off[T];
  for (int t = 0; t < T; ++t) total[t] = off[t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 a[T], b[T], c[T], d[T];                          // four chains a tile: codes i % 4
    for (int t = 0; t < T; ++t) a[t] = b[t] = c[t] = d[t] = _mm256_setzero_ps();
    for (int t = 0; t < T; ++t) {                        // the next T tiles' scales and offsets
      prefetch_terms(terms, ((tile + T + t) * G + g) * 8);
    }
    for (int64_t k = g * group; k < (g + 1) * group; k += 8) {
      if (k % 16 == 0)                                    // the next T tiles' codes, a line every 16 inputs
        for (int t = 0; t < T; ++t) _mm_prefetch(reinterpret_cast<const char*>(codes[t] + ahead + k * 4), _MM_HINT_T0);
      __m256i v[T];
      for (int t = 0; t < T; ++t) v[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes[t] + k * 4));
      const float* xk = xs + k;
      for (int i = 0; i < 7; ++i) {
        const __m256 xb = _mm256_broadcast_ss(xk + i);
        for (int t = 0; t < T; ++t) {
          const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(v[t], mask[i]));
          __m256& chain = i % 4 == 0 ? a[t] : i % 4 == 1 ? b[t] : i % 4 == 2 ? c[t] : d[t];
          chain = _mm256_fmadd_ps(q, xb, chain);
        }
      }
      const __m256 xb = _mm256_broadcast_ss(xk + 7);
      for (int t = 0; t < T; ++t)
        d[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v[t], 28)), xb, d[t]);
    }
    const __m256 xg = _mm256_broadcast_ss(xsum + g);
    for (int t = 0; t < T; ++t) {
      const int64_t at = ((tile + t) * G + g) * 8;
      total[t] = _mm256_fmadd_ps(_mm256_add_ps(_mm256_add_ps(a[t], b[t]), _mm256_add_ps(c[t], d[t])),
                                 terms8(terms.scale, terms.half, at), total[t]);
      off[t] = _mm256_fmadd_ps(terms8(terms.offset, terms.half, at), xg, off[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm256_storeu_ps(out + 8 * t, _mm256_add_ps(total[t], off[t]));
}

// tiles [t0, t1) of y (M, N) for float x, two tiles at a time (`Tiles2`), a last odd one alone (`Tiles1`); xs is x
// as the loops read it
using Int4TTiles = void (*)(const float*, const float*, int64_t, const uint8_t*, Terms, int64_t, int64_t, float*);
template <Int4TTiles Tiles2, Int4TTiles Tiles1>
void rows_int4t(const float* xs, const float* xsum, int64_t M, int64_t K, const uint8_t* w, Terms terms,
                int64_t group, float* y, int64_t N, int64_t t0, int64_t t1) {
  const int64_t G = K / group;
  float out[32];
  for (int64_t t = t0; t < t1;) {
    const int T = t + 2 <= t1 ? 2 : 1;
    for (int64_t m = 0; m < M; ++m) {
      if (T == 2) Tiles2(xs + m * K, xsum + m * G, K, w, terms, group, t, out);
      else Tiles1(xs + m * K, xsum + m * G, K, w, terms, group, t, out);
      std::memcpy(y + m * N + t * 8, out, 8 * T * sizeof(float));
    }
    t += T;
  }
}

// AVX-512, 16 lanes: one 64-byte load brings two chunks of a tile (inputs 8c..8c+15: lanes 0-7 the 8 rows' codes
// for the first 8 inputs, lanes 8-15 for the next 8). Code i of each half takes no conversion: one shift moves it
// to the top 4 bits of a float's mantissa and one vpternlogd keeps them under the exponent of 1.0, so the lane
// holds 1 + q/16 exactly. That is multiplied into a chain against x (plain, not scaled) whose lanes 0-7 hold input
// 8c+i and lanes 8-15 input 8c+8+i (one vpermps of the 16 inputs, shared by the tiles). A group's chains then hold
// Σ(1 + q/16)·x = Σx + Σq·x/16, so its scale is taken 16 times and its offset less those 16 scales:
// 16s·(Σx + Σq·x/16) + (o - 16s)·Σx = s·Σq·x + o·Σx. The two halves are summed at the end. (On a Zen 5, against
// one AND and one vcvtdq2ps a code, a (49152 x 576) product ran 1.03 to 1.04 times as fast.)
#define LLMINFER_AVX512_TILES "avx2,fma,f16c,avx512f,avx512bw,avx512vl"

template <int T>
__attribute__((target(LLMINFER_AVX512_TILES))) void int4t_tiles_avx512(const float* x, const float* xsum, int64_t K,
                                                                       const uint8_t* w, Terms terms, int64_t group,
                                                                       int64_t tile, float* out) {
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
    for (int t = 0; t < T; ++t) {
      prefetch_terms(terms, ((tile + T + t) * G + g) * 8);
    }
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

// The bytes of x the 512-bit int8 dot-product loops on int4 tiles multiply, laid out once per product so that they
// read each pair of chunks' even and odd fours as whole registers: per 16 inputs (chunks c and c + 1, each in xq as
// its 4 even then its 4 odd inputs), 128 bytes: c's even four 8 times, c + 1's even four 8 times (lanes 0-7 and
// 8-15 of one load), then the two odd fours the same way. spread: K·8 bytes; K a multiple of 16. (The 256-bit loops
// broadcast each four from xq instead: read spread, 8 times the bytes, a decode step on a Zen 3 ran 1.2-1.3x
// slower.)
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

// W4A8 on the tiled layout, one tile for one row of x. xq holds each chunk of 8 inputs as its 4 even then its 4
// odd ones (int8; x ≈ xq·dx, one dx a block of 32). A word's low nibbles (AND 0x0F0F0F0F) are a row's 4 even
// codes as bytes, its high ones (shift, AND) the 4 odd: against the chunk's even and odd bytes broadcast to every
// lane, maddubs sums the byte products in pairs to int16 (at most 2·15·128 each, 8 of them a block: 30720 fits),
// and one madd with ones sums the block's pairs to int32 for each of the 8 rows. Then one conversion and one FMA by
// dx, and per group one FMA by the 8 rows' scales.
__attribute__((target("avx2,fma,f16c"))) void int4t_a8_avx2(const int8_t* xq, const float* dx, const float* xsum,
                                                            int64_t K, const uint8_t* w, Terms terms, int64_t group,
                                                            int64_t tile, float* out) {
  const int64_t G = K / group;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint8_t* codes = w + tile * (K / 8) * 32;
  const int64_t ahead = (K / 8) * 32;                   // bytes from a tile to the next
  __m256 total = _mm256_setzero_ps(), off = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc = _mm256_setzero_ps();
    prefetch_terms(terms, ((tile + 1) * G + g) * 8);
    for (int64_t b = g * group; b < (g + 1) * group; b += 32) {
      __m256i sum = _mm256_setzero_si256();
      for (int64_t k = b; k < b + 32; k += 8) {
        if (k % 16 == 0) _mm_prefetch(reinterpret_cast<const char*>(codes + ahead + k * 4), _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + k * 4));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        int32_t even, odd;
        std::memcpy(&even, xq + k, 4);
        std::memcpy(&odd, xq + k + 4, 4);
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(even)));
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(odd)));
      }
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum, ones)), _mm256_set1_ps(dx[b / 32]), acc);
    }
    const int64_t at = (tile * G + g) * 8;
    total = _mm256_fmadd_ps(acc, terms8(terms.scale, terms.half, at), total);
    off = _mm256_fmadd_ps(terms8(terms.offset, terms.half, at), _mm256_broadcast_ss(xsum + g), off);
  }
  _mm256_storeu_ps(out, _mm256_add_ps(total, off));
}

// int8 dot products on 512-bit registers (AVX512-VNNI), for W4A8 and for int4 with float x. One 64-byte load
// brings two chunks of a tile, as in the weight-only loop above. The x bytes each half multiplies are laid out once
// per product (`int4t_spread`, which the 256-bit loops read too), so the vpdpbusd read them straight from L1.
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
__attribute__((target(LLMINFER_AVX512_TILES ",avx512vnni"))) void int4t_dp_avx512(
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
// a time: W4A8's loop is short enough that two tiles' streams at once (as the float loops read them) slowed it from
// memory, to below one tile's pace, on a Zen 4; for the three planes, two tiles at once were slower too (Zen 5)
// (xq: each row of x as `Tile` reads it, `spread` bytes an input: 1 for xq itself, 3 for its three planes, 8 and 24
// for those in `int4t_spread`'s layout)
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
#endif

// ---------------------------------------------------------------------------------------------------
// bfloat16 on 512-bit registers (compiled for AVX-512; they run only where the CPU has it)

// bfloat16, R rows, 16 lanes: one 64-byte load brings 32 weights, two a 32-bit lane; a bfloat16 is the top half of
// its float32, so the lane shifted left by 16 is the even weight and the lane ANDed with 0xFFFF0000 the odd one (2
// instructions for 32 weights, where widening 16 at a time takes 4; on a Zen 4 the widening loop was bound by its
// instructions, below memory speed), against xp's chunk of 32 as its 16 even, then its 16 odd entries
// (`even_odd`); x itself for the inputs after the last chunk
template <int R>
__attribute__((target(LLMINFER_AVX512))) void bf16_rows_avx512(const float* xp, const Weight& W, int64_t n, float* out,
                                                                const char* ahead) {
  const int64_t K = W.K;
  const uint16_t* w = static_cast<const uint16_t*>(W.w);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (ahead) {
      for (int64_t line = 0; line < 64 * R; line += 64) _mm_prefetch(ahead + k * 2 * R + line, _MM_HINT_T0);
    }
    const __m512 xe = _mm512_loadu_ps(xp + k), xo = _mm512_loadu_ps(xp + k + 16);
    for (int r = 0; r < R; ++r) {
      const __m512i v = _mm512_loadu_si512(w + (n + r) * K + k);
      even[r] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), xe, even[r]);
      odd[r] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, high)), xo, odd[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float sum = V16::hsum(_mm512_add_ps(even[r], odd[r]));
    for (int64_t j = k; j < K; ++j) sum += xp[j] * weight_at<WKind::BF16>(w, (n + r) * K + j);
    out[r] = sum;
  }
}

// bfloat16 weights by vdpbf16ps: xb is x as bfloat16, 32 inputs a step in pairs; the products are summed in
// float32. Taken only where x is bfloat16 already (`bfloat16_exact`), so rounding it changes nothing.
template <int R>
__attribute__((target(LLMINFER_AVX512 ",avx512bf16"))) void dot_rows_bf16dp(const uint16_t* xb, const Weight& W,
                                                                             int64_t n, float* out, const char* ahead) {
  const int64_t K = W.K;
  const uint16_t* w = static_cast<const uint16_t*>(W.w);
  __m512 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (ahead) {
      for (int64_t line = 0; line < 64 * R; line += 64) _mm_prefetch(ahead + k * 2 * R + line, _MM_HINT_T0);
    }
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + k);
    for (int r = 0; r < R; ++r)
      a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_loadu_si512(w + (n + r) * K + k), xv);
  }
  for (int r = 0; r < R; ++r) {
    float s = V16::hsum(a[r]);
    for (int64_t j = k; j < K; ++j) s += weight_at<WKind::BF16>(xb, j) * weight_at<WKind::BF16>(w, (n + r) * K + j);
    out[r] = s;
  }
}

#endif

// ---------------------------------------------------------------------------------------------------
// one weight matrix in any of the four formats, and its product with a few float32 rows

constexpr int64_t kGrain = 64;   // output rows a thread takes at least

#ifdef LLMINFER_X86
// add_residual's row, 16 at a time: x = x + y, in bfloat16 x = round(x + round(y)) (y left as it was); returns how
// far it got
__attribute__((target(LLMINFER_AVX512))) int64_t residual_row_avx512(float* xr, const float* yr, int64_t n,
                                                                   bool bf16) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 y = _mm512_loadu_ps(yr + i), x = _mm512_loadu_ps(xr + i);
    _mm512_storeu_ps(xr + i, bf16 ? bf16_round16(_mm512_add_ps(x, bf16_round16(y))) : _mm512_add_ps(x, y));
  }
  return i;
}
#endif

// rows [m0, m1) and columns [n0, n1) of y (M, N) added into the residual's x (M, N): in bfloat16 y is rounded, then
// the sum, as the modules round (y itself may be left unrounded). One AVX-512 pass for the three took the rounding and
// the residual adds of a 128-token bfloat16 prefill from 4.5 % of its perf samples to 2.3 % on a Xeon with AMX (the
// whole prefill: a median ratio of 1.00 over 6 pairs of alternating processes, under the host's noise).
void add_residual(const Residual& r, float* y, int64_t N, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t n = n1 - n0;
  for (int64_t m = m0; m < m1; ++m) {
    float* yr = y + m * N + n0;
    float* xr = r.x + m * N + n0;
    int64_t i = 0;
#ifdef LLMINFER_X86
    if (has(kAVX512)) i = residual_row_avx512(xr, yr, n, r.bf16);
#endif
    if (r.bf16) round_bf16(yr + i, n - i);
    for (int64_t j = i; j < n; ++j) xr[j] += yr[j];
    if (r.bf16) round_bf16(xr + i, n - i);
  }
}

// fn(a, b) over [0, count) units of `unit` output rows of y (M, N): this thread's share with a team, else split over
// torch's threads; then the residual add of the rows of W that fn computed
template <typename Fn>
void split_rows(const Team* team, int64_t count, int64_t grain, int64_t unit, float* y, int64_t M, int64_t N,
                const Residual* residual, const Fn& fn) {
  split_range(team, 0, count, grain, [&](int64_t a, int64_t b) {
    fn(a, b);
    if (residual) add_residual(*residual, y, N, 0, M, a * unit, b * unit);
  });
}

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
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() > 0 &&
              scale.numel() % W.N == 0, op, ": scale must be contiguous float32 with one entry per output row (",
              W.N, ") or per row and group (", W.N, ", groups), got ", scale.numel(), " ", scale.scalar_type(),
              " entries");
  const int64_t G = scale.numel() / W.N;
  TORCH_CHECK(W.K % G == 0 && (G == 1 || (W.K / G) % 16 == 0), op, ": ", G, " scale groups a row do not split ",
              W.K, " inputs into groups of a multiple of 16");
  W.scale = scale.data_ptr<float>();
  W.group = W.K / G;
  return W;
}

Weight int4_weight(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& offset, int64_t group,
                   const char* op) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu() && w.dim() == 3 &&
              w.size(2) == 32, op, ": int4 codes must be contiguous uint8 tiles (N/8, K/8, 32) on the CPU "
              "(llminfer.cpu.tile_int4 makes them from (N, K/2) nibbles), got ", w.sizes(), " ", w.scalar_type());
  const int64_t N = w.size(0) * 8, K = w.size(1) * 8;
  TORCH_CHECK(group > 0 && group % 32 == 0 && K % group == 0, op, ": group ", group,
              " must be a multiple of 32 that divides ", K);
  for (const at::Tensor* t : {&scale, &offset})      // float32 or float16 terms, both the same
    TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kHalf) &&
                t->scalar_type() == scale.scalar_type() && t->is_contiguous() && t->dim() == 3 &&
                t->size(0) == N / 8 && t->size(1) == K / group && t->size(2) == 8, op,
                ": scale and offset must be contiguous (", N / 8, ", ", K / group, ", 8), both float32 or both "
                "float16; got ", scale.sizes(), " ", scale.scalar_type(), " and ", offset.sizes(), " ",
                offset.scalar_type());
  Weight W{Weight::I4, w.data_ptr()};
  W.terms = Terms{scale.data_ptr(), offset.data_ptr(), scale.scalar_type() == at::kHalf};
  W.N = N;
  W.K = K;
  W.group = group;
  return W;
}

// A linear given as its parts (cpu_kernels.h); float activations until the caller sets int8_activations.
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
  TORCH_CHECK(parts[1].dim() == 3 && parts[1].size(1) > 0 && w.dim() == 3, op,
              ": int4 is (N/8, K/8, 32) tiles with (N/8, groups, 8) scales");
  const int64_t K = w.size(1) * 8;
  return int4_weight(w, parts[1], parts[2], K / parts[1].size(1), op);
}

// rows M of x (K inputs) with each whole chunk of `chunk` inputs as its even then its odd entries (the inputs after
// the last whole chunk as they are): the order in which the loops that widen two weights from one lane (int4
// codes, bfloat16 pairs) meet them
std::vector<float> even_odd(const float* x, int64_t M, int64_t K, int64_t chunk) {
  std::vector<float> xp(x, x + M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b + chunk <= K; b += chunk)
      for (int64_t j = 0; j < chunk / 2; ++j) {
        xp[m * K + b + j] = x[m * K + b + 2 * j];
        xp[m * K + b + chunk / 2 + j] = x[m * K + b + 2 * j + 1];
      }
  return xp;
}

// the group sums of x (M, K) for the int4 loops' offset terms: xsum (M, K / group)
std::vector<float> group_sums(const float* x, int64_t M, int64_t K, int64_t group) {
  std::vector<float> xsum(M * (K / group), 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xsum[m * (K / group) + k / group] += x[m * K + k];
  return xsum;
}

// x rounded to int8 per block of 32 for the W4A8 loops: dx[b] = max |x| / 127 of block b, and its 32 codes
// lrint(x / dx) stored in the order the tile loops read them: each chunk of 8 as its 4 even, then its 4 odd inputs.
// (lrint rounds half to even, as vcvtps2dq does, so both versions give the same bytes.)
#ifdef LLMINFER_X86
__attribute__((target("avx2,fma"))) void quantize_x_blocks_avx2(const float* x, int64_t n_blocks, int8_t* xq,
                                                                float* dx) {
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
#endif

// y (M, N) = x · Wᵀ for an int4 weight with x rounded to int8 per block of 32 (W4A8)
void linear_rows_a8(const Weight& W, const float* x, int64_t M, float* y, const Team* team,
                    const Residual* residual) {
  const int64_t N = W.N, K = W.K, B = K / 32;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * B);
  const std::vector<float> xsum = group_sums(x, M, K, W.group);
#ifdef LLMINFER_X86
  if (has_avx2()) quantize_x_blocks_avx2(x, M * B, xq.data(), dx.data());
  else
#endif
    ref::quantize_x_blocks(x, M * B, xq.data(), dx.data());
  // the loops for the instruction set: VNNI, AVX2 or plain
  using Tiles = void (*)(const int8_t*, const float*, const float*, int64_t, int64_t, const uint8_t*, Terms, int64_t,
                         float*, int64_t, int64_t, int64_t);
  Tiles tiles = ref::int4_tiles_a8;
  const int64_t bits = matvec_features(kMatvecI4A8);
#ifdef LLMINFER_X86
  std::vector<int8_t> spread;                              // the 512-bit loops' layout of xq
  if (bits & kAVX512VNNI) {
    tiles = rows_int4t_a8<int4t_dp_avx512<1>, 8>;
    spread.resize(M * K * 8);
    for (int64_t m = 0; m < M; ++m) int4t_spread(xq.data() + m * K, K, spread.data() + m * K * 8);
  } else if (bits & kAVX2) {
    tiles = rows_int4t_a8<int4t_a8_avx2>;
  }
#endif
  const uint8_t* wp = static_cast<const uint8_t*>(W.w);
  split_rows(team, N / 8, kGrain / 8, 8, y, M, N, residual, [&](int64_t a, int64_t b) {
    tiles(spread.empty() ? xq.data() : spread.data(), dx.data(), xsum.data(), M, K, wp, W.terms, W.group, y, N, a, b);
  });
}

#ifdef LLMINFER_X86
// x as three int8 planes for the int8 dot-product loops on int4 tiles with float x, one row of x: per block of 32
// inputs, with 2^(E-1) ≤ max |x| < 2^E, X = round(x·2^(22-E)) (|X| ≤ 2^22: the block's largest input keeps 23
// bits, as float32 keeps 24) is split into balanced base-256 digits, X = a·2^16 + b·2^8 + c, and dx = 2^(E-22)
// (exact: powers of two). digits holds the a, b and c planes of K bytes each, one after the other, each in the
// tiled order (each chunk of 8 as its 4 even, then its 4 odd inputs). x must be finite.
__attribute__((target("avx2,fma"))) void int4_x_digits(const float* x, int64_t K, int8_t* digits, float* dx) {
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

// y (M, N) = x · Wᵀ for int4 tiles with float x by three int8 planes (`int4_x_digits`): vpdpbusd on 512-bit
// registers where the format's loops include AVX512-VNNI, else maddubs on 256-bit ones; false, having done nothing,
// where x has an inf or a NaN (then a group's sum of x has one too). Each thread lays out its own planes: spread, they are
// 24 bytes an input, and read from the core that wrote them they cost more than writing them again.
bool linear_rows_planes(const Weight& W, const float* x, int64_t M, float* y, const Team* team,
                        const Residual* residual) {
  const int64_t N = W.N, K = W.K, B = K / 32;
  const std::vector<float> xsum = group_sums(x, M, K, W.group);
  for (const float sum : xsum)
    if (!std::isfinite(sum)) return false;
  const uint8_t* wp = static_cast<const uint8_t*>(W.w);
  split_rows(team, N / 8, kGrain / 8, 8, y, M, N, residual, [&](int64_t a, int64_t b) {
    thread_local std::vector<int8_t> digits, spread;
    thread_local std::vector<float> dx;
    digits.resize(M * 3 * K);
    dx.resize(M * B);
    for (int64_t m = 0; m < M; ++m) int4_x_digits(x + m * K, K, digits.data() + m * 3 * K, dx.data() + m * B);
    spread.resize(M * 3 * K * 8);
    for (int64_t p = 0; p < M * 3; ++p) int4t_spread(digits.data() + p * K, K, spread.data() + p * K * 8);
    rows_int4t_a8<int4t_dp_avx512<3>, 24>(spread.data(), dx.data(), xsum.data(), M, K, wp, W.terms, W.group, y,
                                          N, a, b);
  });
  return true;
}
#endif

// y (M, N) = x (M, K) · Wᵀ, all float32 and contiguous; rows of W split over torch's threads, or this thread's
// share of them in a team
void linear_rows(const Weight& W, const float* x, int64_t M, float* y, const Team* team, const Residual* residual) {
  const int64_t N = W.N, K = W.K;
  TORCH_INTERNAL_ASSERT(!team || M <= kMatvecMaxRows, "linear_rows: a team shares only the matrix-vector loops");
#ifdef LLMINFER_X86
  if (has_avx2() && M > kMatvecMaxRows) {
    gemm_blocked(x, M, W, y);
    if (residual)
      at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) { add_residual(*residual, y, N, m0, m1, 0, N); });
    return;
  }
#endif
  const int64_t bits = matvec_features(matvec_kind(W));    // the loops measured fastest for this format here
  const bool avx2 = bits & kAVX2, avx512 = bits & kAVX512;
  if (W.format == Weight::I4 && W.int8_activations && M <= kMatvecMaxRows)
    return linear_rows_a8(W, x, M, y, team, residual);
  if (W.format == Weight::I4) {
#ifdef LLMINFER_X86
    // int4 with float x by int8 dot products (three int8 planes of x: VNNI, or maddubs on AVX2) where they were
    // measured fastest and the groups hold whole blocks of 32; else the float loops (and always for an x with an inf
    // or a NaN)
    if ((bits & kAVX512VNNI) && W.group % 32 == 0 && linear_rows_planes(W, x, M, y, team, residual))
      return;
#endif
    const Int4TX sums = int4t_x(x, M, K, W.group, avx2 && !avx512);
    const uint8_t* wp = static_cast<const uint8_t*>(W.w);
    split_rows(team, N / 8, kGrain / 8, 8, y, M, N, residual, [&](int64_t t0, int64_t t1) {
#ifdef LLMINFER_X86
      if (avx512)                                          // x itself, not scaled by place
        return rows_int4t<int4t_tiles_avx512<2>, int4t_tiles_avx512<1>>(x, sums.xsum.data(), M, K, wp, W.terms,
                                                                         W.group, y, N, t0, t1);
      if (avx2)
        return rows_int4t<int4t_tiles_avx2<2>, int4t_tiles_avx2<1>>(sums.xs.data(), sums.xsum.data(), M, K, wp,
                                                                     W.terms, W.group, y, N, t0, t1);
#endif
      ref::int4_tiles(W, x, sums.xsum.data(), M, y, t0, t1);
    });
    return;
  }
  const bool grouped = W.format == Weight::I8 && W.group != K;
  // vdpbf16ps rounds x to bfloat16: only where that changes nothing (x is bfloat16 already)
  const bool x_bf16 = W.format == Weight::BF16 && (bits & kAVX512BF16) && bfloat16_exact(x, M * K);
  // bfloat16 on the 512-bit loop: x's chunks of 32 as their even, then their odd entries
  const bool split = W.format == Weight::BF16 && !x_bf16 && avx512;
  std::vector<float> xp;
  if (split) xp = even_odd(x, M, K, 32);
  std::vector<uint16_t> xb;
  if (x_bf16) {                                          // x rounded to bfloat16 (round to nearest even)
    xb.resize(M * K);
    to_bf16(x, M * K, xb.data());
  }
  split_rows(team, N, kGrain, 1, y, M, N, residual, [&](int64_t n0, int64_t n1) {
#ifdef LLMINFER_X86
    if (split) return rows_by<float, bf16_rows_avx512<4>, bf16_rows_avx512<1>>(xp.data(), M, W, y, n0, n1);
    if (grouped && avx2) return rows_by<float, int8g_rows_avx2<4>, int8g_rows_avx2<1>>(x, M, W, y, n0, n1);
    if (x_bf16) return rows_by<uint16_t, dot_rows_bf16dp<4>, dot_rows_bf16dp<1>>(xb.data(), M, W, y, n0, n1);
    if (!grouped && avx512) {
      if (W.format == Weight::F32) return rows_by<float, dot_rows_avx512<WKind::F32, 4>, dot_rows_avx512<WKind::F32, 1>>(x, M, W, y, n0, n1);
      return rows_by<float, dot_rows_avx512<WKind::I8, 4>, dot_rows_avx512<WKind::I8, 1>>(x, M, W, y, n0, n1);
    }
    if (!grouped && avx2) {
      if (W.format == Weight::F32) return rows_by<float, dot_rows_avx2<WKind::F32, 4>, dot_rows_avx2<WKind::F32, 1>>(x, M, W, y, n0, n1);
      if (W.format == Weight::BF16) return rows_by<float, dot_rows_avx2<WKind::BF16, 4>, dot_rows_avx2<WKind::BF16, 1>>(x, M, W, y, n0, n1);
      return rows_by<float, dot_rows_avx2<WKind::I8, 4>, dot_rows_avx2<WKind::I8, 1>>(x, M, W, y, n0, n1);
    }
#endif
    ref::dense_rows(W, x, M, y, n0, n1);
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

#ifdef LLMINFER_X86
// the first n - n % 16 of them
__attribute__((target(LLMINFER_AVX512))) void round_bf16_avx512(float* p, int64_t n) {
  for (int64_t i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(p + i, bf16_round16(_mm512_loadu_ps(p + i)));
}

// the first n - n % 8 of them
__attribute__((target("avx2,fma"))) void round_bf16_avx2(float* p, int64_t n) {
  for (int64_t i = 0; i + 8 <= n; i += 8)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i), bf16_bits8(_mm256_loadu_ps(p + i)));
}

__attribute__((target("avx2,fma"))) void to_bf16_avx2(const float* p, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i + 8 <= n; i += 8) {        // the high halves of the rounded patterns, packed in order
    const __m256i high = _mm256_srli_epi32(bf16_bits8(_mm256_loadu_ps(p + i)), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1)));
  }
}
#endif

void round_bf16(float* p, int64_t n) {
  int64_t i = 0;
#ifdef LLMINFER_X86
  if (has(kAVX512)) round_bf16_avx512(p, n), i = n - n % 16;
  if (has_avx2()) round_bf16_avx2(p + i, n - i), i = n - n % 8;
#endif
  for (; i < n; ++i) p[i] = static_cast<float>(c10::BFloat16(p[i]));
}

void to_bf16(const float* p, int64_t n, uint16_t* out) {
  int64_t i = 0;
#ifdef LLMINFER_X86
  if (has_avx2()) to_bf16_avx2(p, n, out), i = n - n % 8;
#endif
  for (; i < n; ++i) out[i] = c10::BFloat16(p[i]).x;
}

// float32 values -> a new tensor of `sizes` in `like`'s dtype (float32 or bfloat16)
at::Tensor result(const float* y, at::IntArrayRef sizes, const at::Tensor& like) {
  at::Tensor out = at::empty(sizes, like.options());
  const int64_t n = out.numel();
  if (like.scalar_type() == at::kFloat) {
    std::memcpy(out.data_ptr<float>(), y, n * sizeof(float));
  } else {
    to_bf16(y, n, reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()));
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

at::Tensor gemv_int4_a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& offset,
                        int64_t group) {
  Weight W = int4_weight(w, scale, offset, group, "gemv_int4_a8");
  W.int8_activations = true;
  return gemv(x, W, "gemv_int4_a8");
}



// ---------------------------------------------------------------------------------------------------
// the streaming-read probe: every byte of `data` read once, by every thread (contiguous slices), with the
// widest loads this process runs (64 bytes with AVX-512, 32 with AVX2), into four independent XOR chains so the
// loads, not the arithmetic, set the pace. Returns a checksum, so that the reads cannot be left out.
#ifdef LLMINFER_X86
#define LLMINFER_READ(NAME, TARGET, I, SFX, BYTES, FOLD)                                                      \
  __attribute__((target(TARGET))) uint64_t NAME(const uint8_t* p, int64_t n) {                                 \
    I a = _mm##SFX##_setzero_si##SFX(), b = a, c = a, d = a;                                                   \
    int64_t i = 0;                                                                                             \
    for (; i + 4 * BYTES <= n; i += 4 * BYTES) {                                                               \
      a = _mm##SFX##_xor_si##SFX(a, _mm##SFX##_load_si##SFX(reinterpret_cast<const I*>(p + i)));              \
      b = _mm##SFX##_xor_si##SFX(b, _mm##SFX##_load_si##SFX(reinterpret_cast<const I*>(p + i + BYTES)));      \
      c = _mm##SFX##_xor_si##SFX(c, _mm##SFX##_load_si##SFX(reinterpret_cast<const I*>(p + i + 2 * BYTES)));  \
      d = _mm##SFX##_xor_si##SFX(d, _mm##SFX##_load_si##SFX(reinterpret_cast<const I*>(p + i + 3 * BYTES)));  \
    }                                                                                                          \
    const I all = _mm##SFX##_xor_si##SFX(_mm##SFX##_xor_si##SFX(a, b), _mm##SFX##_xor_si##SFX(c, d));          \
    uint64_t out = static_cast<uint64_t>(FOLD(all));                                                           \
    for (; i < n; ++i) out ^= p[i];                                                                            \
    return out;                                                                                                \
  }
#define LLMINFER_FOLD256(v) (_mm256_extract_epi64(v, 0) ^ _mm256_extract_epi64(v, 3))
LLMINFER_READ(read_avx2, "avx2", __m256i, 256, 32, LLMINFER_FOLD256)
LLMINFER_READ(read_avx512, LLMINFER_AVX512, __m512i, 512, 64, _mm512_reduce_or_epi64)
#undef LLMINFER_FOLD256
#undef LLMINFER_READ
#endif

int64_t stream_read(const at::Tensor& data, int64_t width) {
  TORCH_CHECK(data.device().is_cpu() && data.is_contiguous(), "stream_read: data must be a contiguous CPU tensor");
  TORCH_CHECK(width == 0 || width == 8 || width == 32 || width == 64, "stream_read: width ", width,
              " must be 64, 32 or 8 bytes, or 0 for the widest loads in use");
  const uint8_t* base = static_cast<const uint8_t*>(data.data_ptr());
  const int64_t n = data.numel() * data.element_size();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(base) % 64 == 0, "stream_read: data must start on a 64-byte boundary");
  const int64_t slice = 1 << 20;                                    // 1 MiB a task
  int64_t bits = features();
  TORCH_CHECK(width != 64 || (bits & kAVX512), "stream_read: 64-byte loads need AVX-512, which this process does not "
              "run");
  TORCH_CHECK(width != 32 || (bits & kAVX2), "stream_read: 32-byte loads need AVX2, which this process does not run");
  if (width == 32) bits &= kAVX2;
  if (width == 8) bits = 0;
  const int64_t slices = (n + slice - 1) / slice;
  std::vector<uint64_t> sums(slices, 0);
  at::parallel_for(0, slices, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const uint8_t* p = base + s * slice;
      const int64_t len = std::min(slice, n - s * slice);
#ifdef LLMINFER_X86
      if (bits & kAVX512) { sums[s] = read_avx512(p, len); continue; }
      if (bits & kAVX2) { sums[s] = read_avx2(p, len); continue; }
#endif
      uint64_t acc = 0;
      int64_t i = 0;
      for (; i + 8 <= len; i += 8) {
        uint64_t word;
        std::memcpy(&word, p + i, 8);
        acc ^= word;
      }
      for (; i < len; ++i) acc ^= p[i];
      sums[s] = acc;
    }
  });
  uint64_t out = 0;
  for (uint64_t v : sums) out ^= v;
  return static_cast<int64_t>(out & 0x7fffffffffffffffULL);
}

}  // namespace llminfer_cpu

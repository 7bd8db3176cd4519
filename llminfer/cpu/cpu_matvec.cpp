// The matrix-vector products of decode on a CPU, y = x · Wᵀ for a few rows of x (up to kMatvecMaxRows) and a weight
// W held as float32, bfloat16, int8 (a scale per output channel or per group of inputs) or int4 (a scale and offset
// per group of inputs, in tiles of 8 rows): the instruction sets in use, the weights checked, and `linear_rows`, which
// sends a product to the loops (ref::, avx2::, avx512::, avx512_bf16::; cpu_kernels.h) of the level the static table
// names for its format. A decode step reads every weight once, so its speed is how fast the weights stream from
// memory, whatever the number of rows of x: each loop loads a weight once for all of them. Each level is compiled with
// its own target attributes (no -march: the extension loads on any x86 CPU). Past kMatvecMaxRows rows the blocked
// kernel takes the product (cpu_gemm.cpp). Chapter 08.

#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include "cpu_kernels.h"

namespace llminfer_cpu {

// the instruction sets in use: all of them (features) and each format's decode loops' (g_matvec; -1: features())
namespace {
std::atomic<int64_t> g_features{-1};
std::atomic<int64_t> g_matvec[kMatvecKinds] = {-1, -1, -1, -1, -1};

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

// int4 in tiles of 8 rows (cpu_avx2.cpp describes the layout). xs (M, K): x with input 8c+i multiplied by 16^-i
// (i < 7), and x itself for i = 7, whose code is shifted down to the bottom (q·2^28 does not fit a positive int32),
// made only where `placed` (for the AVX2 loop: the others read x itself); xsum (M, G) the group sums of x
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

constexpr int64_t kGrain = 64;   // output rows a thread takes at least

#ifdef LLMINFER_X86
// add_residual's row, 16 at a time: x = x + y, in bfloat16 x = round(x + round(y)) (y left as it was), in one pass;
// returns how far it got
LLMINFER_ON_AVX512 int64_t residual_row_avx512(float* xr, const float* yr, int64_t n, bool bf16) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 y = _mm512_loadu_ps(yr + i), x = _mm512_loadu_ps(xr + i);
    _mm512_storeu_ps(xr + i, bf16 ? V16::bf16_round(_mm512_add_ps(x, V16::bf16_round(y))) : _mm512_add_ps(x, y));
  }
  return i;
}
#endif

// rows [m0, m1) and columns [n0, n1) of y (M, N) added into the residual's x (M, N): in bfloat16 y is rounded, then
// the sum, as the modules round (y itself may be left unrounded)
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

namespace {
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

}  // namespace

// A linear given as its parts (cpu_kernels.h); an int4 weight's group, where not given, read from its scale's shape
Weight weight_from_parts(at::TensorList parts, const char* op, int64_t group) {
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
  return int4_weight(w, parts[1], parts[2], group > 0 ? group : w.size(1) * 8 / parts[1].size(1), op);
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

// y (M, N) = x · Wᵀ for an int4 weight with x rounded to int8 per block of 32 (W4A8)
void linear_rows_a8(const Weight& W, const float* x, int64_t M, float* y, const Team* team,
                    const Residual* residual) {
  const int64_t N = W.N, K = W.K, B = K / 32;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * B);
  const std::vector<float> xsum = int4t_x(x, M, K, W.group, false).xsum;
  const int64_t bits = matvec_features(kMatvecI4A8);
  using Tiles = void (*)(const int8_t*, const float*, const float*, int64_t, int64_t, const uint8_t*, Terms, int64_t,
                         float*, int64_t, int64_t, int64_t);
  Tiles tiles = ref::int4_tiles_a8;                        // the loops for the instruction set: VNNI, AVX2 or plain
#ifdef LLMINFER_X86
  if (has_avx2()) avx2::quantize_x_blocks(x, M * B, xq.data(), dx.data());
  else
#endif
    ref::quantize_x_blocks(x, M * B, xq.data(), dx.data());
#ifdef LLMINFER_X86
  if (bits & kAVX512VNNI) {                                // the 512-bit loops' layout of xq
    std::vector<int8_t> spread(M * K * 8);
    for (int64_t m = 0; m < M; ++m) avx512::int4t_spread(xq.data() + m * K, K, spread.data() + m * K * 8);
    xq.swap(spread);
    tiles = avx512::int4_tiles_a8;
  } else if (bits & kAVX2) {
    tiles = avx2::int4_tiles_a8;
  }
#endif
  const uint8_t* wp = static_cast<const uint8_t*>(W.w);
  split_rows(team, N / 8, kGrain / 8, 8, y, M, N, residual, [&](int64_t a, int64_t b) {
    tiles(xq.data(), dx.data(), xsum.data(), M, K, wp, W.terms, W.group, y, N, a, b);
  });
}

// y (M, N) = x (M, K) · Wᵀ, all float32 and contiguous; rows of W split over torch's threads, or this thread's
// share of them in a team. The loops of the level the static table names for the format (matvec_features); each
// takes all M rows of x for every weight it loads.
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
  // W4A8 for a decode step's few rows; more rows (a prefill without the blocked kernel) keep float activations
  if (W.format == Weight::I4 && W.int8_activations && M <= kMatvecMaxRows)
    return linear_rows_a8(W, x, M, y, team, residual);
  // (the formats F32, BF16 and I8 are the kinds of the same numbers)
  const int64_t bits = matvec_features(W.format == Weight::I4 ? kMatvecI4 : static_cast<MatvecKind>(W.format));
  const bool avx2 = bits & kAVX2, avx512 = bits & kAVX512;
  if (W.format == Weight::I4) {
    // x placed for the AVX2 loop (the AVX-512 and portable ones read x itself), and its group sums
    const Int4TX sums = int4t_x(x, M, K, W.group, avx2 && !avx512);
    bool finite = true;
    for (const float sum : sums.xsum) finite = finite && std::isfinite(sum);
    split_rows(team, N / 8, kGrain / 8, 8, y, M, N, residual, [&](int64_t t0, int64_t t1) {
#ifdef LLMINFER_X86
      // int8 dot products on three int8 planes of x where VNNI's loops won (and the groups hold whole blocks of 32);
      // the float loops for an x with an inf or a NaN
      if ((bits & kAVX512VNNI) && W.group % 32 == 0 && finite)
        return avx512::int4_planes(W, x, sums.xsum.data(), M, y, t0, t1);
      if (avx512) return avx512::int4_tiles(W, x, sums.xsum.data(), M, y, t0, t1);
      if (avx2) return avx2::int4_tiles(W, sums.xs.data(), sums.xsum.data(), M, y, t0, t1);
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
    if (split) return avx512::bf16_rows(W, xp.data(), M, y, n0, n1);
    if (x_bf16) return avx512_bf16::dense_rows(W, xb.data(), M, y, n0, n1);
    if (avx512 && !grouped) return avx512::dense_rows(W, x, M, y, n0, n1);   // (grouped int8: the 8-lane loop)
    if (avx2) return avx2::dense_rows(W, x, M, y, n0, n1);
#endif
    ref::dense_rows(W, x, M, y, n0, n1);
  });
}

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
LLMINFER_ON_AVX2 int64_t to_bf16_avx2(const float* p, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {                     // the high halves of the rounded patterns, packed in order
    const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(V8::bf16_round(_mm256_loadu_ps(p + i))), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1)));
  }
  return i;
}
#endif

void round_bf16(float* p, int64_t n) {
  int64_t i = 0;
#ifdef LLMINFER_X86
  if (has(kAVX512)) i = V16::round_row(p, n);
  if (has_avx2()) i += V8::round_row(p + i, n - i);
#endif
  for (; i < n; ++i) p[i] = static_cast<float>(c10::BFloat16(p[i]));
}

void to_bf16(const float* p, int64_t n, uint16_t* out) {
  int64_t i = 0;
#ifdef LLMINFER_X86
  if (has_avx2()) i = to_bf16_avx2(p, n, out);
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

// y = x · Wᵀ for W given as its parts (weight_from_parts; group: an int4 weight's, 0 to read it from the scale)
at::Tensor gemv(const at::Tensor& x, at::TensorList parts, int64_t group, bool int8_activations) {
  Weight W = weight_from_parts(parts, "gemv", group);
  TORCH_CHECK(!int8_activations || W.format == Weight::I4, "gemv: int8 activations are for int4 weights");
  W.int8_activations = int8_activations;
  check_x(x, W.K, "gemv");
  const int64_t M = x.size(0);
  std::vector<float> xf = x_as_float(x), y(M * W.N);
  linear_rows(W, xf.data(), M, y.data());
  return result(y.data(), {M, W.N}, x);
}

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


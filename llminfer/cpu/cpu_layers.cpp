// Whole decoder layers of the native CPU kernels, a few tokens (or a prefill) in one call. Chapter 08. A layer:
//   h = rmsnorm(x); q, k, v = h · W_qkvᵀ (+ bias); RoPE on q and k; k, v written into the cache at their positions;
//   attention of q over the slots up to each token's position; x += attention · W_oᵀ;
//   h = rmsnorm(x); x += (silu(gate) · up) · W_downᵀ with gate, up = h · W_gate_upᵀ.
// The same arithmetic as the layer's modules, in float32, rounded to the model's dtype where the modules round (each
// product, the norm, RoPE, the attention output, each sum), so bfloat16 matches them to within a rounding step.

#include "cpu_kernels.h"

#include <omp.h>

#include <memory>
#include <mutex>
#include <unordered_map>

namespace llminfer_cpu {

template <typename T>
inline const T* ptr_as(const at::Tensor& t) { return static_cast<const T*>(t.data_ptr()); }

inline float bf16_round(float v) { return static_cast<float>(c10::BFloat16(v)); }

#ifdef LLMINFER_X86
// rope() on 8 dimensions of each half at a time: D / 2 a multiple of 8
LLMINFER_ON_AVX2 void rope_avx2(float* v, const float* c, const float* s, int64_t D, bool bf16) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; d += 8) {
    const __m256 lo = _mm256_loadu_ps(v + d), hi = _mm256_loadu_ps(v + half + d);
    // first half: v·cos - v[d + half]·sin; second: v·cos + v[d - half]·sin
    __m256 a0 = _mm256_mul_ps(lo, _mm256_loadu_ps(c + d)), a1 = _mm256_mul_ps(hi, _mm256_loadu_ps(c + half + d));
    __m256 b0 = _mm256_mul_ps(_mm256_xor_ps(hi, _mm256_set1_ps(-0.f)), _mm256_loadu_ps(s + d));   // -hi
    __m256 b1 = _mm256_mul_ps(lo, _mm256_loadu_ps(s + half + d));
    if (bf16) {
      a0 = V8::bf16_round(a0), a1 = V8::bf16_round(a1), b0 = V8::bf16_round(b0), b1 = V8::bf16_round(b1);
      _mm256_storeu_ps(v + d, V8::bf16_round(_mm256_add_ps(a0, b0)));
      _mm256_storeu_ps(v + half + d, V8::bf16_round(_mm256_add_ps(a1, b1)));
    } else {
      _mm256_storeu_ps(v + d, _mm256_add_ps(a0, b0));
      _mm256_storeu_ps(v + half + d, _mm256_add_ps(a1, b1));
    }
  }
}
#endif

// out = silu(g) · u, one row of the MLP's activations; in bfloat16 g is rounded first (the gate's output, as its
// module rounds it), then silu(g) and u each rounded, then their product, as the modules round. silu's exp argument
// is capped (glibc's exp is slow on overflow, and g/inf is 0 anyway).
void gated(const float* g, const float* u, int64_t n, bool bf16, float* out) {
  int64_t i = 0;
#ifdef LLMINFER_X86
  if (has(kAVX512)) i = V16::gated_row(g, u, n, bf16, out);
  if (has_avx2()) i += V8::gated_row(g + i, u + i, n - i, bf16, out + i);
#endif
  for (; i < n; ++i) {
    const float gi = bf16 ? bf16_round(g[i]) : g[i];
    const float a = gi / (1.f + std::exp(std::min(-gi, 88.f)));
    out[i] = bf16 ? bf16_round(bf16_round(a) * bf16_round(u[i])) : a * u[i];
  }
}

// RoPE on one head's D values in place: v·cos + rotate_half(v)·sin; in bfloat16 both terms rounded, then their sum
void rope(float* v, const float* c, const float* s, int64_t D, bool bf16) {
#ifdef LLMINFER_X86
  if (has_avx2() && D % 16 == 0) return rope_avx2(v, c, s, D, bf16);
#endif
  const int64_t half = D / 2;
  const auto sum = [bf16](float a, float b) { return bf16 ? bf16_round(bf16_round(a) + bf16_round(b)) : a + b; };
  for (int64_t d = 0; d < half; ++d) {                          // dimensions d and d + half, from their old values
    const float lo = v[d], hi = v[d + half];
    v[d] = sum(lo * c[d], -hi * s[d]);
    v[d + half] = sum(hi * c[d + half], lo * s[d + half]);
  }
}

// fn(m) for every row m < M: inline for a decode step's few rows, split over the threads for a prefill's
template <typename Fn>
void for_rows(int64_t M, const Fn& fn) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) fn(m);
  });
}

#ifdef LLMINFER_X86
// rms_norm's two loops on vector lanes, the same operations in the same order (the same bits): the sum of squares
// with its four double chains as four lanes, then the output 8 at a time. Each returns how far it got.
LLMINFER_ON_AVX2 int64_t squares_avx2(const float* row, int64_t dim, double (&ss)[4]) {
  __m256d chains = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 4 <= dim; i += 4) {
    const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(row + i));
    chains = _mm256_add_pd(chains, _mm256_mul_pd(v, v));
  }
  _mm256_storeu_pd(ss, chains);
  return i;
}

LLMINFER_ON_AVX2 int64_t norm_out_avx2(const float* row, int64_t dim, const float* w, float inv, bool bf16, float* o) {
  const __m256 inv8 = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 8 <= dim; i += 8) {
    const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(row + i), inv8), wi = _mm256_loadu_ps(w + i);
    _mm256_storeu_ps(o + i, bf16 ? V8::bf16_round(V8::mul(V8::bf16_round(scaled), wi)) : _mm256_mul_ps(wi, scaled));
  }
  return i;
}
#endif

// rows of x (M, dim) -> weight · (x / rms(x)), each rounded as RMSNorm rounds
void rms_norm(const float* x, int64_t M, int64_t dim, const at::Tensor& weight, double eps, bool bf16, float* out) {
  // float32 weights read in place; bfloat16 ones widened once per call
  const std::vector<float> widened = weight.scalar_type() == at::kFloat ? std::vector<float>() : x_as_float(weight);
  const float* w = weight.scalar_type() == at::kFloat ? ptr_as<float>(weight) : widened.data();
  for_rows(M, [&](int64_t m) {
    const float* row = x + m * dim;
    float* o = out + m * dim;
    double ss[4] = {0.0, 0.0, 0.0, 0.0};              // four chains: one would wait on each add
    int64_t i = 0;
#ifdef LLMINFER_X86
    if (has_avx2()) i = squares_avx2(row, dim, ss);
#endif
    for (; i + 4 <= dim; i += 4)
      for (int j = 0; j < 4; ++j) ss[j] += static_cast<double>(row[i + j]) * row[i + j];
    for (; i < dim; ++i) ss[0] += static_cast<double>(row[i]) * row[i];
    const double total = (ss[0] + ss[1]) + (ss[2] + ss[3]);
    const float inv = 1.f / std::sqrt(static_cast<float>(total / dim) + static_cast<float>(eps));
    i = 0;
#ifdef LLMINFER_X86
    if (has_avx2()) i = norm_out_avx2(row, dim, w, inv, bf16, o);
#endif
    for (; i < dim; ++i) o[i] = bf16 ? bf16_round(bf16_round(row[i] * inv) * w[i]) : w[i] * (row[i] * inv);
  });
}

// The native-call contract. A layer stack crosses into C++ once (prepare_stack), each layer as named fields in the
// one order below, which llminfer/cpu/stack.py builds (its LAYER_TENSORS; the op layer_fields() names them back):
//   tensors, kLayerTensors a layer, None where absent: the two norms' weights, the qkv bias, then per product (qkv,
//   o, gate_up, down) its weight, scale and offset (weight_from_parts);
//   eps, two a layer: the input norm's and the post-attention norm's;
//   activations, one a product: kFloatActivations, or kInt8Activations (int4 only, W4A8: x rounded to int8).
// The caches are the stack's too, one K and one V a layer: kContiguous, (B, H_kv, slots, D) written at each step's
// positions; kPaged, a pool (num_blocks, block_size, H_kv, D) read through the block tables each step hands over.
constexpr const char* kLayerFields[] = {"input_norm", "post_norm", "qkv_bias", "qkv.weight", "qkv.scale", "qkv.offset",
                                        "o.weight", "o.scale", "o.offset", "gate_up.weight", "gate_up.scale",
                                        "gate_up.offset", "down.weight", "down.scale", "down.offset"};
constexpr size_t kLayerTensors = sizeof(kLayerFields) / sizeof(kLayerFields[0]), kFirstProduct = 3;
constexpr int64_t kProducts = 4;
enum Activations : int64_t { kFloatActivations = 0, kInt8Activations = 1 };
enum CacheKind : int64_t { kContiguous = 0, kPaged = 1 };

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
// Paged: B = 1, the T tokens belong to several sequences (seq), the caches are pools of num_blocks blocks of
// block_size positions, and sequence s's positions live in the blocks of tables row s.
struct Step {
  int64_t B, T, dim, H, Hkv = 0, S = 0, D = 0, last_pos = 0;
  bool paged = false;
  const int64_t* seq = nullptr;
  const int64_t* tables = nullptr;
  int64_t table_width = 0, block_size = 0, num_blocks = 0;
  at::ScalarType dtype;
  const int64_t* pos;
  std::vector<float> cos, sin;
  float scale;
};

// A step over caches of `kind` (k_cache: the first layer's), checked: x (B, T, dim) with positions (T,) for
// contiguous caches; x (1, N, dim) with positions, token_seq (N,) and block_tables (S, W) for a pool.
Step check_step(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                const c10::optional<at::Tensor>& token_seq, const c10::optional<at::Tensor>& block_tables,
                const at::Tensor& k_cache, int64_t kind, int64_t n_heads, double scale, const char* op) {
  TORCH_CHECK(x.dim() == 3 && x.device().is_cpu(), op, ": x must be a (B, T, dim) CPU tensor, got ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": x must be float32 or bfloat16, got ", dtype);
  Step st{x.size(0), x.size(1), x.size(2), n_heads};
  st.dtype = dtype;
  st.paged = kind == kPaged;
  TORCH_CHECK(k_cache.dim() == 4, op, st.paged ? ": a pool must be (num_blocks, block_size, H_kv, D), got "
              : ": a cache must be (B, H_kv, slots, D), got ", k_cache.sizes());
  TORCH_CHECK(st.paged == (token_seq.has_value() && block_tables.has_value()) &&
              token_seq.has_value() == block_tables.has_value(), op, ": a step over ",
              st.paged ? "a paged pool needs token_seq and block_tables" : "contiguous caches takes no block tables",
              "; prepare the stack with the cache kind of the cache it runs over");
  if (st.paged) {
    TORCH_CHECK(st.B == 1, op, ": x must be (1, N, dim) over a paged pool (the step's tokens side by side), got ",
                x.sizes());
    st.num_blocks = k_cache.size(0), st.block_size = k_cache.size(1), st.Hkv = k_cache.size(2);
    st.S = st.num_blocks * st.block_size;
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == st.T, op, ": positions must be (N=", st.T, ",), got ",
                positions.sizes());
    st.last_pos = check_block_tables(*block_tables, *token_seq, positions, st.num_blocks, st.block_size, op) - 1;
    st.seq = token_seq->data_ptr<int64_t>();
    st.tables = block_tables->data_ptr<int64_t>();
    st.table_width = block_tables->size(1);
  } else {
    st.Hkv = k_cache.size(1), st.S = k_cache.size(2);
  }
  st.D = k_cache.size(3);
  TORCH_CHECK(st.H > 0 && st.Hkv > 0 && st.H % st.Hkv == 0 && st.H / st.Hkv <= 64 && st.D % 2 == 0, op, ": ", st.H,
              " query heads do not share ", st.Hkv, " K/V heads of size ", st.D);
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == st.T && positions.scalar_type() == at::kLong &&
              positions.is_contiguous() && positions.device().is_cpu(), op, ": positions must be (T=", st.T,
              ",) int64 on the CPU, got ", positions.sizes(), " ", positions.scalar_type());
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == st.T && cos.size(1) == st.D && sin.sizes() == cos.sizes() &&
              cos.scalar_type() == dtype && sin.scalar_type() == dtype, op,
              ": cos and sin must be (T, D) in x's dtype");
  st.pos = positions.data_ptr<int64_t>();
  if (!st.paged) {
    for (int64_t t = 0; t < st.T; ++t) {
      TORCH_CHECK(st.pos[t] >= 0 && st.pos[t] < st.S, op, ": position ", st.pos[t], " is outside the cache's 0..",
                  st.S - 1);
      st.last_pos = std::max(st.last_pos, st.pos[t]);
    }
  }
  st.cos = x_as_float(cos);
  st.sin = x_as_float(sin);
  st.scale = static_cast<float>(scale);
  return st;
}

// Product p of a layer whose fields start at t[first]: its weight, scale and offset, with its activations' format
Weight product_weight(const std::vector<c10::optional<at::Tensor>>& t, size_t first, int64_t p, int64_t activations,
                      const char* op) {
  const size_t w = first + kFirstProduct + 3 * p;
  const char* name = kLayerFields[kFirstProduct + 3 * p];
  TORCH_CHECK(t[w].has_value(), op, ": ", name, " is missing");
  TORCH_CHECK(t[w + 1].has_value() || !t[w + 2].has_value(), op, ": ", name, " has an offset without a scale");
  std::vector<at::Tensor> parts{*t[w]};
  for (size_t i : {w + 1, w + 2})
    if (t[i].has_value()) parts.push_back(*t[i]);
  Weight W = weight_from_parts(parts, op);
  TORCH_CHECK(activations == kFloatActivations || (activations == kInt8Activations && W.format == Weight::I4), op,
              ": ", name, "'s activations are ", activations, "; they are 0 (float) or, for int4 weights, 1 (int8)");
  W.int8_activations = activations == kInt8Activations;
  return W;
}

// Layer `l` of a prepared stack's fields (tensors from l·kLayerTensors, two epsilons and four activations' formats
// a layer), with its caches, checked against the step
Layer check_layer(const Step& st, const std::vector<c10::optional<at::Tensor>>& t, const std::vector<double>& eps,
                  const std::vector<int64_t>& activations, int64_t l, at::Tensor& k_cache, at::Tensor& v_cache,
                  const char* op) {
  const bool bf16 = st.dtype == at::kBFloat16;
  const size_t first = l * kLayerTensors;
  const std::vector<int64_t> shape = st.paged ? std::vector<int64_t>{st.num_blocks, st.block_size, st.Hkv, st.D}
                                               : std::vector<int64_t>{st.B, st.Hkv, st.S, st.D};
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->sizes() == at::IntArrayRef(shape) && c->is_contiguous() && c->scalar_type() == st.dtype &&
                c->device().is_cpu(), op, ": the ", st.paged ? "pools (num_blocks, block_size, H_kv, D)" :
                "caches (B, H_kv, slots, D)", " must be contiguous ", at::IntArrayRef(shape), " CPU tensors of x's "
                "dtype, got ", c->sizes(), " ", c->scalar_type());
  for (size_t i : {first, first + 1})
    TORCH_CHECK(t[i].has_value() && t[i]->numel() == st.dim && t[i]->is_contiguous() &&
                t[i]->scalar_type() == st.dtype, op, ": the norm weights must be contiguous (", st.dim,
                ",) in x's dtype");
  const int64_t* acts = activations.data() + kProducts * l;
  Layer L{&*t[first], &*t[first + 1], eps[2 * l], eps[2 * l + 1], product_weight(t, first, 0, acts[0], op),
          product_weight(t, first, 1, acts[1], op), product_weight(t, first, 2, acts[2], op),
          product_weight(t, first, 3, acts[3], op), {}, &k_cache, &v_cache};
  for (const Weight* W : {&L.qkv, &L.o, &L.gate_up, &L.down})
    TORCH_CHECK(W->format == Weight::I8 || W->format == Weight::I4 || (W->format == Weight::BF16) == bf16, op,
                ": a float weight must have x's dtype");
  const int64_t qsize = st.H * st.D, kvsize = st.Hkv * st.D;
  TORCH_CHECK(L.qkv.K == st.dim && L.qkv.N == qsize + 2 * kvsize && L.o.K == qsize && L.o.N == st.dim &&
              L.gate_up.K == st.dim && L.gate_up.N % 2 == 0 && L.down.K == L.gate_up.N / 2 && L.down.N == st.dim,
              op, ": the weights (qkv ", L.qkv.N, "x", L.qkv.K, ", o ", L.o.N, "x", L.o.K, ", gate_up ", L.gate_up.N,
              "x", L.gate_up.K, ", down ", L.down.N, "x", L.down.K, ") do not fit dim ", st.dim, " with ", st.H,
              " + 2x", st.Hkv, " heads of ", st.D);
  if (const auto& bias = t[first + 2]; bias.has_value()) {
    TORCH_CHECK(bias->numel() == L.qkv.N && bias->scalar_type() == st.dtype, op,
                ": the qkv bias must be (", L.qkv.N, ",) in x's dtype");
    L.bias = x_as_float(*bias);
  }
  return L;
}
// Whether a decode step's threads share its attention by blocks of keys rather than by K/V heads: where the cache
// holds kSplitKeys positions or more, as attend then splits every query's keys (AttentionProblem::key_block)
inline bool keys_split(const Step& st) { return st.last_pos + 1 >= kSplitKeys; }

// The layers' intermediate rows shared by the threads, made once for a call's layers, as large as the largest
// layer needs (each buffer is written before it is read)
struct Workspace {
  std::vector<float> qkv, att, proj, gu;
  std::vector<float> parts;                  // a decode step's attention split by keys: every block's parts
  int64_t gate_up_n = 0;
  Workspace() = default;
  Workspace(const Step& st, const std::vector<Layer>& layers) { fit(st, layers); }
  // sized for the step (a kept workspace keeps its pages: resizing within its capacity allocates nothing)
  void fit(const Step& st, const std::vector<Layer>& layers) {
    const int64_t M = st.B * st.T;
    int64_t qkv_n = 0;
    gate_up_n = 0;
    for (const Layer& L : layers) qkv_n = std::max(qkv_n, L.qkv.N), gate_up_n = std::max(gate_up_n, L.gate_up.N);
    qkv.resize(M * qkv_n), att.resize(M * st.H * st.D), proj.resize(M * st.dim), gu.resize(M * gate_up_n);
    if (keys_split(st)) parts.resize(M * st.H * fixed_key_blocks(st.last_pos + 1, kDecodeKeyBlock) * (st.D + 2));
  }
};

// The rows each thread makes for itself from shared ones: the normed x, the MLP's activations, and attention's
// outputs where a step's attention is split by keys
struct Own {
  std::vector<float> h, act, att;
  Own() = default;
  Own(const Step& st, const Workspace& ws) { fit(st, ws); }
  void fit(const Step& st, const Workspace& ws) {
    h.resize(st.B * st.T * st.dim), act.resize(st.B * st.T * ws.gate_up_n / 2);
    if (keys_split(st)) att.resize(st.B * st.T * st.H * st.D);
  }
};

// K/V heads [k0, k1) of every token ready for attention, their query heads with them: each row of qkv is rounded
// (and its bias added) on these heads' columns, RoPE turns their q and k, and their k and v go into the cache at the
// tokens' positions.
void turn_heads(const Step& st, const Layer& L, float* qkv, int64_t k0, int64_t k1) {
  const bool bf16 = st.dtype == at::kBFloat16;
  const int64_t T = st.T, M = st.B * T, H = st.H, Hkv = st.Hkv, S = st.S, D = st.D, group = H / Hkv;
  const int64_t qsize = H * D, kvsize = Hkv * D, N = L.qkv.N;
  // this thread's columns of a qkv row: its q heads, k heads and v heads
  const int64_t spans[3][2] = {{k0 * group * D, k1 * group * D}, {qsize + k0 * D, qsize + k1 * D},
                               {qsize + kvsize + k0 * D, qsize + kvsize + k1 * D}};
  for_rows(M, [&](int64_t m) {
    float* row = qkv + m * N;
    const float *c = st.cos.data() + (m % T) * D, *s = st.sin.data() + (m % T) * D;
    for (const auto& span : spans) {
      float* part = row + span[0];
      const int64_t n = span[1] - span[0];
      if (bf16) round_bf16(part, n);
      if (!L.bias.empty()) {
        for (int64_t i = 0; i < n; ++i) part[i] += L.bias[span[0] + i];
        if (bf16) round_bf16(part, n);
      }
    }
    for (int64_t head = 0; head < H + Hkv; ++head) {        // the q heads, then the k heads
      if (head < H ? head / group < k0 || head / group >= k1 : head - H < k0 || head - H >= k1) continue;
      rope(row + head * D, c, s, D, bf16);
    }
  });
  for_rows(M, [&](int64_t m) {                               // k, v into the cache at their positions
    const int64_t b = m / T, t = m % T;
    const float* row = qkv + m * N;
    // where position pos[t] of this token's sequence lives: its row of the contiguous cache, or of the pool
    const int64_t row_of_pool = st.paged ? st.tables[st.seq[t] * st.table_width + st.pos[t] / st.block_size] *
                                               st.block_size + st.pos[t] % st.block_size : 0;
    for (int64_t hk = k0; hk < k1; ++hk) {
      const int64_t slot = st.paged ? (row_of_pool * Hkv + hk) * D : ((b * Hkv + hk) * S + st.pos[t]) * D;
      const float *kr = row + qsize + hk * D, *vr = row + qsize + kvsize + hk * D;
      if (bf16) {
        to_bf16(kr, D, reinterpret_cast<uint16_t*>(L.k_cache->data_ptr<c10::BFloat16>()) + slot);
        to_bf16(vr, D, reinterpret_cast<uint16_t*>(L.v_cache->data_ptr<c10::BFloat16>()) + slot);
      } else {
        std::memcpy(L.k_cache->data_ptr<float>() + slot, kr, D * sizeof(float));
        std::memcpy(L.v_cache->data_ptr<float>() + slot, vr, D * sizeof(float));
      }
    }
  });
}

// The attention of K/V heads [k0, k1) (their query heads' outputs into att's columns), once turn_heads has made them
// ready: the problem of all heads, its pointers moved to head k0
AttentionProblem heads_problem(const Step& st, const Layer& L, const float* qkv, float* att, int64_t k0, int64_t k1) {
  const int64_t T = st.T, H = st.H, Hkv = st.Hkv, S = st.S, D = st.D, group = H / Hkv;
  const int64_t qsize = H * D, N = L.qkv.N;
  const int64_t esize = st.dtype == at::kBFloat16 ? 2 : 4;
  AttentionProblem P{st.B, (k1 - k0) * group, k1 - k0, T, D, st.last_pos + 1, qkv + k0 * group * D, T * N, D, N,
                     static_cast<const char*>(L.k_cache->data_ptr()), static_cast<const char*>(L.v_cache->data_ptr()),
                     Hkv * S * D, S * D, D, Hkv * S * D, S * D, D};
  P.last = st.pos;
  if (st.paged) {                            // the pool: position rows Hkv·D apart, through the block tables
    P.ks0 = P.vs0 = 0, P.ks1 = P.vs1 = D, P.ks2 = P.vs2 = Hkv * D;
    P.tables = st.tables, P.seq = st.seq, P.table_stride = st.table_width, P.block_size = st.block_size;
  }
  P.k += k0 * P.ks1 * esize, P.v += k0 * P.vs1 * esize;
  P.whole = true;                            // a head's numbers the same however the heads were shared out
  P.key_block = kDecodeKeyBlock;             // and a long cache's blocks of keys, however those were
  P.scale = st.scale;
  P.out = att + k0 * group * D;
  P.os0 = T * qsize, P.os1 = D, P.os2 = qsize;
  return P;
}

// This thread's part of a layer's attention: K/V heads [k0, k1) of every token turned and cached, and their queries'
// outputs written to their columns of att
void attend_heads(const Step& st, const Layer& L, float* qkv, float* att, int64_t k0, int64_t k1) {
  const bool bf16 = st.dtype == at::kBFloat16;
  const int64_t M = st.B * st.T, qsize = st.H * st.D, group = st.H / st.Hkv;
  turn_heads(st, L, qkv, k0, k1);
  const AttentionProblem P = heads_problem(st, L, qkv, att, k0, k1);
  if (bf16) attend<WKind::BF16>(P);
  else attend<WKind::F32>(P);
  const int64_t first = k0 * group * st.D, width = (k1 - k0) * group * st.D;   // this thread's columns of att
  if (bf16) for_rows(M, [&](int64_t m) { round_bf16(att + m * qsize + first, width); });
}

// x (B·T, dim) float32, rounded to the model's dtype, through one layer in place. With a team (a decode step's few
// tokens, run_layers), every thread of the step's parallel region runs this: each product is shared by rows of W,
// attention by K/V heads, and a barrier separates what one thread writes from what the others then read; the norm
// and the activations, a few rows, each thread makes for itself. Without one, each part splits over the threads.
void run_layer(const Step& st, const Layer& L, float* x, Workspace& ws, Own& own, const Team* team) {
  const bool bf16 = st.dtype == at::kBFloat16;
  const int64_t M = st.B * st.T, dim = st.dim, hidden = L.gate_up.N / 2;
  const Residual into_x{x, bf16};
  const auto barrier = [team] {
    if (team) {
#pragma omp barrier
    }
  };
  // attention
  rms_norm(x, M, dim, *L.input_norm, L.eps1, bf16, own.h.data());
  linear_rows(L.qkv, own.h.data(), M, ws.qkv.data(), team);
  barrier();                                                 // qkv complete
  int64_t k0 = 0, k1 = st.Hkv;
  if (team) {
    k1 = k0;                                                 // none, where the team outnumbers the heads
    split_range(team, 0, st.Hkv, 1, [&](int64_t a, int64_t b) { k0 = a, k1 = b; });
  }
  const float* att = ws.att.data();
  if (team && keys_split(st)) {
    // a long cache: each thread turns and caches its K/V heads, then takes an equal share of every head's blocks
    // of keys; after a barrier more, each merges all of them into its own copy of the outputs
    if (k1 > k0) turn_heads(st, L, ws.qkv.data(), k0, k1);
    barrier();                                               // every q turned, every k and v cached
    const AttentionProblem P = heads_problem(st, L, ws.qkv.data(), own.att.data(), 0, st.Hkv);
    const int64_t blocks = attention_blocks(P), tasks = st.B * st.Hkv * st.T * blocks;
    TORCH_INTERNAL_ASSERT(static_cast<int64_t>(ws.parts.size()) >= AttentionParts::floats(P, blocks));
    const AttentionParts parts(P, blocks, ws.parts.data());
    split_range(team, 0, tasks, 1, [&](int64_t a, int64_t b) {
      if (bf16) attend_tasks<WKind::BF16>(P, blocks, a, b, parts);
      else attend_tasks<WKind::F32>(P, blocks, a, b, parts);
    });
    barrier();                                               // every block's parts
    attend_merge(P, blocks, 0, st.B * st.Hkv * st.T, parts);
    if (bf16) round_bf16(own.att.data(), M * st.H * st.D);
    att = own.att.data();
  } else {
    if (k1 > k0) attend_heads(st, L, ws.qkv.data(), ws.att.data(), k0, k1);
    barrier();                                               // every head's attention complete
  }
  linear_rows(L.o, att, M, ws.proj.data(), team, &into_x);
  barrier();                                                 // x complete
  // MLP
  rms_norm(x, M, dim, *L.post_norm, L.eps2, bf16, own.h.data());
  bool fused = false;
#ifdef LLMINFER_X86
  // a prefill's many rows: SwiGLU taken by the blocked kernel as it stores, where it can
  fused = !team && M > kMatvecMaxRows && gemm_blocked_gated(own.h.data(), M, L.gate_up, bf16, own.act.data());
#endif
  if (!fused) {
    linear_rows(L.gate_up, own.h.data(), M, ws.gu.data(), team);
    barrier();                                               // gate and up complete
    for_rows(M, [&](int64_t m) {
      const float* g = ws.gu.data() + m * L.gate_up.N;
      gated(g, g + hidden, hidden, bf16, own.act.data() + m * hidden);
    });
  }
  linear_rows(L.down, own.act.data(), M, ws.proj.data(), team, &into_x);
  barrier();                                                 // x complete
}

// x through every layer of a stack, in place. A decode step's few tokens run in one parallel region of torch's
// threads for all the layers, in place of a region for each product and each attention; a prefill's many rows split
// each part over the threads.
void run_layers(const Step& st, const std::vector<Layer>& layers, std::vector<float>& x) {
  // the calling thread's workspace, kept between calls while it holds at most 16 MiB (fresh pages are zeroed by the
  // kernel at first touch); a longer prompt's is let go after its call
  thread_local Workspace ws;
  thread_local Own own;
  ws.fit(st, layers);
  struct Release {
    ~Release() {
      if ((ws.qkv.size() + ws.att.size() + ws.proj.size() + ws.gu.size() + own.h.size() + own.act.size()) * 4 >
          (size_t(16) << 20))
        ws = Workspace(), own = Own();
    }
  } release;
  const int threads = at::get_num_threads();
  if (st.B * st.T > kMatvecMaxRows || threads < 2 || at::in_parallel_region()) {
    own.fit(st, ws);
    for (const Layer& L : layers) run_layer(st, L, x.data(), ws, own, nullptr);
    return;
  }
  Workspace& shared = ws;                     // (in the region, `ws` would name each thread's own)
#pragma omp parallel num_threads(threads)
  {
    const Team team{omp_get_thread_num(), omp_get_num_threads()};
    Own mine(st, shared);
    for (const Layer& L : layers) run_layer(st, L, x.data(), shared, mine, &team);
  }
}

// Prepared stacks (the contract above): their fields and caches held in a table of this process, by number, until
// release_stack, and checked at the first step of each shape. Each step checks that no tensor it holds has moved
// (a weight's .data rebound, weights moved onto huge pages): a weight changed after prepare_stack needs a new stack.

struct PreparedStack {
  std::vector<c10::optional<at::Tensor>> tensors;
  std::vector<at::Tensor> k_caches, v_caches;
  std::vector<double> eps;
  std::vector<int64_t> activations;
  int64_t n_heads, kind;
  double scale;
  std::vector<Layer> layers;          // checked at the first step (empty: not yet)
  std::vector<int64_t> checked;       // the step they were checked for: x's dtype, B and dim
  std::vector<const void*> places;   // where every tensor's memory was when prepared
  std::mutex running;                 // one step at a time

  std::vector<const void*> where() const {
    std::vector<const void*> out;
    for (const auto& t : tensors) out.push_back(t.has_value() ? t->data_ptr() : nullptr);
    for (const auto* list : {&k_caches, &v_caches})
      for (const at::Tensor& c : *list) out.push_back(c.data_ptr());
    return out;
  }
};

std::mutex& prepared_lock() {
  static std::mutex lock;
  return lock;
}

std::unordered_map<int64_t, std::shared_ptr<PreparedStack>>& prepared_stacks() {
  static std::unordered_map<int64_t, std::shared_ptr<PreparedStack>> table;
  return table;
}

int64_t prepare_stack(const c10::List<c10::optional<at::Tensor>>& tensors, at::ArrayRef<double> eps,
                      at::IntArrayRef activations, int64_t n_heads, double scale, int64_t cache_kind,
                      at::TensorList k_caches, at::TensorList v_caches) {
  const char* op = "prepare_stack";
  const int64_t n_layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(n_layers > 0 && static_cast<int64_t>(v_caches.size()) == n_layers &&
              tensors.size() == n_layers * kLayerTensors && static_cast<int64_t>(eps.size()) == 2 * n_layers &&
              static_cast<int64_t>(activations.size()) == kProducts * n_layers, op, ": ", n_layers, " K caches, ",
              v_caches.size(), " V caches, ", tensors.size(), " tensors, ", eps.size(), " epsilons and ",
              activations.size(), " activation formats do not describe the same number of layers (",
              kLayerTensors, " tensors, 2 epsilons and ", kProducts, " formats each)");
  TORCH_CHECK(cache_kind == kContiguous || cache_kind == kPaged, op, ": cache_kind ", cache_kind,
              " is 0 (contiguous caches) or 1 (a paged pool)");
  auto stack = std::make_shared<PreparedStack>();
  for (const c10::optional<at::Tensor>& t : tensors) stack->tensors.push_back(t);
  stack->k_caches.assign(k_caches.begin(), k_caches.end());
  stack->v_caches.assign(v_caches.begin(), v_caches.end());
  stack->eps.assign(eps.begin(), eps.end());
  stack->activations.assign(activations.begin(), activations.end());
  stack->n_heads = n_heads, stack->scale = scale, stack->kind = cache_kind;
  stack->places = stack->where();
  std::lock_guard<std::mutex> guard(prepared_lock());
  static int64_t next = 0;
  prepared_stacks()[++next] = stack;
  return next;
}

void release_stack(int64_t id) {
  std::lock_guard<std::mutex> guard(prepared_lock());
  prepared_stacks().erase(id);
}

// One step through every layer of a prepared stack: x (B, T, dim) at positions (T,) over contiguous caches, or the
// new tokens of several sequences side by side, x (1, N, dim), token t of sequence token_seq[t] at positions[t] over
// a pool, whose K/V are written at the slot its block table names and which attends to its own sequence's positions
// up to its own, read in place from the blocks. Chapters 06 and 08.
at::Tensor run_stack(int64_t id, const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& positions, const c10::optional<at::Tensor>& token_seq,
                     const c10::optional<at::Tensor>& block_tables) {
  const char* op = "run_stack";
  std::shared_ptr<PreparedStack> stack;
  {
    std::lock_guard<std::mutex> guard(prepared_lock());
    auto found = prepared_stacks().find(id);
    TORCH_CHECK(found != prepared_stacks().end(), op, ": no prepared stack ", id,
                " (released, or never made by prepare_stack); prepare the stack again");
    stack = found->second;
  }
  PreparedStack& S = *stack;
  std::lock_guard<std::mutex> one_step(S.running);
  TORCH_CHECK(S.where() == S.places, op, ": a tensor of prepared stack ", id, " has moved since it was prepared (a "
              "weight's .data rebound, or moved onto huge pages); prepare the stack again after changing its weights");
  const Step st = check_step(x_in, cos, sin, positions, token_seq, block_tables, S.k_caches[0], S.kind, S.n_heads,
                             S.scale, op);
  const std::vector<int64_t> signature{static_cast<int64_t>(st.dtype), st.B, st.dim};
  if (S.layers.empty() || signature != S.checked) {        // the first step, or another shape: check everything
    S.layers.clear();
    for (int64_t l = 0; l < static_cast<int64_t>(S.k_caches.size()); ++l)
      S.layers.push_back(check_layer(st, S.tensors, S.eps, S.activations, l, S.k_caches[l], S.v_caches[l], op));
    S.checked = signature;
  }
  std::vector<float> x = x_as_float(x_in);
  run_layers(st, S.layers, x);
  return result(x.data(), x_in.sizes(), x_in);
}

std::vector<std::string> layer_fields() { return std::vector<std::string>(kLayerFields, kLayerFields + kLayerTensors); }

}  // namespace llminfer_cpu

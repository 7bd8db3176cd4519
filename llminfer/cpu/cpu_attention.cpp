// Attention of the native CPU kernels: queries against a K/V cache read in place, contiguous or paged (through
// block tables). Scores, softmax and the weighted sum of V in float32; positions a query may not see are skipped,
// and a query with no visible key gives NaN, as softmax over nothing does. Chapters 06 and 08.

#include <atomic>

#include "cpu_kernels.h"

namespace llminfer_cpu {

// The portable loops (the vector ones are cpu_vec.h's group_scores and group_values): scores[j] = scale · (q · k_j)
// over n K rows `stride` bytes apart, acc[d] += Σ_j p[j] · v_j[d], and scores[j] <- exp(scores[j] - best) (0 where
// -inf), returning their sum
template <WKind kind>
void key_scores(const float* q, const char* k, int64_t stride, int64_t n, int64_t D, float scale, float* scores) {
  for (int64_t j = 0; j < n; ++j) {
    float s = 0.f;
    for (int64_t d = 0; d < D; ++d) s += q[d] * weight_at<kind>(k + j * stride, d);
    scores[j] = s * scale;
  }
}

template <WKind kind>
void weighted_values(const float* p, const char* v, int64_t stride, int64_t n, int64_t D, float* acc) {
  for (int64_t j = 0; j < n; ++j)
    if (p[j] != 0.f)
      for (int64_t d = 0; d < D; ++d) acc[d] += p[j] * weight_at<kind>(v + j * stride, d);
}

inline float softmax_numerators(float* scores, int64_t n, float best, bool avx2) {
#ifdef LLMINFER_X86
  if (avx2) return avx2::exp_shifted(scores, n, best);
#endif
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = std::isinf(scores[j]) ? 0.f : std::exp(scores[j] - best);
    total += scores[j];
  }
  return total;
}

// fn(k rows, v rows, first position, count) over the keys [begin, end) of query position t, K/V head hk, in runs
// whose rows lie ks2 (vs2) elements apart: one run in a contiguous cache; in a paged one, a run per block,
// found through the block table of the query's sequence
template <typename Fn>
inline void for_key_runs(const AttentionProblem& P, int64_t b, int64_t hk, int64_t t, int64_t begin, int64_t end,
                         int64_t esize, const Fn& fn) {
  if (P.tables == nullptr) {
    fn(P.k + (b * P.ks0 + hk * P.ks1 + begin * P.ks2) * esize, P.v + (b * P.vs0 + hk * P.vs1 + begin * P.vs2) * esize,
       begin, end - begin);
    return;
  }
  const int64_t* table = P.tables + P.seq[t] * P.table_stride;
  for (int64_t p = begin; p < end;) {
    const int64_t offset = p % P.block_size, len = std::min<int64_t>(end - p, P.block_size - offset);
    const int64_t slot = table[p / P.block_size] * P.block_size + offset;        // row of the pool
    fn(P.k + (slot * P.ks2 + hk * P.ks1) * esize, P.v + (slot * P.vs2 + hk * P.vs1) * esize, p, len);
    p += len;
  }
}

#ifdef LLMINFER_X86
// A prefill's attention: many query positions of a sequence against its cache, read in place (contiguous, no mask).
// One query at a time (below) reads every visible K and V row once per query position; here a task takes a K/V head
// and a block of 16 positions, its query rows (the group's heads at each position) side by side, and does the two
// products as small matrix products with the rows in registers:
//   scores  S (rows, keys) = Q · Kᵀ · scale, 12 query rows by 32 keys a tile: K transposed once per K/V head (keys
//           along the lanes), each step of d broadcasting one element of each of the 12 query rows
//   softmax each row over the keys up to its own position, 16 lanes at a time (softmax_numerators_avx512)
//   output  O (rows, D) = softmax(S) · V, 6 rows by 64 columns a tile: each value row widened once for the 6 rows
// Tasks go to the threads as they free up, the longest (last positions) first; each is one thread's, so the numbers
// do not depend on the number of threads.
constexpr int64_t kPrefillBlock = 16;   // query positions of a task

// S[i·ss + j] = scale · Σ_d q[i][d] · kt[d·kts + j] for R rows and 32 keys j
template <int R>
LLMINFER_ON_AVX512 inline void prefill_scores_tile(const float* const* q, const float* kt, int64_t kts, int64_t D,
                                                   float scale, float* S, int64_t ss) {
  __m512 a[R], b[R];
  for (int i = 0; i < R; ++i) a[i] = b[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 k0 = _mm512_loadu_ps(kt + d * kts), k1 = _mm512_loadu_ps(kt + d * kts + 16);
    for (int i = 0; i < R; ++i) {
      const __m512 qd = _mm512_set1_ps(q[i][d]);
      a[i] = _mm512_fmadd_ps(qd, k0, a[i]);
      b[i] = _mm512_fmadd_ps(qd, k1, b[i]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int i = 0; i < R; ++i) {
    _mm512_storeu_ps(S + i * ss, _mm512_mul_ps(a[i], sc));
    _mm512_storeu_ps(S + i * ss + 16, _mm512_mul_ps(b[i], sc));
  }
}

// O[i·os + d0 ..] = Σ_j p[i·ps + j] · v_j[d0 .. d0 + 16·C) for R rows over n value rows `stride` bytes apart
template <WKind kind, int R, int C>
LLMINFER_ON_AVX512 inline void prefill_values_tile(const float* p, int64_t ps, const char* v, int64_t stride, int64_t n,
                                                   int64_t d0, float* const* o) {
  __m512 a[R][C];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) a[i][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m512 row[C];
    for (int c = 0; c < C; ++c) row[c] = wload16<kind>(v + j * stride, d0 + 16 * c);
    for (int i = 0; i < R; ++i) {
      const __m512 pj = _mm512_set1_ps(p[i * ps + j]);
      for (int c = 0; c < C; ++c) a[i][c] = _mm512_fmadd_ps(row[c], pj, a[i][c]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o[i] + d0 + 16 * c, a[i][c]);
}

// dst[d·kts + j] = k_j[d] for keys j < n (rows `stride` bytes apart), 0 for n <= j < kts (a multiple of 16): 16 keys
// by 16 dimensions at a time, transposed in registers; D a multiple of 16
template <WKind kind>
LLMINFER_ON_AVX512 void transpose_keys(const char* k, int64_t stride, int64_t n, int64_t D, float* dst, int64_t kts) {
  for (int64_t j0 = 0; j0 < kts; j0 += 16)
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 r[16];
      for (int64_t j = 0; j < 16; ++j) r[j] = j0 + j < n ? wload16<kind>(k + (j0 + j) * stride, d0) : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t i = 0; i < 16; ++i) _mm512_storeu_ps(dst + (d0 + i) * kts + j0, r[i]);
    }
}

// s[lanes] <- exp(s - shift), 0 where s is -inf; returns them (0 in the other lanes)
LLMINFER_ON_AVX512 inline __m512 softmax_lanes(float* s, __mmask16 lanes, __m512 shift) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 v = _mm512_mask_loadu_ps(neg_inf, lanes, s);
  const __mmask16 seen = _mm512_cmp_ps_mask(v, neg_inf, _CMP_NEQ_OQ);
  const __m512 e = _mm512_maskz_mov_ps(seen, V16::exp(_mm512_sub_ps(v, shift)));
  _mm512_mask_storeu_ps(s, lanes, e);
  return e;
}

// s[0 .. n) <- exp(s - max s), 16 at a time, the last n % 16 under a mask; returns their sum, or 0 (s untouched)
// where every score is -inf
LLMINFER_ON_AVX512 float softmax_numerators_avx512(float* s, int64_t n) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t whole = n - n % 16;
  const __mmask16 last = static_cast<__mmask16>((1u << (n % 16)) - 1);
  __m512 top = neg_inf;
  for (int64_t j = 0; j < whole; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
  if (last) top = _mm512_max_ps(top, _mm512_mask_loadu_ps(neg_inf, last, s + whole));
  const float best = _mm512_reduce_max_ps(top);
  if (best == -std::numeric_limits<float>::infinity()) return 0.f;
  const __m512 shift = _mm512_set1_ps(best);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < whole; j += 16) sum = _mm512_add_ps(sum, softmax_lanes(s + j, 0xFFFF, shift));
  if (last) sum = _mm512_add_ps(sum, softmax_lanes(s + whole, last, shift));
  return _mm512_reduce_add_ps(sum);
}

template <WKind kind>
void attend_prefill(const AttentionProblem& P) {
  const int64_t group = P.H / P.Hkv, D = P.D, esize = wbytes<kind>();
  int64_t n_keys = 0;                                          // the keys any query sees
  for (int64_t t = 0; t < P.Tq; ++t) n_keys = std::max(n_keys, std::min(P.n_keys, P.last[t] + 1));
  const int64_t kts = (n_keys + 31) / 32 * 32;                 // keys of a transposed K row, padded to a tile
  const int64_t heads = P.B * P.Hkv, blocks = (P.Tq + kPrefillBlock - 1) / kPrefillBlock;
  // K of each (batch, K/V head) as float32, transposed: kt[d][j]
  std::vector<float> kt(heads * D * kts);
  at::parallel_for(0, heads, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      const char* k = P.k + ((h / P.Hkv) * P.ks0 + (h % P.Hkv) * P.ks1) * esize;
      transpose_keys<kind>(k, P.ks2 * esize, n_keys, D, kt.data() + h * D * kts, kts);
    }
  });
  const int64_t tasks = heads * blocks;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const int64_t max_rows = group * kPrefillBlock;
    std::vector<float> S((max_rows + 12) * kts), zero(D, 0.f), sums(max_rows);
    std::vector<const float*> q(max_rows + 12);
    std::vector<float*> o(max_rows + 6);
    std::vector<float> spill(6 * D);                          // the outputs of a tile's rows past the last
    for (int64_t task; (task = next++) < tasks;) {
      // the last blocks first (they see the most keys), every head of a block before the next block
      const int64_t blk = blocks - 1 - task / heads, h = task % heads, b = h / P.Hkv, hk = h % P.Hkv;
      const int64_t t0 = blk * kPrefillBlock, t1 = std::min(P.Tq, t0 + kPrefillBlock), rows = (t1 - t0) * group;
      int64_t n = 0;                                           // the keys this block sees
      for (int64_t t = t0; t < t1; ++t) n = std::max(n, std::min(P.n_keys, P.last[t] + 1));
      const int64_t nt = (n + 31) / 32 * 32;
      for (int64_t r = 0; r < rows; ++r) {                     // row r: position t0 + r / group, head r % group
        const int64_t t = t0 + r / group, head = hk * group + r % group;
        q[r] = P.q + b * P.qs0 + head * P.qs1 + t * P.qs2;
        o[r] = P.out + b * P.os0 + head * P.os1 + t * P.os2;
      }
      for (int64_t r = rows; r < rows + 12; ++r) q[r] = zero.data();
      for (int64_t r = rows; r < rows + 6; ++r) o[r] = spill.data() + (r - rows) * D;
      const float* ktile = kt.data() + h * D * kts;
      for (int64_t r0 = 0; r0 < rows; r0 += 12)
        for (int64_t j0 = 0; j0 < nt; j0 += 32)
          prefill_scores_tile<12>(q.data() + r0, ktile + j0, kts, D, P.scale, S.data() + r0 * kts + j0, kts);
      for (int64_t r = 0; r < rows; ++r) {                     // softmax over the keys up to the row's position
        float* row = S.data() + r * kts;
        const int64_t seen = std::max<int64_t>(0, std::min(P.n_keys, P.last[t0 + r / group] + 1));
        sums[r] = softmax_numerators_avx512(row, seen);
        std::fill(row + seen, row + n, 0.f);
      }
      const char* v = P.v + (b * P.vs0 + hk * P.vs1) * esize;
      for (int64_t r0 = 0; r0 < rows; r0 += 6) {
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
          float* const* out = o.data() + r0;
          const float* p = S.data() + r0 * kts;
          const int64_t left = D - d0;
          if (left >= 64) prefill_values_tile<kind, 6, 4>(p, kts, v, P.vs2 * esize, n, d0, out);
          else if (left >= 32) prefill_values_tile<kind, 6, 2>(p, kts, v, P.vs2 * esize, n, d0, out);
          else prefill_values_tile<kind, 6, 1>(p, kts, v, P.vs2 * esize, n, d0, out);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = sums[r] > 0.f ? 1.f / sums[r] : std::numeric_limits<float>::quiet_NaN();
        for (int64_t d = 0; d < D; ++d) o[r][d] *= inv;
      }
    }
  });
}
#endif

// The work is split into tasks of (batch, K/V head, query position, block of keys): the query heads that share the
// K/V head are done together, so each key and value row is read once for all of them, and the keys are split into
// blocks so that both a long cache and a few heads spread over every thread. Each task keeps its block's running
// maximum, sum of exponentials and unnormalised weighted sum of V; the blocks of one query are then merged by
// rescaling to a common maximum (the online softmax of chapter 07).
int64_t attention_blocks(const AttentionProblem& P) {
  const int64_t rows = P.B * P.Hkv * P.Tq, Tk = P.n_keys;
  if (P.whole) return fixed_key_blocks(Tk, P.key_block);
  // about four tasks a thread, blocks of at least 64 keys
  return std::max<int64_t>(1, std::min<int64_t>((4 * at::get_num_threads() + rows - 1) / rows, (Tk + 63) / 64));
}

template <WKind kind>
void attend_tasks(const AttentionProblem& P, int64_t blocks, int64_t task0, int64_t task1,
                  const AttentionParts& parts) {
  const int64_t group = P.H / P.Hkv, D = P.D, Tk = P.n_keys, esize = wbytes<kind>();
  // AVX-512 takes up to four query heads a pass over the K and V rows where every key up to a query's own is
  // visible, AVX2 one head at a time, the portable loops the rest
  const bool avx2 = has_avx2() && D % 8 == 0, wide = has(kAVX512) && D % 16 == 0 && !P.mask;
  const int64_t heads = wide ? 4 : 1;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t block = (Tk + blocks - 1) / blocks;
  std::vector<float> scores(group * block);
  for (int64_t task = task0; task < task1; ++task) {
    const int64_t r = task / blocks, c = task % blocks;
    const int64_t b = r / (P.Hkv * P.Tq), hk = (r / P.Tq) % P.Hkv, t = r % P.Tq;
    const float* qrow[64];
    for (int64_t g = 0; g < group; ++g) qrow[g] = P.q + b * P.qs0 + (hk * group + g) * P.qs1 + t * P.qs2;
    float* best = parts.best + task * group;
    float* total = parts.total + task * group;
    float* acc = parts.acc + task * group * D;
    std::fill(best, best + group, neg_inf);
    std::fill(total, total + group, 0.f);
    std::fill(acc, acc + group * D, 0.f);
    const int64_t begin = c * block;
    const int64_t end = std::min<int64_t>(std::min<int64_t>(Tk, begin + block), P.mask ? Tk : P.last[t] + 1);
    if (end <= begin) continue;
    const int64_t n = end - begin;
    for (int64_t g0 = 0; g0 < group; g0 += heads) {
      const int64_t G = std::min(heads, group - g0);
      float* sc = scores.data() + g0 * block;
      for_key_runs(P, b, hk, t, begin, end, esize, [&](const char* krows, const char* vrows, int64_t first,
                                                       int64_t len) {
        const int64_t ks = P.ks2 * esize, vs = P.vs2 * esize;
        float* s = sc + (first - begin);
#ifdef LLMINFER_X86
        if (wide) return avx512::group_scores<kind>(G, qrow + g0, krows, ks, len, D, P.scale, s, block, vrows, vs);
        if (avx2) return avx2::group_scores<kind>(1, qrow + g0, krows, ks, len, D, P.scale, s, block, vrows, vs);
#endif
        key_scores<kind>(qrow[g0], krows, ks, len, D, P.scale, s);
      });
      for (int64_t g = g0; g < g0 + G; ++g) {
        float* row = scores.data() + g * block;
        if (P.mask) {
          const bool* m = P.mask + b * P.ms0 + (hk * group + g) * P.ms1 + t * P.ms2;
          for (int64_t j = 0; j < n; ++j)
            if (!m[(begin + j) * P.ms3]) row[j] = neg_inf;
        }
        for (int64_t j = 0; j < n; ++j) best[g] = std::max(best[g], row[j]);
        if (best[g] == neg_inf) std::fill(row, row + n, 0.f);  // nothing visible: this head adds nothing
        else total[g] = softmax_numerators(row, n, best[g], avx2);
      }
      for_key_runs(P, b, hk, t, begin, end, esize, [&](const char*, const char* vrows, int64_t first, int64_t len) {
        const float* p = sc + (first - begin);
        const int64_t vs = P.vs2 * esize;
#ifdef LLMINFER_X86
        if (wide) return avx512::group_values<kind>(G, p, block, vrows, vs, len, D, acc + g0 * D);
        if (avx2) return avx2::group_values<kind>(1, p, block, vrows, vs, len, D, acc + g0 * D);
#endif
        weighted_values<kind>(p, vrows, vs, len, D, acc + g0 * D);
      });
    }
  }
}

void attend_merge(const AttentionProblem& P, int64_t blocks, int64_t r0, int64_t r1, const AttentionParts& parts) {
  const int64_t group = P.H / P.Hkv, D = P.D;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t b = r / (P.Hkv * P.Tq), hk = (r / P.Tq) % P.Hkv, t = r % P.Tq;
    for (int64_t g = 0; g < group; ++g) {
      float* o = P.out + b * P.os0 + (hk * group + g) * P.os1 + t * P.os2;
      const int64_t first = r * blocks * group + g;        // block c's entry: first + c · group
      float top = neg_inf;
      for (int64_t c = 0; c < blocks; ++c) top = std::max(top, parts.best[first + c * group]);
      std::fill(o, o + D, 0.f);
      float sum = 0.f;
      if (top != neg_inf) {
        for (int64_t c = 0; c < blocks; ++c) {
          const int64_t idx = first + c * group;
          if (parts.best[idx] == neg_inf) continue;
          const float w = std::exp(parts.best[idx] - top);
          sum += w * parts.total[idx];
          const float* acc = parts.acc + idx * D;
          for (int64_t d = 0; d < D; ++d) o[d] += w * acc[d];
        }
      }
      const float inv = sum > 0.f ? 1.f / sum : std::numeric_limits<float>::quiet_NaN();
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
}

template <WKind kind>
void attend(const AttentionProblem& P) {
#ifdef LLMINFER_X86
  // the AVX-512 loops that take the heads of a group together, where every key up to a query's own is visible
  const bool wide = has(kAVX512) && P.D % 16 == 0 && !P.mask;
  if (wide && P.tables == nullptr && P.Tq >= kPrefillBlock) return attend_prefill<kind>(P);
#endif
  const int64_t rows = P.B * P.Hkv * P.Tq, blocks = attention_blocks(P);
  std::vector<float> store(AttentionParts::floats(P, blocks));
  const AttentionParts parts(P, blocks, store.data());
  at::parallel_for(0, rows * blocks, 1, [&](int64_t t0, int64_t t1) { attend_tasks<kind>(P, blocks, t0, t1, parts); });
  // merge the blocks of each query (split over the threads too)
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) { attend_merge(P, blocks, r0, r1, parts); });
}

template void attend<WKind::F32>(const AttentionProblem& P);
template void attend<WKind::BF16>(const AttentionProblem& P);
template void attend_tasks<WKind::F32>(const AttentionProblem&, int64_t, int64_t, int64_t, const AttentionParts&);
template void attend_tasks<WKind::BF16>(const AttentionProblem&, int64_t, int64_t, int64_t, const AttentionParts&);

// P's outputs (Tq·D floats a head, with `scale`) as a new tensor shaped and typed like q
at::Tensor attend_into(AttentionProblem& P, const at::Tensor& q, double scale) {
  std::vector<float> out(q.numel());
  P.scale = static_cast<float>(scale);
  P.out = out.data();
  P.os0 = P.H * P.Tq * P.D, P.os1 = P.Tq * P.D, P.os2 = P.D;
  if (q.scalar_type() == at::kFloat) attend<WKind::F32>(P);
  else attend<WKind::BF16>(P);
  return result(out.data(), q.sizes(), q);
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
  std::vector<float> qf = x_as_float(q);
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
  return attend_into(P, q, scale);
}

// Block tables, checked: tables (S, W) int64, token_seq (N,) the sequence of each query, positions (N,) each
// query's position (it sees its sequence's positions 0 .. positions[t]); every block a query reads must lie in
// the pool of num_blocks blocks of block_size positions. Returns the longest context (max position + 1).
int64_t check_block_tables(const at::Tensor& tables, const at::Tensor& token_seq, const at::Tensor& positions,
                           int64_t num_blocks, int64_t block_size, const char* op) {
  for (const at::Tensor* t : {&tables, &token_seq, &positions})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(), op,
                ": block tables, token sequences and positions must be contiguous int64 CPU tensors");
  TORCH_CHECK(tables.dim() == 2 && tables.size(1) > 0 && token_seq.dim() == 1 && positions.dim() == 1 &&
              token_seq.size(0) == positions.size(0), op, ": block tables (S, W), token_seq (N,) and positions (N,)"
              " expected, got ", tables.sizes(), ", ", token_seq.sizes(), ", ", positions.sizes());
  const int64_t S = tables.size(0), W = tables.size(1), N = positions.size(0);
  const int64_t *tab = tables.data_ptr<int64_t>(), *seq = token_seq.data_ptr<int64_t>(),
                *pos = positions.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t t = 0; t < N; ++t) {
    TORCH_CHECK(seq[t] >= 0 && seq[t] < S, op, ": token ", t, " belongs to sequence ", seq[t], " but there are ", S,
                " block tables");
    TORCH_CHECK(pos[t] >= 0 && pos[t] < W * block_size, op, ": position ", pos[t], " of token ", t,
                " is outside its block table's ", W, " blocks of ", block_size);
    for (int64_t j = 0; j <= pos[t] / block_size; ++j)
      TORCH_CHECK(tab[seq[t] * W + j] >= 0 && tab[seq[t] * W + j] < num_blocks, op, ": block ", tab[seq[t] * W + j],
                  " of sequence ", seq[t], " is outside the pool's 0..", num_blocks - 1);
    longest = std::max(longest, pos[t] + 1);
  }
  return longest;
}

// q (1, H, N, D), unit stride along D: the new tokens of several sequences side by side; k_pool, v_pool
// (num_blocks, block_size, H_kv, D) contiguous. Token t attends to positions 0 .. positions[t] of sequence
// token_seq[t], read in place from the blocks its row of block_tables (S, W) names. Returns (1, H, N, D).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& block_tables, const at::Tensor& token_seq, const at::Tensor& positions,
                           double scale) {
  const char* op = "paged_attention";
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && q.stride(3) == 1 && q.device().is_cpu(), op,
              ": q must be a (1, H, N, D) CPU tensor with unit stride along D, got ", q.sizes());
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type() &&
              (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16), op,
              ": q and the pools must share one dtype, float32 or bfloat16");
  const int64_t H = q.size(1), N = q.size(2), D = q.size(3);
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes() && k_pool.is_contiguous() &&
              v_pool.is_contiguous() && k_pool.size(3) == D && k_pool.size(2) > 0 && H % k_pool.size(2) == 0 &&
              H / k_pool.size(2) <= 64 && k_pool.device().is_cpu() && v_pool.device().is_cpu(), op,
              ": the pools must be contiguous (num_blocks, block_size, H_kv, D) CPU tensors with H a multiple of "
              "H_kv (at most 64 query heads per K/V head), got ", k_pool.sizes(), " for q ", q.sizes());
  TORCH_CHECK(positions.size(0) == N, op, ": ", positions.size(0), " positions for ", N, " query tokens");
  const int64_t Hkv = k_pool.size(2), block_size = k_pool.size(1);
  const int64_t longest = check_block_tables(block_tables, token_seq, positions, k_pool.size(0), block_size, op);
  std::vector<float> qf = x_as_float(q);                            // (H, N, D)
  AttentionProblem P{1, H, Hkv, N, D, longest, qf.data(), H * N * D, N * D, D,
                     static_cast<const char*>(k_pool.data_ptr()), static_cast<const char*>(v_pool.data_ptr()),
                     0, D, Hkv * D, 0, D, Hkv * D};
  P.last = positions.data_ptr<int64_t>();
  P.tables = block_tables.data_ptr<int64_t>();
  P.seq = token_seq.data_ptr<int64_t>();
  P.table_stride = block_tables.size(1);
  P.block_size = block_size;
  return attend_into(P, q, scale);
}

}  // namespace llminfer_cpu

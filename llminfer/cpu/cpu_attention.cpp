// Decode attention of the native CPU kernels: a few queries against a K/V cache read in place, contiguous or
// paged (through block tables). Chapters 06 and 08.

#include <atomic>

#include "cpu_kernels.h"

namespace llminfer_cpu {

#ifdef LLMINFER_X86
// Keys j..j+3 are next: their rows' lines of V (read after the softmax), and those of K 16 keys on, into the cache
// ahead of use. A layer's cache was last read a whole step of weights ago, so it comes from memory; the hardware
// alone fetched it a miss at a time (on a Zen 5 a bfloat16 K/V head of about 160 positions took 1.4 to 1.5 times as long).
template <WKind kind>
inline void prefetch_kv(const char* k, int64_t kstride, const char* v, int64_t vstride, int64_t j, int64_t n,
                        int64_t D) {
  const int64_t row_bytes = D * wbytes<kind>();
  for (int64_t i = j; i < j + 4; ++i)
    for (int64_t line = 0; line < row_bytes; line += 64) {
      if (i + 16 < n) _mm_prefetch(k + (i + 16) * kstride + line, _MM_HINT_T0);
      _mm_prefetch(v + i * vstride + line, _MM_HINT_T0);
    }
}

// scores[j] = scale · (q · k_j) for n keys whose rows lie `stride` bytes apart, four keys at a time (the V rows
// alongside, `vstride` apart, fetched ahead for weighted_values)
template <WKind kind>
__attribute__((target("avx2,fma"))) void key_scores_avx2(const float* q, const char* k, int64_t stride, int64_t n,
                                                          int64_t D, float scale, float* scores, const char* v,
                                                          int64_t vstride) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    prefetch_kv<kind>(k, stride, v, vstride, j, n, D);
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

// AVX-512: the query heads that share a K/V head, up to four at once, against each key and value row loaded and
// widened once for all of them (the loops above take one head at a time)

// [Σ a, Σ b, Σ c, Σ d] over each vector's lanes, in one tree of adds
__attribute__((target(LLMINFER_AVX512))) inline __m128 sum4x16(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(halves_sum(a), halves_sum(b)),
                                  _mm256_hadd_ps(halves_sum(c), halves_sum(d)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// scores[g·ss + j] = scale · (q[g] · k_j) for G query heads and n keys whose rows lie `stride` bytes apart, four
// keys at a time; D a multiple of 16
template <WKind kind, int G>
__attribute__((target(LLMINFER_AVX512))) void group_scores_avx512(const float* const* q, const char* k,
                                                                   int64_t stride, int64_t n, int64_t D, float scale,
                                                                   float* scores, int64_t ss, const char* v,
                                                                   int64_t vstride) {
  const __m128 scale4 = _mm_set1_ps(scale);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    prefetch_kv<kind>(k, stride, v, vstride, j, n, D);
    __m512 a[G][4];
    for (int g = 0; g < G; ++g) a[g][0] = a[g][1] = a[g][2] = a[g][3] = _mm512_setzero_ps();
    const char* r = k + j * stride;
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 k0 = wload16<kind>(r, d), k1 = wload16<kind>(r + stride, d), k2 = wload16<kind>(r + 2 * stride, d),
                   k3 = wload16<kind>(r + 3 * stride, d);
      for (int g = 0; g < G; ++g) {
        const __m512 qv = _mm512_loadu_ps(q[g] + d);
        a[g][0] = _mm512_fmadd_ps(k0, qv, a[g][0]);
        a[g][1] = _mm512_fmadd_ps(k1, qv, a[g][1]);
        a[g][2] = _mm512_fmadd_ps(k2, qv, a[g][2]);
        a[g][3] = _mm512_fmadd_ps(k3, qv, a[g][3]);
      }
    }
    for (int g = 0; g < G; ++g)
      _mm_storeu_ps(scores + g * ss + j, _mm_mul_ps(sum4x16(a[g][0], a[g][1], a[g][2], a[g][3]), scale4));
  }
  for (; j < n; ++j)
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) a = _mm512_fmadd_ps(wload16<kind>(k + j * stride, d), _mm512_loadu_ps(q[g] + d), a);
      scores[g * ss + j] = hsum16(a) * scale;
    }
}

// acc[g·D + d] += Σ_j p[g·ps + j] · v_j[d] for G query heads over n value rows `stride` bytes apart, 16·S columns
// of every head in registers at a time; D a multiple of 16·S
template <WKind kind, int G, int S>
__attribute__((target(LLMINFER_AVX512))) void group_values_avx512(const float* p, int64_t ps, const char* v,
                                                                   int64_t stride, int64_t n, int64_t D, float* acc) {
  for (int64_t d0 = 0; d0 < D; d0 += 16 * S) {
    __m512 a[G][S];
    for (int g = 0; g < G; ++g)
      for (int s = 0; s < S; ++s) a[g][s] = _mm512_loadu_ps(acc + g * D + d0 + 16 * s);
    for (int64_t j = 0; j < n; ++j) {
      __m512 row[S];
      for (int s = 0; s < S; ++s) row[s] = wload16<kind>(v + j * stride, d0 + 16 * s);
      for (int g = 0; g < G; ++g) {
        const __m512 pj = _mm512_set1_ps(p[g * ps + j]);
        for (int s = 0; s < S; ++s) a[g][s] = _mm512_fmadd_ps(row[s], pj, a[g][s]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int s = 0; s < S; ++s) _mm512_storeu_ps(acc + g * D + d0 + 16 * s, a[g][s]);
  }
}

template <WKind kind>
void group_scores(int64_t G, const float* const* q, const char* k, int64_t stride, int64_t n, int64_t D, float scale,
                  float* scores, int64_t ss, const char* v, int64_t vstride) {
  switch (G) {
    case 1: return group_scores_avx512<kind, 1>(q, k, stride, n, D, scale, scores, ss, v, vstride);
    case 2: return group_scores_avx512<kind, 2>(q, k, stride, n, D, scale, scores, ss, v, vstride);
    case 3: return group_scores_avx512<kind, 3>(q, k, stride, n, D, scale, scores, ss, v, vstride);
    default: return group_scores_avx512<kind, 4>(q, k, stride, n, D, scale, scores, ss, v, vstride);
  }
}

template <WKind kind, int G>
void group_values_g(const float* p, int64_t ps, const char* v, int64_t stride, int64_t n, int64_t D, float* acc) {
  if (D % 64 == 0) return group_values_avx512<kind, G, 4>(p, ps, v, stride, n, D, acc);
  if (D % 32 == 0) return group_values_avx512<kind, G, 2>(p, ps, v, stride, n, D, acc);
  return group_values_avx512<kind, G, 1>(p, ps, v, stride, n, D, acc);
}

template <WKind kind>
void group_values(int64_t G, const float* p, int64_t ps, const char* v, int64_t stride, int64_t n, int64_t D,
                  float* acc) {
  switch (G) {
    case 1: return group_values_g<kind, 1>(p, ps, v, stride, n, D, acc);
    case 2: return group_values_g<kind, 2>(p, ps, v, stride, n, D, acc);
    case 3: return group_values_g<kind, 3>(p, ps, v, stride, n, D, acc);
    default: return group_values_g<kind, 4>(p, ps, v, stride, n, D, acc);
  }
}
#endif

// ---------------------------------------------------------------------------------------------------
// decode attention: a few queries against a K/V cache, read in place. Scores, softmax and the weighted
// sum of V are computed in float32, and positions a query may not see are skipped. A query with no
// visible key gives NaN, as softmax over nothing does.

template <WKind kind>
void key_scores(const float* q, const char* k, int64_t stride, int64_t n, int64_t D, float scale, float* scores,
                const char* v, int64_t vstride, bool avx2) {
#ifdef LLMINFER_X86
  if (avx2) return key_scores_avx2<kind>(q, k, stride, n, D, scale, scores, v, vstride);
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
__attribute__((target(LLMINFER_AVX512))) inline void prefill_scores_tile(const float* const* q, const float* kt,
                                                                          int64_t kts, int64_t D, float scale,
                                                                          float* S, int64_t ss) {
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
__attribute__((target(LLMINFER_AVX512))) inline void prefill_values_tile(const float* p, int64_t ps, const char* v,
                                                                          int64_t stride, int64_t n, int64_t d0,
                                                                          float* const* o) {
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
__attribute__((target(LLMINFER_AVX512))) void transpose_keys(const char* k, int64_t stride, int64_t n, int64_t D,
                                                              float* dst, int64_t kts) {
  for (int64_t j0 = 0; j0 < kts; j0 += 16)
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 r[16];
      for (int64_t j = 0; j < 16; ++j) r[j] = j0 + j < n ? wload16<kind>(k + (j0 + j) * stride, d0) : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t i = 0; i < 16; ++i) _mm512_storeu_ps(dst + (d0 + i) * kts + j0, r[i]);
    }
}

// s[lanes] <- exp(s - shift), 0 where s is -inf; returns them (0 in the other lanes)
__attribute__((target(LLMINFER_AVX512))) inline __m512 softmax_lanes(float* s, __mmask16 lanes, __m512 shift) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 v = _mm512_mask_loadu_ps(neg_inf, lanes, s);
  const __mmask16 seen = _mm512_cmp_ps_mask(v, neg_inf, _CMP_NEQ_OQ);
  const __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(v, shift)));
  _mm512_mask_storeu_ps(s, lanes, e);
  return e;
}

// s[0 .. n) <- exp(s - max s), 16 at a time, the last n % 16 under a mask; returns their sum, or 0 (s untouched)
// where every score is -inf. (A row's keys end at its own position, so 7.5 of them on average were left over, and
// one at a time through libm's expf they took about as long as the vector loop did. With the masked tail, a layer's
// attention over 128 positions, 9 query heads on 3 K/V heads, took 264 against 310 µs at one thread on a Xeon with
// AMX (three alternating processes each), and a 128-token bfloat16 prefill ran 1.03 times as fast, the median of 6
// alternating pairs at two threads.)
__attribute__((target(LLMINFER_AVX512))) float softmax_numerators_avx512(float* s, int64_t n) {
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

// The work is split into tasks of (batch, K/V head, query position, block of keys): the query heads that
// share the K/V head are done together, so each key and value row is read once for all of them, and the
// keys are split into blocks so that both a long cache and a few heads spread over every thread. Each task
// keeps its block's running maximum, sum of exponentials and unnormalised weighted sum of V; the blocks of
// one query are then merged by rescaling to a common maximum (the online softmax of chapter 07). Where the CPU
// runs AVX-512 and every key up to a query's own is visible, the query heads of a task go up to four at a time
// through each K and V row, widened once for all of them (on a Zen 5, 9 query heads over 3 K/V heads of 192
// bfloat16 positions took 10.7 µs against 17.6 a head at a time).
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
  const bool avx2 = has_avx2() && D % 8 == 0;
#ifdef LLMINFER_X86
  const bool wide = has(kAVX512) && D % 16 == 0 && !P.mask;
#endif
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
#ifdef LLMINFER_X86
    if (wide) {                                              // up to four heads a pass over the K and V rows
      for (int64_t g0 = 0; g0 < group; g0 += 4) {
        const int64_t G = std::min<int64_t>(4, group - g0);
        float* sc = scores.data() + g0 * block;
        for_key_runs(P, b, hk, t, begin, end, esize, [&](const char* krows, const char* vrows, int64_t first,
                                                         int64_t len) {
          group_scores<kind>(G, qrow + g0, krows, P.ks2 * esize, len, D, P.scale, sc + (first - begin), block,
                             vrows, P.vs2 * esize);
        });
        for (int64_t g = g0; g < g0 + G; ++g) {
          float* row = scores.data() + g * block;
          for (int64_t j = 0; j < n; ++j) best[g] = std::max(best[g], row[j]);
          if (best[g] == neg_inf) std::fill(row, row + n, 0.f);  // nothing visible: this head adds nothing
          else total[g] = softmax_numerators(row, n, best[g], true);
        }
        for_key_runs(P, b, hk, t, begin, end, esize, [&](const char*, const char* vrows, int64_t first, int64_t len) {
          group_values<kind>(G, sc + (first - begin), block, vrows, P.vs2 * esize, len, D, acc + g0 * D);
        });
      }
      continue;
    }
#endif
    for (int64_t g = 0; g < group; ++g) {
      float* sc = scores.data() + g * block;
      for_key_runs(P, b, hk, t, begin, end, esize, [&](const char* krows, const char* vrows, int64_t first,
                                                       int64_t len) {
        key_scores<kind>(qrow[g], krows, P.ks2 * esize, len, D, P.scale, sc + (first - begin), vrows,
                         P.vs2 * esize, avx2);
      });
      if (P.mask) {
        const bool* m = P.mask + b * P.ms0 + (hk * group + g) * P.ms1 + t * P.ms2;
        for (int64_t j = 0; j < n; ++j)
          if (!m[(begin + j) * P.ms3]) sc[j] = neg_inf;
      }
      for (int64_t j = 0; j < n; ++j) best[g] = std::max(best[g], sc[j]);
      if (best[g] == neg_inf) continue;
      total[g] = softmax_numerators(sc, n, best[g], avx2);
      for_key_runs(P, b, hk, t, begin, end, esize, [&](const char*, const char* vrows, int64_t first, int64_t len) {
        weighted_values<kind>(sc + (first - begin), vrows, P.vs2 * esize, len, D, acc + g * D, avx2);
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
  // merge the blocks of each query (split over the threads too: a prefill's thousand rows took a tenth of its
  // attention on one)
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) { attend_merge(P, blocks, r0, r1, parts); });
}


template void attend<WKind::F32>(const AttentionProblem& P);
template void attend<WKind::BF16>(const AttentionProblem& P);
template void attend_tasks<WKind::F32>(const AttentionProblem&, int64_t, int64_t, int64_t, const AttentionParts&);
template void attend_tasks<WKind::BF16>(const AttentionProblem&, int64_t, int64_t, int64_t, const AttentionParts&);

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
  std::vector<float> qf = x_as_float(q), out(H * N * D);          // (H, N, D)
  AttentionProblem P{1, H, Hkv, N, D, longest, qf.data(), H * N * D, N * D, D,
                     static_cast<const char*>(k_pool.data_ptr()), static_cast<const char*>(v_pool.data_ptr()),
                     0, D, Hkv * D, 0, D, Hkv * D};
  P.last = positions.data_ptr<int64_t>();
  P.tables = block_tables.data_ptr<int64_t>();
  P.seq = token_seq.data_ptr<int64_t>();
  P.table_stride = block_tables.size(1);
  P.block_size = block_size;
  P.scale = static_cast<float>(scale);
  P.out = out.data();
  P.os0 = H * N * D, P.os1 = N * D, P.os2 = D;
  if (q.scalar_type() == at::kFloat) attend<WKind::F32>(P);
  else attend<WKind::BF16>(P);
  return result(out.data(), q.sizes(), q);
}

}  // namespace llminfer_cpu

// The loops written once over the vector type: included (no include guard) by each per-ISA unit inside its namespace,
// after `using V = V8;` (cpu_avx2.cpp: AVX2 + FMA, 8 floats a register) or `using V = V16;` (cpu_avx512.cpp:
// AVX-512, 16), with LLMINFER_TARGET the target attribute of its loops. Chapter 08, Appendix A1.
//
// ref::dense_rows's contract (cpu_ref.cpp), register-blocked: a block of RW rows of W meets up to kRowsX rows of x
// at once, each weight vector loaded and widened once for all of them and each x vector once for the RW rows, into
// RW·MX accumulators. A decode step of several sequences (or a speculative verification of k + 1 positions) so reads
// its weights once, however many rows it has: the memory-bound lesson of chapters 04, 05 and 09. One row of x takes
// four rows of W in two chains each, the next four rows prefetched at the same pace (`ahead`: the hardware
// prefetcher alone ramps up too slowly on rows a few KB long).

constexpr int kRowsX = 4;                              // rows of x a block
constexpr int kRowsW = V::kLanes == 16 ? 4 : 2;        // rows of W a block against several rows of x

// How a loop reads a step of kStep inputs: P vectors of weights (load_w) and of each row of x (load_x), multiplied
// into an accumulator by madd; `tail` is one input's product past the last whole step. Widen: float32, bfloat16 or
// int8 rows as stored, widened to float32 in registers.
template <WKind kind>
struct Widen {
  using X = float;
  using XV = typename V::Vec;
  using WV = typename V::Vec;
  static constexpr int P = 2;
  static constexpr int64_t kStep = 2 * V::kLanes, kBytes = wbytes<kind>();
  LLMINFER_TARGET static void load_w(const void* w, int64_t i, WV (&out)[P]) {
    for (int p = 0; p < P; ++p) out[p] = V::template wload<kind>(w, i + p * V::kLanes);
  }
  LLMINFER_TARGET static void load_x(const float* x, int64_t k, XV (&out)[P]) {
    for (int p = 0; p < P; ++p) out[p] = V::load(x + k + p * V::kLanes);
  }
  LLMINFER_TARGET static typename V::Vec madd(typename V::Vec acc, WV w, XV x) { return V::fmadd(w, x, acc); }
  static float tail(const float* x, const void* w, int64_t row, int64_t j) { return x[j] * weight_at<kind>(w, row + j); }
};

// y[m·N + n + r] for rows n .. n + RW - 1 of W and MX rows of x (rows K apart): per group of inputs (an int8 weight
// with a scale a group; else one group of K) the block's dot products, each in CH chains (P with one row of x, one
// with several: the rows of x are the independent chains then), a grouped weight's scaled into `total` by one FMA
template <class L, int RW, int MX, bool kGrouped>
LLMINFER_TARGET void dot_block(const typename L::X* x, const Weight& W, int64_t n, float* y, int64_t N,
                               const char* ahead) {
  using Vec = typename V::Vec;
  constexpr int CH = MX == 1 ? L::P : 1;
  const int64_t K = W.K, width = kGrouped ? W.group : K, G = K / width;
  Vec total[RW][MX];
  float out[RW][MX];
  for (int r = 0; r < RW; ++r)
    for (int m = 0; m < MX; ++m) total[r][m] = V::zero(), out[r][m] = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    Vec acc[RW][MX][CH];
    for (int r = 0; r < RW; ++r)
      for (int m = 0; m < MX; ++m)
        for (int c = 0; c < CH; ++c) acc[r][m][c] = V::zero();
    int64_t k = g * width;
    const int64_t end = k + width;
    for (; k + L::kStep <= end; k += L::kStep) {
      if (ahead)
        for (int64_t line = 0; line < L::kStep * L::kBytes * RW; line += 64)
          _mm_prefetch(ahead + k * L::kBytes * RW + line, _MM_HINT_T0);
      typename L::XV xv[MX][L::P];
      for (int m = 0; m < MX; ++m) L::load_x(x + m * K, k, xv[m]);
      for (int r = 0; r < RW; ++r) {
        typename L::WV wv[L::P];
        L::load_w(W.w, (n + r) * K + k, wv);
        for (int m = 0; m < MX; ++m)
          for (int p = 0; p < L::P; ++p) acc[r][m][p % CH] = L::madd(acc[r][m][p % CH], wv[p], xv[m][p]);
      }
    }
    for (int r = 0; r < RW; ++r)
      for (int m = 0; m < MX; ++m) {
        Vec sum = acc[r][m][0];
        for (int c = 1; c < CH; ++c) sum = V::add(sum, acc[r][m][c]);
        float rest = 0.f;
        for (int64_t j = k; j < end; ++j) rest += L::tail(x + m * K, W.w, (n + r) * K, j);
        if constexpr (kGrouped) {
          const float s = W.scale[(n + r) * G + g];
          total[r][m] = V::fmadd(sum, V::set1(s), total[r][m]);
          out[r][m] += rest * s;
        } else {
          out[r][m] += V::hsum(sum) + rest;
        }
      }
  }
  // an int8 weight with one scale a row has it applied here
  const float* row_scale = !kGrouped && W.format == Weight::I8 ? W.scale : nullptr;
  for (int r = 0; r < RW; ++r)
    for (int m = 0; m < MX; ++m) {
      const float s = kGrouped ? out[r][m] + V::hsum(total[r][m]) : out[r][m];
      y[m * N + n + r] = row_scale ? s * row_scale[n + r] : s;
    }
}

// rows n .. n + RW - 1 of W against all M rows of x, kRowsX at a time (the weights stay in L1 after the first)
template <class L, int RW, bool kGrouped>
LLMINFER_TARGET void block_rows(const typename L::X* x, int64_t M, const Weight& W, int64_t n, float* y,
                                const char* ahead) {
  const int64_t K = W.K, N = W.N;
  for (int64_t m = 0; m < M; m += kRowsX) {
    const typename L::X* xm = x + m * K;
    float* ym = y + m * N;
    const char* a = m == 0 ? ahead : nullptr;
    switch (std::min<int64_t>(kRowsX, M - m)) {
      case 1: dot_block<L, RW, 1, kGrouped>(xm, W, n, ym, N, a); break;
      case 2: dot_block<L, RW, 2, kGrouped>(xm, W, n, ym, N, a); break;
      case 3: dot_block<L, RW, 3, kGrouped>(xm, W, n, ym, N, a); break;
      default: dot_block<L, RW, kRowsX, kGrouped>(xm, W, n, ym, N, a);
    }
  }
}

// rows [n0, n1) of y (M, N) by loader L: blocks of RW rows of W (four for one row of x), the last rows alone
template <class L, bool kGrouped = false>
LLMINFER_TARGET void rows_by(const typename L::X* x, int64_t M, const Weight& W, float* y, int64_t n0, int64_t n1) {
  const bool one = M == 1;
  const int64_t RWn = one ? 4 : kRowsW;
  const int64_t row_bytes = W.K * L::kBytes;
  for (int64_t n = n0; n < n1;) {
    if (n + RWn > n1) {
      block_rows<L, 1, kGrouped>(x, M, W, n, y, nullptr);
      ++n;
      continue;
    }
    const char* ahead = n + 2 * RWn <= n1 ? static_cast<const char*>(W.w) + (n + RWn) * row_bytes : nullptr;
    if (one) block_rows<L, 4, kGrouped>(x, M, W, n, y, ahead);
    else block_rows<L, kRowsW, kGrouped>(x, M, W, n, y, ahead);
    n += RWn;
  }
}

// ref::dense_rows by these loops: float32, bfloat16 and int8 rows widened in registers
#ifndef LLMINFER_ROWS_ONLY
void dense_rows(const Weight& W, const float* x, int64_t M, float* y, int64_t n0, int64_t n1) {
  if (W.format == Weight::F32) return rows_by<Widen<WKind::F32>>(x, M, W, y, n0, n1);
  if (W.format == Weight::BF16) return rows_by<Widen<WKind::BF16>>(x, M, W, y, n0, n1);
  if (W.group != W.K) return rows_by<Widen<WKind::I8>, true>(x, M, W, y, n0, n1);
  rows_by<Widen<WKind::I8>>(x, M, W, y, n0, n1);
}

// Decode attention's loops (cpu_attention.cpp's attend_tasks): G query heads that share a K/V head (up to four,
// AVX-512; one, AVX2) against each K and V row, loaded and widened once for all of them. Keys j..j+3 are next: their
// rows' lines of V (read after the softmax), and those of K 16 keys on, go into the cache ahead of use (a layer's
// cache was last read a whole step of weights ago, so it comes from memory).
template <WKind kind>
inline void prefetch_kv(const char* k, int64_t kstride, const char* v, int64_t vstride, int64_t j, int64_t n,
                        int64_t D) {
  for (int64_t i = j; i < j + 4; ++i)
    for (int64_t line = 0; line < D * wbytes<kind>(); line += 64) {
      if (i + 16 < n) _mm_prefetch(k + (i + 16) * kstride + line, _MM_HINT_T0);
      _mm_prefetch(v + i * vstride + line, _MM_HINT_T0);
    }
}

// the scores of G heads, four keys at a time; D a multiple of kLanes
template <WKind kind, int G>
LLMINFER_TARGET void scores_of(const float* const* q, const char* k, int64_t stride, int64_t n, int64_t D, float scale,
                               float* scores, int64_t ss, const char* v, int64_t vstride) {
  using Vec = typename V::Vec;
  const __m128 scale4 = _mm_set1_ps(scale);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    prefetch_kv<kind>(k, stride, v, vstride, j, n, D);
    Vec a[G][4];
    for (int g = 0; g < G; ++g) a[g][0] = a[g][1] = a[g][2] = a[g][3] = V::zero();
    const char* r = k + j * stride;
    for (int64_t d = 0; d < D; d += V::kLanes) {
      const Vec k0 = V::template wload<kind>(r, d), k1 = V::template wload<kind>(r + stride, d),
                k2 = V::template wload<kind>(r + 2 * stride, d), k3 = V::template wload<kind>(r + 3 * stride, d);
      for (int g = 0; g < G; ++g) {
        const Vec qv = V::load(q[g] + d);
        a[g][0] = V::fmadd(k0, qv, a[g][0]);
        a[g][1] = V::fmadd(k1, qv, a[g][1]);
        a[g][2] = V::fmadd(k2, qv, a[g][2]);
        a[g][3] = V::fmadd(k3, qv, a[g][3]);
      }
    }
    for (int g = 0; g < G; ++g)
      _mm_storeu_ps(scores + g * ss + j, _mm_mul_ps(hsum4(a[g][0], a[g][1], a[g][2], a[g][3]), scale4));
  }
  for (; j < n; ++j)
    for (int g = 0; g < G; ++g) {
      Vec a = V::zero();
      for (int64_t d = 0; d < D; d += V::kLanes)
        a = V::fmadd(V::template wload<kind>(k + j * stride, d), V::load(q[g] + d), a);
      scores[g * ss + j] = V::hsum(a) * scale;
    }
}

// the weighted sums of G heads, kLanes·S columns of every head in registers at a time; D a multiple of kLanes·S. One
// head skips the keys it gives no weight (masked, or far below the largest score).
template <WKind kind, int G, int S>
LLMINFER_TARGET void values_of(const float* p, int64_t ps, const char* v, int64_t stride, int64_t n, int64_t D,
                               float* acc) {
  using Vec = typename V::Vec;
  for (int64_t d0 = 0; d0 < D; d0 += V::kLanes * S) {
    Vec a[G][S];
    for (int g = 0; g < G; ++g)
      for (int s = 0; s < S; ++s) a[g][s] = V::load(acc + g * D + d0 + V::kLanes * s);
    for (int64_t j = 0; j < n; ++j) {
      if (G == 1 && p[j] == 0.f) continue;
      Vec row[S];
      for (int s = 0; s < S; ++s) row[s] = V::template wload<kind>(v + j * stride, d0 + V::kLanes * s);
      for (int g = 0; g < G; ++g) {
        const Vec pj = V::set1(p[g * ps + j]);
        for (int s = 0; s < S; ++s) a[g][s] = V::fmadd(row[s], pj, a[g][s]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int s = 0; s < S; ++s) V::store(acc + g * D + d0 + V::kLanes * s, a[g][s]);
  }
}

template <WKind kind>
void group_scores(int64_t G, const float* const* q, const char* k, int64_t stride, int64_t n, int64_t D, float scale,
                  float* scores, int64_t ss, const char* v, int64_t vstride) {
  switch (G) {
    case 1: return scores_of<kind, 1>(q, k, stride, n, D, scale, scores, ss, v, vstride);
    case 2: return scores_of<kind, 2>(q, k, stride, n, D, scale, scores, ss, v, vstride);
    case 3: return scores_of<kind, 3>(q, k, stride, n, D, scale, scores, ss, v, vstride);
    default: return scores_of<kind, 4>(q, k, stride, n, D, scale, scores, ss, v, vstride);
  }
}

template <WKind kind, int G>
void values_by_width(const float* p, int64_t ps, const char* v, int64_t stride, int64_t n, int64_t D, float* acc) {
  if (D % (4 * V::kLanes) == 0) return values_of<kind, G, 4>(p, ps, v, stride, n, D, acc);
  if (D % (2 * V::kLanes) == 0) return values_of<kind, G, 2>(p, ps, v, stride, n, D, acc);
  values_of<kind, G, 1>(p, ps, v, stride, n, D, acc);
}

template <WKind kind>
void group_values(int64_t G, const float* p, int64_t ps, const char* v, int64_t stride, int64_t n, int64_t D,
                  float* acc) {
  switch (G) {
    case 1: return values_by_width<kind, 1>(p, ps, v, stride, n, D, acc);
    case 2: return values_by_width<kind, 2>(p, ps, v, stride, n, D, acc);
    case 3: return values_by_width<kind, 3>(p, ps, v, stride, n, D, acc);
    default: return values_by_width<kind, 4>(p, ps, v, stride, n, D, acc);
  }
}

template void group_scores<WKind::F32>(int64_t, const float* const*, const char*, int64_t, int64_t, int64_t, float,
                                       float*, int64_t, const char*, int64_t);
template void group_scores<WKind::BF16>(int64_t, const float* const*, const char*, int64_t, int64_t, int64_t, float,
                                        float*, int64_t, const char*, int64_t);
template void group_values<WKind::F32>(int64_t, const float*, int64_t, const char*, int64_t, int64_t, int64_t, float*);
template void group_values<WKind::BF16>(int64_t, const float*, int64_t, const char*, int64_t, int64_t, int64_t, float*);

#endif

// The portable reference of each product loop: plain C++ that any CPU runs (the compiler vectorises what it can), and
// what the per-instruction-set loops in cpu_matvec.cpp and cpu_gemm.cpp compute, faster. Appendix A1 reads these.
//
// y (M, N) = x (M, K) · Wᵀ, float32 x and y, for rows [n0, n1) of W (tiles [t0, t1) of 8 rows for int4):
//   dense_rows       float32, bfloat16 or int8 rows as stored (int8: a scale a row or a group of inputs)
//   int4_tiles       int4 codes in tiles of 8 rows, w = q·scale + offset per group of inputs
//   int4_tiles_a8    the same with x rounded to int8 per block of 32 inputs (W4A8), integer dot products
//   quantize_x_blocks  that rounding

#include "cpu_kernels.h"

namespace llminfer_cpu::ref {

namespace {
// each group's dot product in 8 partial sums, added in a fixed order (what the 8-lane loops do)
template <WKind kind>
void rows_of(const float* x, int64_t M, int64_t K, const void* w, const float* scale, int64_t group, float* y,
             int64_t N, int64_t n0, int64_t n1) {
  const int64_t G = scale ? K / group : 1, width = scale ? group : K;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float total = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t k = g * width;
        const int64_t end = (g + 1) * width;
        for (; k + 8 <= end; k += 8)
          for (int j = 0; j < 8; ++j) acc[j] += xm[k + j] * weight_at<kind>(w, n * K + k + j);
        float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        for (; k < end; ++k) sum += xm[k] * weight_at<kind>(w, n * K + k);
        total += scale ? sum * scale[n * G + g] : sum;
      }
      y[m * N + n] = total;
    }
}

// code of row n, input k in the tiled layout: tile n / 8, chunk k / 8 holds the tile's 8 rows' 4 bytes side by side
inline int tiled_code(const uint8_t* w, int64_t K, int64_t n, int64_t k) {
  const uint8_t byte = w[((n / 8) * (K / 8) + k / 8) * 32 + (n % 8) * 4 + (k % 8) / 2];
  return k % 2 ? byte >> 4 : byte & 0xF;
}
}  // namespace

void dense_rows(const Weight& W, const float* x, int64_t M, float* y, int64_t n0, int64_t n1) {
  if (W.format == Weight::F32) rows_of<WKind::F32>(x, M, W.K, W.w, nullptr, W.K, y, W.N, n0, n1);
  else if (W.format == Weight::BF16) rows_of<WKind::BF16>(x, M, W.K, W.w, nullptr, W.K, y, W.N, n0, n1);
  else rows_of<WKind::I8>(x, M, W.K, W.w, W.scale, W.group, y, W.N, n0, n1);
}

// For a group, sum_k w_k x_k = scale · sum_k q_k x_k + offset · sum_k x_k: the group sums of x (xsum, (M, G)) are
// taken once for all rows.
void int4_tiles(const Weight& W, const float* x, const float* xsum, int64_t M, float* y, int64_t t0, int64_t t1) {
  const int64_t K = W.K, group = W.group, G = K / group;
  const uint8_t* w = static_cast<const uint8_t*>(W.w);
  for (int64_t n = t0 * 8; n < t1 * 8; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float total = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        float sum = 0.f;
        for (int64_t k = g * group; k < (g + 1) * group; ++k)
          sum += static_cast<float>(tiled_code(w, K, n, k)) * x[m * K + k];
        const int64_t at = ((n / 8) * G + g) * 8 + n % 8;
        total += sum * term_at(W.terms.scale, W.terms.half, at) +
                 term_at(W.terms.offset, W.terms.half, at) * xsum[m * G + g];
      }
      y[m * W.N + n] = total;
    }
}

// W4A8: per group, scale · sum_blocks dx · (sum_k q_k xq_k) + offset · sum_k x_k, the code term in integers. xq
// holds each chunk of 8 inputs as its 4 even, then its 4 odd (the order the vector loops read).
void int4_tiles_a8(const int8_t* xq, const float* dx, const float* xsum, int64_t M, int64_t K, const uint8_t* w,
                   Terms terms, int64_t group, float* y, int64_t N, int64_t t0, int64_t t1) {
  const int64_t G = K / group, B = K / 32;
  for (int64_t n = t0 * 8; n < t1 * 8; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float total = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        float acc = 0.f;
        for (int64_t b = g * group; b < (g + 1) * group; b += 32) {
          int32_t dot = 0;
          for (int64_t k = b; k < b + 32; ++k) {
            const int64_t c = k / 8 * 8, i = k % 8;
            dot += tiled_code(w, K, n, k) * xq[m * K + c + (i % 2) * 4 + i / 2];
          }
          acc += static_cast<float>(dot) * dx[m * B + b / 32];
        }
        const int64_t at = ((n / 8) * G + g) * 8 + n % 8;
        total += acc * term_at(terms.scale, terms.half, at) + term_at(terms.offset, terms.half, at) * xsum[m * G + g];
      }
      y[m * N + n] = total;
    }
}

// x rounded to int8 per block of 32 for W4A8: dx[b] = max |x| / 127 of block b, and its 32 codes lrint(x / dx) in the
// order the tile loops read them (each chunk of 8 as its 4 even, then its 4 odd inputs). lrint rounds half to even,
// as vcvtps2dq does, so the vector version gives the same bytes.
void quantize_x_blocks(const float* x, int64_t n_blocks, int8_t* xq, float* dx) {
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float step = amax / 127.f, inverse = step > 0.f ? 1.f / step : 0.f;
    dx[b] = step;
    for (int j = 0; j < 32; ++j)
      xq[b * 32 + j / 8 * 8 + (j % 2) * 4 + (j % 8) / 2] = static_cast<int8_t>(std::lrint(xb[j] * inverse));
  }
}

}  // namespace llminfer_cpu::ref

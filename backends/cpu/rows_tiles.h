// The rows kernel's tiles (backends/cpu/rows_linear.cpp explains them): shared by rows_linear.cpp and
// decode_layer.cpp, each of which builds its own library from it (namespace rows inside an anonymous one: the
// libraries share no symbol).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <optional>
#include <utility>
#include <vector>

namespace {
namespace rows {

constexpr int NT = 3;                  // dot tiles: weight rows a tile
constexpr int64_t LINE = 16;           // floats per 64-byte cache line
constexpr int64_t GRAIN = 1 << 16;     // weight floats per parallel task at least: a smaller call stays on one thread

#if defined(__AVX512F__)
constexpr int RB = 8;
constexpr int64_t LANES = 16;
constexpr int64_t LANE_ROWS_FROM = 12;  // lane tiles from this many rows (the crossover: rows_linear.cpp)
using Vec = __m512;
using Mask = __mmask16;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Mask tail_mask(int64_t rem) { return static_cast<Mask>((1u << rem) - 1); }
inline Vec load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec madd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float sum(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int RB = 4;
constexpr int64_t LANES = 8;
using Vec = __m256;
using Mask = __m256i;
alignas(32) constexpr int32_t MASKS[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
inline Vec zero() { return _mm256_setzero_ps(); }
inline Mask tail_mask(int64_t rem) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(MASKS + 8 - rem)); }
inline Vec load(const float* p, Mask m) { return _mm256_maskload_ps(p, m); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec madd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float sum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
#error "rows_linear.cpp needs AVX-512F, or AVX2 and FMA (-mavx2 -mfma)"
#endif

struct Out {  // where a tile's outputs go: out[m * ldo + n] for m < rows, plus bias[n] if given
  float* out;
  int64_t ldo;
  int64_t rows;
  const float* bias;
};

// ------------------------------------------------------------------------------------------------------ dot tiles
template <int N, int R, bool Tail>
inline void step(const float* __restrict x, int64_t K, const float* __restrict w, int64_t k, Mask m,
                 Vec (&acc)[R][N]) {
  // the full chunks take plain loads (which the compiler may fold into the FMA), only the last one masked loads
  Vec wv[N];
#pragma GCC unroll 3
  for (int n = 0; n < N; ++n) wv[n] = Tail ? load(w + n * K + k, m) : load(w + n * K + k);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const Vec xv = Tail ? load(x + r * K + k, m) : load(x + r * K + k);
#pragma GCC unroll 3
    for (int n = 0; n < N; ++n) acc[r][n] = madd(xv, wv[n], acc[r][n]);
  }
}

template <int N, int R>
void dot_tile(const float* __restrict x, int64_t K, const float* __restrict w, const float* __restrict next,
              int64_t next_lines, const float* __restrict bias, float* __restrict out, int64_t ldo) {
  Vec acc[R][N];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int n = 0; n < N; ++n) acc[r][n] = zero();
  const int64_t full = K / LANES;
  // the next tile's lines, spread evenly over this pass: one prefetch every `every` chunks
  const int64_t every = next_lines > 0 ? std::max<int64_t>(1, full / next_lines) : full + 1;
  int64_t prefetched = 0;
  for (int64_t c = 0, due = every; c < full; ++c) {
    if (c + 1 == due && prefetched < next_lines) {
      _mm_prefetch(reinterpret_cast<const char*>(next + prefetched * LINE), _MM_HINT_T1);
      ++prefetched;
      due += every;
    }
    step<N, R, false>(x, K, w, c * LANES, Mask{}, acc);  // no mask: full chunks
  }
  for (; prefetched < next_lines; ++prefetched)
    _mm_prefetch(reinterpret_cast<const char*>(next + prefetched * LINE), _MM_HINT_T1);
  if (K % LANES) step<N, R, true>(x, K, w, full * LANES, tail_mask(K % LANES), acc);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 3
    for (int n = 0; n < N; ++n) out[r * ldo + n] = sum(acc[r][n]) + (bias ? bias[n] : 0.0f);
  }
}

using DotFn = void (*)(const float*, int64_t, const float*, const float*, int64_t, const float*, float*, int64_t);

template <int N, int... Rs>
constexpr std::array<DotFn, sizeof...(Rs) + 1> rows_table(std::integer_sequence<int, Rs...>) {
  return {nullptr, &dot_tile<N, Rs + 1>...};
}
template <int N>
DotFn for_rows(int r) {
  static constexpr auto table = rows_table<N>(std::make_integer_sequence<int, RB>{});
  return table[r];
}

DotFn dot_fn(int n, int r) {
  switch (n) {
    case 1: return for_rows<1>(r);
    case 2: return for_rows<2>(r);
    default: return for_rows<3>(r);
  }
}

// One dot tile: columns n0 .. n0 + n - 1 (n <= NT) of every row, row block by row block.
void dot_columns(const float* x, int64_t M, int64_t K, const float* w, int n, const float* next, int64_t next_lines,
                 const Out& o) {
  // the next tile, prefetched while this one computes, spread over all row blocks (prefetches never fault, so
  // running past the weight's end is harmless; the next weight's first tiles are left to the hardware)
  const int64_t blocks = (M + RB - 1) / RB;
  for (int64_t m0 = 0; m0 < M; m0 += RB) {
    const int r = static_cast<int>(std::min<int64_t>(RB, M - m0));
    const int64_t part = next_lines / blocks, skip = (m0 / RB) * part;
    const int64_t lines = m0 + RB >= M ? next_lines - skip : part;
    dot_fn(n, r)(x + m0 * K, K, w, next + skip * LINE, lines, o.bias, o.out + m0 * o.ldo, o.ldo);
  }
}

// ----------------------------------------------------------------------------------------------------- lane tiles
#if defined(__AVX512F__)
constexpr int VMAX = 4;  // input-row vectors a lane tile keeps (64 rows: ROWS_MAX of backends/cpu/kernels.py)
constexpr int LANE_NT[VMAX + 1] = {0, 16, 8, 8, 6};
constexpr int64_t LANE_PREFETCH = 64;  // floats: 4 lines ahead of the weight rows' reads

inline Vec first(const float* p, int64_t n) { return load(p, tail_mask(n)); }
inline void store_first(float* p, Vec v, int64_t n) { _mm512_mask_storeu_ps(p, tail_mask(n), v); }
inline __m512d pd(Vec a) { return _mm512_castps_pd(a); }
inline Vec lo_pd(Vec a, Vec b) { return _mm512_castpd_ps(_mm512_unpacklo_pd(pd(a), pd(b))); }
inline Vec hi_pd(Vec a, Vec b) { return _mm512_castpd_ps(_mm512_unpackhi_pd(pd(a), pd(b))); }

// r[i][j] -> r[j][i] for a 16 x 16 block: pairs of floats, then of doubles, then 128-bit lanes twice
inline void transpose(Vec (&r)[LANES]) {
  Vec t[LANES];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + c], 128-bit lane j: rows 4i .. 4i+3 of column 4j + c
    r[4 * i] = lo_pd(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = hi_pd(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = lo_pd(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = hi_pd(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4j + c takes lane j of r[c], r[4 + c], r[8 + c], r[12 + c]
    const Vec a = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), b = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
    const Vec e = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88), f = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
    t[c] = _mm512_shuffle_f32x4(a, e, 0x88);
    t[4 + c] = _mm512_shuffle_f32x4(b, f, 0x88);
    t[8 + c] = _mm512_shuffle_f32x4(a, e, 0xdd);
    t[12 + c] = _mm512_shuffle_f32x4(b, f, 0xdd);
  }
  for (int i = 0; i < LANES; ++i) r[i] = t[i];
}

// xT[k * stride + i] = x[i * ldx + k] for k < K and i < 16 (rows i >= rows zero): a block of up to 16 rows into
// 16 consecutive columns of a transposed input, whole 64-byte vectors per k (so threads writing different blocks of
// a row-major xT share no cache line when stride is a multiple of 16 and xT is 64-byte aligned)
void transpose_block(const float* __restrict x, int64_t ldx, int64_t rows, int64_t K, float* __restrict xT,
                     int64_t stride) {
  for (int64_t k0 = 0; k0 < K; k0 += LANES) {
    const int64_t kn = std::min<int64_t>(LANES, K - k0);
    Vec r[LANES];
    for (int i = 0; i < LANES; ++i) r[i] = i < rows ? first(x + i * ldx + k0, kn) : zero();
    transpose(r);
    for (int j = 0; j < kn; ++j) _mm512_storeu_ps(xT + (k0 + j) * stride, r[j]);
  }
}

// xT[k][m] = x[m][k] for k < K, m < stride (rows past M zero): (K, stride), stride a multiple of 16
void transpose_input(const float* __restrict x, int64_t M, int64_t K, float* __restrict xT, int64_t stride) {
  for (int64_t m0 = 0; m0 < stride; m0 += LANES)
    transpose_block(x + std::min(m0, M) * K, K, std::max<int64_t>(0, M - m0), K, xT + m0, stride);
}

// One lane tile: columns n0 .. n0 + nvalid - 1 of the V x 16 rows in xT. Weight rows past nvalid read the last
// valid one (their sums are dropped).
template <int TN, int V>
void lane_tile(const float* __restrict xT, int64_t stride, int64_t K, const float* __restrict w, int nvalid,
               const Out& o) {
  Vec acc[TN][V];
  const float* wr[TN];
  for (int n = 0; n < TN; ++n) {
    wr[n] = w + std::min(n, nvalid - 1) * K;
    for (int v = 0; v < V; ++v) acc[n][v] = zero();
  }
  constexpr int64_t KU = 8;  // k unrolled (16 was slower: docs/performance.md)
  int64_t k = 0;
  for (; k + KU <= K; k += KU) {
    if (k % LANES == 0)  // each weight row's line LANE_PREFETCH floats ahead into L1, once a line (see rows_linear.cpp)
      for (int n = 0; n < TN; ++n) _mm_prefetch(reinterpret_cast<const char*>(wr[n] + k + LANE_PREFETCH), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int64_t kk = k; kk < k + KU; ++kk) {
      Vec xv[V];
      for (int v = 0; v < V; ++v) xv[v] = load(xT + kk * stride + v * LANES);
#pragma GCC unroll 16
      for (int n = 0; n < TN; ++n) {
        const Vec b = _mm512_set1_ps(wr[n][kk]);
        for (int v = 0; v < V; ++v) acc[n][v] = madd(b, xv[v], acc[n][v]);
      }
    }
  }
  for (; k < K; ++k)
    for (int n = 0; n < TN; ++n)
      for (int v = 0; v < V; ++v)
        acc[n][v] = madd(_mm512_set1_ps(wr[n][k]), load(xT + k * stride + v * LANES), acc[n][v]);
  if constexpr (V == 1 && TN == LANES) {  // a square block: transposed in registers, stored a row of outputs at a time
    Vec r[LANES];
    for (int n = 0; n < LANES; ++n) r[n] = acc[n][0];
    transpose(r);
    const Vec bias = o.bias ? first(o.bias, nvalid) : zero();
    for (int64_t m = 0; m < std::min<int64_t>(LANES, o.rows); ++m)
      store_first(o.out + m * o.ldo, _mm512_add_ps(r[m], bias), nvalid);
  } else {
    alignas(64) float sums[TN][V * LANES];
    for (int n = 0; n < TN; ++n)
      for (int v = 0; v < V; ++v) _mm512_store_ps(&sums[n][v * LANES], acc[n][v]);
    for (int64_t m = 0; m < std::min<int64_t>(V * LANES, o.rows); ++m)
      for (int n = 0; n < nvalid; ++n) o.out[m * o.ldo + n] = sums[n][m] + (o.bias ? o.bias[n] : 0.0f);
  }
}

using LaneFn = void (*)(const float*, int64_t, int64_t, const float*, int, const Out&);
constexpr LaneFn LANE_TILES[VMAX + 1] = {nullptr, &lane_tile<LANE_NT[1], 1>, &lane_tile<LANE_NT[2], 2>,
                                         &lane_tile<LANE_NT[3], 3>, &lane_tile<LANE_NT[4], 4>};
#endif


// ------------------------------------------------------------------------------------------------ a stacked linear
// How M input rows of width K go through the tiles: lane tiles (AVX-512, lane_rows_from (< 0: LANE_ROWS_FROM) to
// VMAX x 16 rows; the input transposed into (K, stride), rows past M zero) or dot tiles (row-major input).
struct Plan {
  bool lanes = false;
  int nt = NT;  // weight rows a tile
  int64_t stride = 0;
};

inline Plan plan_for(int64_t M, int64_t K, int64_t lane_rows_from) {
  Plan p;
#if defined(__AVX512F__)
  p.lanes = M >= (lane_rows_from < 0 ? LANE_ROWS_FROM : lane_rows_from) && M > 0 && M <= VMAX * LANES && K > 0;
  if (p.lanes) {
    p.stride = (M + LANES - 1) / LANES * LANES;
    p.nt = LANE_NT[p.stride / LANES];
  }
#endif
  return p;
}

// Weights stacked along out features (each (N_i, K), row-major, contiguous: the caller checks), cut into tiles of
// nt rows; the stack's tile t is rows n0 .. n0 + n - 1 of one weight, output columns first_col[i] + n0 ...
struct Stack {
  std::vector<const float*> w;
  std::vector<int64_t> first_tile{0}, first_col{0};  // per weight: its first tile and output column
  int64_t K = 0;
  int nt = NT;

  Stack(at::TensorList weights, int64_t k, int tile_rows) : K(k), nt(tile_rows) {
    for (const at::Tensor& t : weights) {
      w.push_back(t.data_ptr<float>());
      first_tile.push_back(first_tile.back() + (t.size(0) + nt - 1) / nt);
      first_col.push_back(first_col.back() + t.size(0));
    }
  }
  int64_t N() const { return first_col.back(); }
  int64_t tiles() const { return first_tile.back(); }
  size_t weight_of(int64_t t) const {
    return std::upper_bound(first_tile.begin(), first_tile.end(), t) - first_tile.begin() - 1;
  }

  // Tile t (of weight i, the caller's cursor, moved forward as t grows) on x (M, K) row-major or xT (K, stride):
  // out[m * ldo + c] = x[m] . W[c] + bias[c] for its columns c. Returns its first column; *n its number of columns.
  int64_t run(int64_t t, size_t& i, const Plan& p, const float* x, const float* xT, int64_t M, float* out, int64_t ldo,
              const float* bias, int* n) const {
    while (t >= first_tile[i + 1]) ++i;
    const int64_t n0 = (t - first_tile[i]) * nt, rows_w = first_col[i + 1] - first_col[i], c0 = first_col[i] + n0;
    *n = static_cast<int>(std::min<int64_t>(nt, rows_w - n0));
    const float* wp = w[i] + n0 * K;
    const Out dest{out + c0, ldo, M, bias ? bias + c0 : nullptr};
#if defined(__AVX512F__)
    if (p.lanes) {
      LANE_TILES[p.stride / LANES](xT, p.stride, K, wp, *n, dest);
      return c0;
    }
#endif
    dot_columns(x, M, K, wp, *n, wp + NT * K, *n * K / LINE, dest);
    return c0;
  }
};

}  // namespace rows
}  // namespace

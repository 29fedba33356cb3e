// Decode-step linears for x86 CPUs with AVX-512 or AVX2 + FMA, on the weights as they are: y = x [W_1; W_2; ...]^T + b
// for a few rows x, each weight row-major (out_features, in_features) and read once, with no packed copy.
//
// Registered as torch ops (torch.ops.portrl_cpu_rows_<isa>.*, <isa> = PORTRL_ISA: avx512 or avx2, so both variants
// can be loaded in one process); built per variant by backends/cpu/native_build.py (AVX-512: -march=native on a
// CPU with it; AVX2: -mavx2 -mfma, which any AVX2 + FMA CPU runs) and chosen by backends/cpu/isa.py.
//
// Tiling: the output columns are cut into tiles of NT = 3 weight rows (3 contiguous streams of K floats). For
// each tile and each block of up to RB input rows, RB x NT accumulators take acc[r][n] += x[r][k:k+L] * W[n][k:k+L]
// for k = 0, L, ..., K (the last chunk masked), then each is summed across its L lanes. AVX-512: L = 16 lanes,
// RB = 8 (24 of the 32 zmm registers accumulate); AVX2: L = 8, RB = 4 (12 of the 16 ymm registers accumulate, 3
// hold the weights, the input is an FMA memory operand). Per chunk: NT weight loads, RB input loads, RB x NT FMAs,
// so the FMA units, not the loads, set the pace. The first row block reads the tile from memory; the next blocks
// find it in L1/L2 (3 x K floats: 10.5 KiB at K = 896, 57 KiB at K = 4864). The next tile is prefetched into L2
// while the current one computes, so that the memory stream does not wait on the compute of the later row blocks.
// Tiles are split across torch's intra-op threads. Each output is one dot product summed by L lanes then across
// them: equal to F.linear up to float32 summation order.
//
// Against the packed-panel kernel it replaced (a copy of every weight in a k-major panel layout, made once per
// generate call): Qwen2.5-0.5B's decode linears at 16 rows on 2 Zen 4 threads read at 16.7 GB/s against its
// 17.5 (the compute peak at 16 rows is ~18), with no 1.84 GB copy and no 0.7 s of packing per call.
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


constexpr int NT = 3;
constexpr int64_t LINE = 16;  // floats per 64-byte cache line

#if defined(__AVX512F__)
constexpr int RB = 8;
constexpr int64_t LANES = 16;
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
void tile(const float* __restrict x, int64_t K, const float* __restrict w, const float* __restrict next,
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

using TileFn = void (*)(const float*, int64_t, const float*, const float*, int64_t, const float*, float*, int64_t);

template <int N, int... Rs>
constexpr std::array<TileFn, sizeof...(Rs) + 1> rows_table(std::integer_sequence<int, Rs...>) {
  return {nullptr, &tile<N, Rs + 1>...};
}
template <int N>
TileFn for_rows(int r) {
  static constexpr auto table = rows_table<N>(std::make_integer_sequence<int, RB>{});
  return table[r];
}

TileFn tile_fn(int n, int r) {
  switch (n) {
    case 1: return for_rows<1>(r);
    case 2: return for_rows<2>(r);
    default: return for_rows<3>(r);
  }
}

void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), "rows_linear: ", name,
              " must be a contiguous float32 CPU tensor");
}

// x (M, K) times the weights stacked along out features (each (N_i, K)), plus bias (sum N_i) if given
// -> (M, sum N_i). In this file's anonymous namespace, as everything: the two variants' libraries share no symbol.
at::Tensor rows_linear(const at::Tensor& x, at::TensorList weights, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "rows_linear: x must be 2-D (rows, in_features)");
  TORCH_CHECK(!weights.empty(), "rows_linear: no weights");
  const at::Tensor xc = x.contiguous();
  check_float_cpu(xc, "x");
  const int64_t M = xc.size(0), K = xc.size(1);
  std::vector<int64_t> first_tile{0}, first_col{0};  // per weight: its first global tile and output column
  for (const at::Tensor& w : weights) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K, "rows_linear: every weight must be (out_features, ", K,
                "); got ", w.sizes());
    check_float_cpu(w, "weight");
    first_tile.push_back(first_tile.back() + (w.size(0) + NT - 1) / NT);
    first_col.push_back(first_col.back() + w.size(0));
  }
  const int64_t N = first_col.back(), tiles = first_tile.back();
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_float_cpu(*bias, "bias");
    TORCH_CHECK(bias->numel() == N, "rows_linear: bias must have as many elements as the weights' rows (", N, ")");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return out;
  const float* xp = xc.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    size_t i = std::upper_bound(first_tile.begin(), first_tile.end(), t0) - first_tile.begin() - 1;
    for (int64_t t = t0; t < t1; ++t) {
      while (t >= first_tile[i + 1]) ++i;
      const at::Tensor& w = weights[i];
      const int64_t n0 = (t - first_tile[i]) * NT, rows_w = w.size(0);
      const int n = static_cast<int>(std::min<int64_t>(NT, rows_w - n0));
      const float* wp = w.data_ptr<float>() + n0 * K;
      // the next tile in this weight, prefetched while this one computes (prefetches never fault, so
      // running past the weight's end is harmless; the next weight's first tiles are left to the hardware)
      const float* next = wp + NT * K;
      const int64_t next_lines = n * K / LINE;
      const int64_t blocks = (M + RB - 1) / RB;
      for (int64_t m0 = 0; m0 < M; m0 += RB) {
        const int r = static_cast<int>(std::min<int64_t>(RB, M - m0));
        // the prefetch of the next tile is spread over all row blocks
        const int64_t part = next_lines / blocks, skip = (m0 / RB) * part;
        const int64_t lines = m0 + RB >= M ? next_lines - skip : part;
        tile_fn(n, r)(xp + m0 * K, K, wp, next + skip * LINE, lines, b ? b + first_col[i] + n0 : nullptr,
                      o + m0 * N + first_col[i] + n0, N);
      }
    }
  });
  return out;
}

}  // namespace

// The namespace portrl_cpu_rows_<PORTRL_ISA>: the macros below expand PORTRL_ISA before TORCH_LIBRARY pastes
// it. Built with no PORTRL_ISA (native_build.load(name): this CPU's flags, no variant), it is portrl_cpu_rows.
#define PORTRL_CAT_(a, b) a##_##b
#define PORTRL_CAT(a, b) PORTRL_CAT_(a, b)
#define PORTRL_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define PORTRL_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)
#ifdef PORTRL_ISA
#define PORTRL_NS PORTRL_CAT(portrl_cpu_rows, PORTRL_ISA)
#else
#define PORTRL_NS portrl_cpu_rows
#endif

PORTRL_LIBRARY(PORTRL_NS, m) {
  m.def("rows_linear(Tensor x, Tensor[] weights, Tensor? bias) -> Tensor");
}

PORTRL_LIBRARY_IMPL(PORTRL_NS, CPU, m) {
  m.impl("rows_linear", &rows_linear);
}

// Decode-step linears for x86 CPUs with AVX-512: y = x W^T + b for a few rows x, the weight streamed once.
//
// Registered as torch ops (torch.ops.portrl_cpu.*); built and loaded by backends/cpu/native_build.py and
// used by backends/cpu/kernels.py (linear_prepacked "stream").
//
// Packed layout: W (N, K) becomes panels of 16 output columns, each stored k-major: packed[p][k][j] =
// W[16p + j][k] (rows past N are zero). One panel row (16 floats) is one 64-byte cache line and one zmm
// register, so a panel is read front to back exactly once per 16 input rows, as one sequential stream.
//
// Kernel: for each panel and each block of up to 16 input rows, 16 accumulators (one per row) take
// acc[r] += broadcast(x[r][k]) * panel[k] for k = 0..K-1, then the bias is added and the 16 columns are
// stored (masked for the last panel). Per k: one weight load, R broadcast loads, R FMAs. The next weight
// lines are prefetched PREFETCH_LINES ahead. Panels are split across torch's intra-op threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <utility>

namespace {

constexpr int64_t PANEL = 16;
constexpr int64_t PREFETCH_LINES = 256;  // 16 KiB ahead of the weight stream
constexpr int MAX_ROWS = 16;

template <int R>
void panel_rows(const float* __restrict x, int64_t K, const float* __restrict w, const float* __restrict bias,
                float* __restrict out, int64_t N, int64_t n0) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 wk = _mm512_loadu_ps(w + k * PANEL);
    _mm_prefetch(reinterpret_cast<const char*>(w + (k + PREFETCH_LINES) * PANEL), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), wk, acc[r]);
  }
  const int64_t left = N - n0;
  const __mmask16 mask = left >= PANEL ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * N + n0, mask, _mm512_add_ps(acc[r], b));
}

using PanelFn = void (*)(const float*, int64_t, const float*, const float*, float*, int64_t, int64_t);

template <int... Rs>
constexpr std::array<PanelFn, sizeof...(Rs) + 1> make_table(std::integer_sequence<int, Rs...>) {
  return {nullptr, &panel_rows<Rs + 1>...};
}
constexpr auto kPanelFns = make_table(std::make_integer_sequence<int, MAX_ROWS>{});

void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), "stream_linear: ", name,
              " must be a contiguous float32 CPU tensor");
}

}  // namespace

// W (N, K) -> packed (ceil(N/16), K, 16).
at::Tensor stream_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "stream_pack: weight must be 2-D (out_features, in_features)");
  const at::Tensor w = weight.contiguous();
  check_float_cpu(w, "weight");
  const int64_t N = w.size(0), K = w.size(1), P = (N + PANEL - 1) / PANEL;
  at::Tensor packed = at::empty({P, K, PANEL}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* panel = dst + p * K * PANEL;
      const int64_t rows = std::min(PANEL, N - p * PANEL);
      if (rows < PANEL) std::memset(panel, 0, sizeof(float) * K * PANEL);
      for (int64_t k0 = 0; k0 < K; k0 += 64) {  // 64 k at a time: the panel's 4 KiB being written stay in L1
        const int64_t k1 = std::min(K, k0 + 64);
        for (int64_t j = 0; j < rows; ++j) {
          const float* row = src + (p * PANEL + j) * K;
          for (int64_t k = k0; k < k1; ++k) panel[k * PANEL + j] = row[k];
        }
      }
    }
  });
  return packed;
}

// x (M, K) times the packed W (of N output features), plus bias (N) if given -> (M, N).
at::Tensor stream_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == PANEL && x.size(1) == packed.size(1),
              "stream_linear: x (M, K) and packed (P, K, 16) do not match");
  TORCH_CHECK(out_features > 0 && (out_features + PANEL - 1) / PANEL == packed.size(0),
              "stream_linear: out_features does not match the packed weight");
  const at::Tensor xc = x.contiguous();
  check_float_cpu(xc, "x");
  check_float_cpu(packed, "packed");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_float_cpu(*bias, "bias");
    TORCH_CHECK(bias->numel() == out_features, "stream_linear: bias must have out_features elements");
    b = bias->data_ptr<float>();
  }
  const int64_t M = xc.size(0), K = xc.size(1), N = out_features, P = packed.size(0);
  at::Tensor out = at::empty({M, N}, xc.options());
  if (M == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int64_t rows = std::min<int64_t>(MAX_ROWS, M - m0);
        kPanelFns[rows](xp + m0 * K, K, w + p * K * PANEL, b, o + m0 * N, N, p * PANEL);
      }
  });
  return out;
}

TORCH_LIBRARY(portrl_cpu, m) {
  m.def("stream_pack(Tensor weight) -> Tensor");
  m.def("stream_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(portrl_cpu, CPU, m) {
  m.impl("stream_pack", &stream_pack);
  m.impl("stream_linear", &stream_linear);
}

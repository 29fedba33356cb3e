// Decode-step linears for x86 CPUs with AVX-512 or AVX2 + FMA, on the weights as they are: y = x [W_1; W_2; ...]^T + b
// for a few rows x, each weight row-major (out_features, in_features) and read once, with no packed copy.
//
// Registered as torch ops (torch.ops.portrl_cpu_rows_<isa>.*, <isa> = PORTRL_ISA: avx512 or avx2, so both variants
// can be loaded in one process); built per variant by backends/cpu/native_build.py (AVX-512: -march=native on a
// CPU with it; AVX2: -mavx2 -mfma, which any AVX2 + FMA CPU runs) and chosen by backends/cpu/isa.py.
//
// Two tilings, chosen by the number of input rows M; each output is y[m][n] summed in float32 (F.linear up to the
// summation order).
//
// Dot tiles (fewer than LANE_ROWS_FROM rows; every AVX2 call): the output columns are cut into tiles of NT = 3 weight
// rows (3 contiguous streams of K floats). For each tile and each block of up to RB input rows, RB x NT accumulators
// take acc[r][n] += x[r][k:k+L] * W[n][k:k+L] for k = 0, L, ..., K (the last chunk masked), then each is summed
// across its L lanes. AVX-512: L = 16 lanes, RB = 8 (24 of the 32 zmm registers accumulate); AVX2: L = 8, RB = 4.
// The next tile is prefetched into L2 while the current one computes. Few rows waste no lane here.
//
// Lane tiles (AVX-512, LANE_ROWS_FROM to 64 rows): the input rows go across the lanes. x is first transposed into
// xT (K, V x 16), V = ceil(M / 16) vectors a k, rows past M zero; a tile of NT weight rows keeps NT x V accumulators,
// acc[n][v] += W[n][k] (one float, broadcast: the FMA's memory operand) * xT[k][v] for k = 0 .. K-1, so each
// accumulator holds 16 rows' outputs of one column: no sum across lanes, and per k V vector loads for NT x V FMAs.
// NT = 16 / 8 / 8 / 6 for V = 1..4; a whole 16 x 16 tile is transposed in registers and stored a row at a time. Each
// weight row's line 64 floats (4 lines) ahead is prefetched into L1, once a line (LANE_PREFETCH): the NT rows are NT
// short streams (K floats each) that the hardware prefetchers pick up late (docs/performance.md, "Measurements
// behind code comments", has the figures for this and for each choice below).
//
// Lane tiles take less time than dot tiles from about 12 rows on (LANE_ROWS_FROM); below that, the lanes compute
// rows that are not there. An AVX2 build of lane tiles (8 lanes, explicit broadcasts) was slower than its dot
// tiles, so AVX2 keeps the dot tiles. Tiles are split across torch's intra-op threads in contiguous runs. The dot
// tiles replaced a packed-panel kernel that needed a copy of every weight and packing per generate call.
#include "op_namespace.h"
#include "rows_tiles.h"

namespace {

using namespace rows;

// ---------------------------------------------------------------------------------------------------------- the op
void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), "rows_linear: ", name,
              " must be a contiguous float32 CPU tensor");
}

// x (M, K) times the weights stacked along out features (each (N_i, K)), plus bias (sum N_i) if given
// -> (M, sum N_i). lane_rows_from: lane tiles from this many rows (< 0: LANE_ROWS_FROM; ignored on AVX2, which has
// none), so a benchmark can time both tilings. In this file's anonymous namespace, as everything: the two variants'
// libraries share no symbol.
at::Tensor rows_linear(const at::Tensor& x, at::TensorList weights, const std::optional<at::Tensor>& bias,
                       int64_t lane_rows_from) {
  TORCH_CHECK(x.dim() == 2, "rows_linear: x must be 2-D (rows, in_features)");
  TORCH_CHECK(!weights.empty(), "rows_linear: no weights");
  const at::Tensor xc = x.contiguous();
  check_float_cpu(xc, "x");
  const int64_t M = xc.size(0), K = xc.size(1);
  const Plan plan = plan_for(M, K, lane_rows_from);
  for (const at::Tensor& w : weights) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K, "rows_linear: every weight must be (out_features, ", K,
                "); got ", w.sizes());
    check_float_cpu(w, "weight");
  }
  const Stack stack(weights, K, plan.nt);
  const int64_t N = stack.N(), tiles = stack.tiles();
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_float_cpu(*bias, "bias");
    TORCH_CHECK(bias->numel() == N, "rows_linear: bias must have as many elements as the weights' rows (", N, ")");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return out;
  at::Tensor xT;  // lane tiles: x transposed, (K, stride)
#if defined(__AVX512F__)
  if (plan.lanes) {
    xT = at::empty({K, plan.stride}, xc.options());
    transpose_input(xc.data_ptr<float>(), M, K, xT.data_ptr<float>(), plan.stride);
  }
#endif
  const float* xp = xc.data_ptr<float>();
  const float* xtp = plan.lanes ? xT.data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, GRAIN / (plan.nt * std::max<int64_t>(K, 1)));  // tiles a thread at least
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    size_t i = stack.weight_of(t0);
    int n = 0;
    for (int64_t t = t0; t < t1; ++t) stack.run(t, i, plan, xp, xtp, M, o, N, b, &n);
  });
  return out;
}

}  // namespace

// The namespace portrl_cpu_rows_<PORTRL_ISA> (op_namespace.h).
#define PORTRL_NS PORTRL_OPS_NS(portrl_cpu_rows)

PORTRL_LIBRARY(PORTRL_NS, m) {
  m.def("rows_linear(Tensor x, Tensor[] weights, Tensor? bias, int lane_rows_from=-1) -> Tensor");
}

PORTRL_LIBRARY_IMPL(PORTRL_NS, CPU, m) {
  m.impl("rows_linear", &rows_linear);
}

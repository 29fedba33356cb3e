// SwiGLU on the CPU in one pass each way: out = silu(g) * u, and its gradients, for float32 rows.
//
// Registered as torch ops (torch.ops.portrl_cpu_swiglu_<isa>.*, <isa> = PORTRL_ISA: avx512 or avx2, whose
// at::vec::Vectorized<float> is 16 or 8 lanes: CPU_CAPABILITY_AVX512 / _AVX2); built per variant by
// backends/cpu/native_build.py, chosen by backends/cpu/isa.py, used by backends/cpu/swiglu.py (op swiglu,
// implementation "fused"). torch computes silu(g) * u as two ops (two outputs written) and its backward as three
// (silu_backward and two products): five passes over tensors of tokens x intermediate size where one forward and
// one backward pass suffice.
//
//   s = sigmoid(g) = 1 / (1 + exp(-g))
//   out = g * s * u
//   d out / d g = u * s * (1 + g * (1 - s)),   d out / d u = g * s
//
// Inputs are 2-D (rows, width) with unit stride along the width and any row stride (the halves of a fused
// gate/up projection are views); outputs are contiguous. exp is torch's own vectorised one
// (at::vec::Vectorized<float>::exp, Sleef, 1 ulp), so values match torch's silu to float32 rounding.
#include <ATen/Parallel.h>
#include "op_namespace.h"
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t GRAIN = 1 << 15;  // elements per parallel task at least

void check_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t width) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "swiglu: ", name, " must be float32 on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == width, "swiglu: ", name, " must be (", rows, ", ",
              width, ")");
  TORCH_CHECK(width <= 1 || t.stride(1) == 1, "swiglu: ", name, " must have unit stride along its width");
}

template <typename Fn>
void for_rows(int64_t rows, int64_t width, const Fn& fn) {
  const int64_t grain = std::max<int64_t>(1, GRAIN / std::max<int64_t>(1, width));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) fn(r);
  });
}

at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2, "swiglu: gate must be 2-D (rows, width)");
  const int64_t rows = gate.size(0), width = gate.size(1);
  check_rows(gate, "gate", rows, width);
  check_rows(up, "up", rows, width);
  at::Tensor out = at::empty({rows, width}, gate.options());
  const float* g0 = gate.data_ptr<float>();
  const float* u0 = up.data_ptr<float>();
  float* o0 = out.data_ptr<float>();
  const int64_t gs = gate.stride(0), us = up.stride(0);
  const Vec one(1.f);
  for_rows(rows, width, [&](int64_t r) {
    const float* g = g0 + r * gs;
    const float* u = u0 + r * us;
    float* o = o0 + r * width;
    int64_t i = 0;
    for (; i + Vec::size() <= width; i += Vec::size()) {
      const Vec gv = Vec::loadu(g + i);
      const Vec s = one / (one + gv.neg().exp());
      (gv * s * Vec::loadu(u + i)).store(o + i);
    }
    for (; i < width; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_out, const at::Tensor& gate,
                                                    const at::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2, "swiglu: gate must be 2-D (rows, width)");
  const int64_t rows = gate.size(0), width = gate.size(1);
  check_rows(gate, "gate", rows, width);
  check_rows(up, "up", rows, width);
  check_rows(grad_out, "grad_out", rows, width);
  at::Tensor dgate = at::empty({rows, width}, gate.options());
  at::Tensor dup = at::empty({rows, width}, gate.options());
  const float* g0 = gate.data_ptr<float>();
  const float* u0 = up.data_ptr<float>();
  const float* d0 = grad_out.data_ptr<float>();
  float* dg0 = dgate.data_ptr<float>();
  float* du0 = dup.data_ptr<float>();
  const int64_t gs = gate.stride(0), us = up.stride(0), ds = grad_out.stride(0);
  const Vec one(1.f);
  for_rows(rows, width, [&](int64_t r) {
    const float* g = g0 + r * gs;
    const float* u = u0 + r * us;
    const float* d = d0 + r * ds;
    float* dg = dg0 + r * width;
    float* du = du0 + r * width;
    int64_t i = 0;
    for (; i + Vec::size() <= width; i += Vec::size()) {
      const Vec gv = Vec::loadu(g + i), dv = Vec::loadu(d + i);
      const Vec s = one / (one + gv.neg().exp());
      (dv * Vec::loadu(u + i) * s * (one + gv * (one - s))).store(dg + i);
      (dv * gv * s).store(du + i);
    }
    for (; i < width; ++i) {
      const float s = 1.f / (1.f + std::exp(-g[i]));
      dg[i] = d[i] * u[i] * s * (1.f + g[i] * (1.f - s));
      du[i] = d[i] * g[i] * s;
    }
  });
  return {dgate, dup};
}

}  // namespace (everything: the two variants' libraries share no symbol)

// The namespace portrl_cpu_swiglu_<PORTRL_ISA> (op_namespace.h).
#define PORTRL_NS PORTRL_OPS_NS(portrl_cpu_swiglu)

PORTRL_LIBRARY(PORTRL_NS, m) {
  m.def("forward(Tensor gate, Tensor up) -> Tensor");
  m.def("backward(Tensor grad_out, Tensor gate, Tensor up) -> (Tensor, Tensor)");
}

PORTRL_LIBRARY_IMPL(PORTRL_NS, CPU, m) {
  m.impl("forward", &swiglu_forward);
  m.impl("backward", &swiglu_backward);
}

// RMSNorm on the CPU in one pass each way, for float32 rows:
//
//   r = 1 / sqrt(mean(x^2) + eps)           (one per row, kept for the backward: rstd)
//   y = w * (x * r)
//   dx = r * (g w - (x r) * mean(g w x r)),   dw = sum over rows of g * (x r)
//
// Registered as torch ops (torch.ops.portrl_cpu_rms_norm_<isa>.*, <isa> = PORTRL_ISA: avx512 or avx2, whose
// at::vec::Vectorized<float> is 16 or 8 lanes); built per variant by backends/cpu/native_build.py, chosen by
// backends/cpu/isa.py, used by backends/cpu/rms_norm.py (op rms_norm, implementation "fused"). Written as
// transformers' Qwen2RMSNorm / LlamaRMSNorm (x.pow(2).mean(-1), rsqrt, two products), torch runs five ops forward
// and nine backward, each a pass over tokens x hidden; here the forward reads x once and the backward reads x and
// the gradient once (dw: each thread sums its rows into its own row of partial sums, added up in thread order, so
// the result does not depend on timing).
//
// x and grad_out are 2-D (rows, width) with unit stride along the width and any row stride; outputs are contiguous.
// The values equal the op-by-op formula up to float32 summation order (the sum of squares, the row dot product).
#include <ATen/Parallel.h>
#include "op_namespace.h"
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t GRAIN = 1 << 15;  // elements per parallel task at least

void check_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t width) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "rms_norm: ", name, " must be float32 on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == width, "rms_norm: ", name, " must be (", rows, ", ",
              width, ")");
  TORCH_CHECK(width <= 1 || t.stride(1) == 1, "rms_norm: ", name, " must have unit stride along its width");
}

void check_vector(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == n &&
                  t.is_contiguous(),
              "rms_norm: ", name, " must be a contiguous float32 CPU vector of ", n);
}

// sum over i < n of a[i] * b[i] * c[i] (c may be null: a[i] * b[i])
float dot(const float* a, const float* b, const float* c, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec ab = Vec::loadu(a + i) * Vec::loadu(b + i);
    acc = c ? at::vec::fmadd(ab, Vec::loadu(c + i), acc) : at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  }
  float s = at::vec::vec_reduce_all<float>([](const Vec& u, const Vec& v) { return u + v; }, acc);
  for (; i < n; ++i) s += c ? a[i] * b[i] * c[i] : a[i] * b[i];
  return s;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2, "rms_norm: x must be 2-D (rows, width)");
  const int64_t rows = x.size(0), width = x.size(1);
  check_rows(x, "x", rows, width);
  check_vector(weight, "weight", width);
  at::Tensor y = at::empty({rows, width}, x.options());
  at::Tensor rstd = at::empty({rows}, x.options());
  const float* x0 = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* y0 = y.data_ptr<float>();
  float* r0 = rstd.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const int64_t grain = std::max<int64_t>(1, GRAIN / std::max<int64_t>(1, width));
  at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* xr = x0 + r * xs;
      float* yr = y0 + r * width;
      const float ms = dot(xr, xr, nullptr, width) / static_cast<float>(width);  // mean(x^2)
      const float rs = 1.f / std::sqrt(ms + static_cast<float>(eps));
      r0[r] = rs;
      const Vec rv(rs);
      int64_t i = 0;
      for (; i + Vec::size() <= width; i += Vec::size()) (Vec::loadu(w + i) * (Vec::loadu(xr + i) * rv)).store(yr + i);
      for (; i < width; ++i) yr[i] = w[i] * (xr[i] * rs);
    }
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                                     const at::Tensor& weight, const at::Tensor& rstd) {
  TORCH_CHECK(x.dim() == 2, "rms_norm: x must be 2-D (rows, width)");
  const int64_t rows = x.size(0), width = x.size(1);
  check_rows(x, "x", rows, width);
  check_rows(grad_out, "grad_out", rows, width);
  check_vector(weight, "weight", width);
  check_vector(rstd, "rstd", rows);
  at::Tensor dx = at::empty({rows, width}, x.options());
  const int64_t threads = at::get_num_threads();
  at::Tensor partial = at::zeros({threads, width}, x.options());  // each thread's sum of g * (x r) over its rows
  const float* x0 = x.data_ptr<float>();
  const float* g0 = grad_out.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* r0 = rstd.data_ptr<float>();
  float* dx0 = dx.data_ptr<float>();
  float* p0 = partial.data_ptr<float>();
  const int64_t xs = x.stride(0), gs = grad_out.stride(0);
  const int64_t grain = std::max<int64_t>(1, GRAIN / std::max<int64_t>(1, width));
  at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    float* dw = p0 + at::get_thread_num() * width;
    for (int64_t r = b; r < e; ++r) {
      const float* xr = x0 + r * xs;
      const float* gr = g0 + r * gs;
      float* dxr = dx0 + r * width;
      const float rs = r0[r];
      const float c = dot(gr, w, xr, width) * rs / static_cast<float>(width);  // mean(g w x r)
      const Vec rv(rs), cv(c);
      int64_t i = 0;
      for (; i + Vec::size() <= width; i += Vec::size()) {
        const Vec xhat = Vec::loadu(xr + i) * rv, gv = Vec::loadu(gr + i);
        (rv * (gv * Vec::loadu(w + i) - xhat * cv)).store(dxr + i);
        at::vec::fmadd(gv, xhat, Vec::loadu(dw + i)).store(dw + i);
      }
      for (; i < width; ++i) {
        const float xhat = xr[i] * rs;
        dxr[i] = rs * (gr[i] * w[i] - xhat * c);
        dw[i] += gr[i] * xhat;
      }
    }
  });
  return {dx, partial.sum(0)};
}

}  // namespace (everything: the two variants' libraries share no symbol)

// The namespace portrl_cpu_rms_norm_<PORTRL_ISA> (op_namespace.h).
#define PORTRL_NS PORTRL_OPS_NS(portrl_cpu_rms_norm)

PORTRL_LIBRARY(PORTRL_NS, m) {
  m.def("forward(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("backward(Tensor grad_out, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)");
}

PORTRL_LIBRARY_IMPL(PORTRL_NS, CPU, m) {
  m.impl("forward", &rms_norm_forward);
  m.impl("backward", &rms_norm_backward);
}

// Rotary position embedding ("half" layout) on the CPU in one pass each way, for float32 (rows, heads, dim) tensors.
//
// Registered as torch ops (torch.ops.portrl_cpu_rotary_<isa>.*, <isa> = PORTRL_ISA: avx512 or avx2); built per
// variant by backends/cpu/native_build.py, chosen by backends/cpu/isa.py, used by backends/cpu/rotary.py (op rotary,
// implementation "fused"). torch computes x * cos + rotate_half(x) * sin as five ops (two products, a negation, a
// concatenation, a sum) and its backward as about eight; the update's replay (portrl/models/forward_tape.py) runs it
// on q and k of every layer. With x = [x1, x2] (the halves of the last dim), c = [c1, c2], s = [s1, s2]:
//
//   out1 = x1 c1 - x2 s1,     out2 = x2 c2 + x1 s2
//   dx1 = dy1 c1 + dy2 s2,    dx2 = dy2 c2 - dy1 s1
//
// both of the form  o1 = a1 c1 + a2 p1,  o2 = a2 c2 + a1 p2  with (p1, p2) = (-s1, s2) forward, (s2, -s1) backward.
// x: (rows, heads, dim) with unit stride along dim (any row and head strides: the q and k columns of a fused
// projection are views); cos, sin: (rows, dim) with unit stride along dim, one row per row of x, shared by its heads.
// The output is contiguous.
#include <ATen/Parallel.h>
#include "op_namespace.h"
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t GRAIN = 1 << 15;  // elements per parallel task at least

void check(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3,
              "rotary: x must be a float32 (rows, heads, dim) CPU tensor");
  const int64_t rows = x.size(0), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0, "rotary: dim must be even, got ", dim);
  TORCH_CHECK(dim <= 1 || x.stride(2) == 1, "rotary: x must have unit stride along dim");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == rows &&
                    t->size(1) == dim && (dim <= 1 || t->stride(1) == 1),
                "rotary: cos and sin must be float32 (", rows, ", ", dim, ") CPU tensors with unit stride along dim");
  }
}

// out = [a1 c1 + a2 p1, a2 c2 + a1 p2] over every (row, head); forward: p1 = -s1, p2 = s2; else p1 = s2, p2 = -s1
at::Tensor rotate(const at::Tensor& a, const at::Tensor& cos, const at::Tensor& sin, bool forward) {
  check(a, cos, sin);
  const int64_t rows = a.size(0), heads = a.size(1), dim = a.size(2), half = dim / 2;
  at::Tensor out = at::empty({rows, heads, dim}, a.options());
  const float* a0 = a.data_ptr<float>();
  const float* c0 = cos.data_ptr<float>();
  const float* s0 = sin.data_ptr<float>();
  float* o0 = out.data_ptr<float>();
  const int64_t as = a.stride(0), ah = a.stride(1), cs = cos.stride(0), ss = sin.stride(0);
  const int64_t grain = std::max<int64_t>(1, GRAIN / std::max<int64_t>(1, heads * dim));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* c = c0 + r * cs;
      const float* s = s0 + r * ss;
      // p1 and p2 per element: forward (-s1, s2), backward (s2, -s1)
      const float* p1 = forward ? s : s + half;
      const float* p2 = forward ? s + half : s;
      const float sign1 = forward ? -1.f : 1.f, sign2 = -sign1;
      const Vec vs1(sign1), vs2(sign2);
      for (int64_t h = 0; h < heads; ++h) {
        const float* x1 = a0 + r * as + h * ah;
        const float* x2 = x1 + half;
        float* o1 = o0 + (r * heads + h) * dim;
        float* o2 = o1 + half;
        int64_t i = 0;
        for (; i + Vec::size() <= half; i += Vec::size()) {
          const Vec a1 = Vec::loadu(x1 + i), a2 = Vec::loadu(x2 + i);
          (a1 * Vec::loadu(c + i) + a2 * (Vec::loadu(p1 + i) * vs1)).store(o1 + i);
          (a2 * Vec::loadu(c + half + i) + a1 * (Vec::loadu(p2 + i) * vs2)).store(o2 + i);
        }
        for (; i < half; ++i) {
          o1[i] = x1[i] * c[i] + x2[i] * (p1[i] * sign1);
          o2[i] = x2[i] * c[half + i] + x1[i] * (p2[i] * sign2);
        }
      }
    }
  });
  return out;
}

at::Tensor rotary_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rotate(x, cos, sin, true);
}

at::Tensor rotary_backward(const at::Tensor& grad_out, const at::Tensor& cos, const at::Tensor& sin) {
  return rotate(grad_out, cos, sin, false);
}

}  // namespace (everything: the two variants' libraries share no symbol)

// The namespace portrl_cpu_rotary_<PORTRL_ISA> (op_namespace.h).
#define PORTRL_NS PORTRL_OPS_NS(portrl_cpu_rotary)

PORTRL_LIBRARY(PORTRL_NS, m) {
  m.def("forward(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("backward(Tensor grad_out, Tensor cos, Tensor sin) -> Tensor");
}

PORTRL_LIBRARY_IMPL(PORTRL_NS, CPU, m) {
  m.impl("forward", &rotary_forward);
  m.impl("backward", &rotary_backward);
}

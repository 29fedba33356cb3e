// Attention of one new token per row against its KV cache, for float32 on the CPU: the decode step's attention.
//
// Registered as torch ops (torch.ops.portrl_cpu_decode_attention_<isa>.forward, <isa> = PORTRL_ISA: avx512 or
// avx2); built per variant by backends/cpu/native_build.py, chosen by backends/cpu/isa.py, used by
// backends/cpu/decode_attention.py (op decode_attention, implementation "fused").
//
//   q (B, H, 1, D), k / v (B, KV, L, D), hidden (B, L) bool: the keys a row may not see. Query head h reads KV
//   head g = h / (H / KV) (grouped-query attention, the KV heads not repeated).
//   s[b, h, l] = scale * q[b, h] . k[b, g, l]            (-inf where hidden[b, l])
//   out[b, h]  = sum_l softmax_l(s[b, h]) * v[b, g, l]
//
// One task per (row, KV head): the group's keys and values are read from memory once and stay in L1 / L2 for its
// H / KV query heads, where torch's batched matmul, mask, softmax and matmul make four dispatches (at one query per
// head, mostly set-up) and small GEMMs. Keys may be stored one row of D per key, or transposed, one row of L per
// head dimension (unit stride along L: the decoder's CPU cache, backends/cpu/decode_kernel.py): then the scores of
// Vec::size() keys accumulate in one vector with no horizontal sums, which is what makes this kernel fast. Values
// are one row of D per key; the weighted sum holds the output row in registers. A row whose keys are all hidden
// gives NaN, as torch's softmax does. The output is allocated (B, 1, H, D) and returned as its (B, H, 1, D)
// transpose, so the caller's transpose(1, 2).reshape(B, 1, H * D) is a view. exp is torch's vectorised one
// (Sleef), so values match torch's to float32 summation order.
#include "op_namespace.h"
#include "attention_heads.h"

namespace {

using namespace attn;

void check(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "decode_attention: ", name,
              " must be float32 on the CPU");
  TORCH_CHECK(t.dim() == dims, "decode_attention: ", name, " must be ", dims, "-D");
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, "decode_attention: ", name, " must have unit stride along D");
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& hidden,
                            double scale) {
  check(q, "q", 4);
  check(v, "v", 4);
  TORCH_CHECK(k.device().is_cpu() && k.scalar_type() == at::kFloat && k.dim() == 4,
              "decode_attention: k must be 4-D float32 on the CPU");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), KV = k.size(1), L = k.size(2);
  TORCH_CHECK(q.size(2) == 1, "decode_attention: q must hold one query per row (B, H, 1, D)");
  TORCH_CHECK(KV > 0 && H % KV == 0, "decode_attention: the query heads (", H, ") must be a multiple of the KV heads (",
              KV, ")");
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && v.sizes() == k.sizes(), "decode_attention: k and v must be (", B,
              ", KV, L, ", D, ")");
  // keys one row of D each (unit stride along D), or the transposed storage (unit stride along L)
  const bool by_dim = D > 1 && k.stride(3) != 1 && (L <= 1 || k.stride(2) == 1);
  TORCH_CHECK(by_dim || D <= 1 || k.stride(3) == 1, "decode_attention: k must have unit stride along D or along L");
  TORCH_CHECK(hidden.scalar_type() == at::kBool && hidden.dim() == 2 && hidden.size(0) == B && hidden.size(1) == L &&
                  (L <= 1 || hidden.stride(1) == 1),
              "decode_attention: hidden must be (", B, ", ", L, ") bool with unit stride along L");
  at::Tensor out = at::empty({B, 1, H, D}, q.options());
  const int64_t rep = H / KV;
  const float sc = static_cast<float>(scale);
  const float* q0 = q.data_ptr<float>();
  const float* k0 = k.data_ptr<float>();
  const float* v0 = v.data_ptr<float>();
  const bool* hid0 = hidden.data_ptr<bool>();
  float* o0 = out.data_ptr<float>();
  // strides as plain integers: Tensor::stride() is a call, too slow for the inner loops
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t kstep = by_dim ? k.stride(3) : k.stride(2);  // between head dimensions, or between keys
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2), hs0 = hidden.stride(0);
  // a task reads 2 L D cache floats; at least GRAIN of them a thread, so a small call stays on one thread
  const int64_t grain = std::max<int64_t>(1, GRAIN / std::max<int64_t>(1, 2 * L * D));
  at::parallel_for(0, B * KV, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(RMAX * L);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / KV, g = t % KV;
      const float* kb = k0 + b * ks0 + g * ks1;
      const float* vb = v0 + b * vs0 + g * vs1;
      const bool* hid = hid0 + b * hs0;
      for (int64_t r0 = 0; r0 < rep; r0 += RMAX) {  // the group's query heads, up to RMAX at a time
        const int R = static_cast<int>(std::min<int64_t>(RMAX, rep - r0));
        const int64_t h = g * rep + r0;
        HEADS[R](q0 + b * qs0 + h * qs1, qs1, kb, kstep, by_dim, vb, vs2, hid, L, D, sc, scores.data(),
                 o0 + (b * H + h) * D, D);
      }
    }
  });
  return out.transpose(1, 2);
}

}  // namespace (everything: the two variants' libraries share no symbol)

// The namespace portrl_cpu_decode_attention_<PORTRL_ISA> (op_namespace.h).
#define PORTRL_NS PORTRL_OPS_NS(portrl_cpu_decode_attention)

PORTRL_LIBRARY(PORTRL_NS, m) {
  m.def("forward(Tensor q, Tensor k, Tensor v, Tensor hidden, float scale) -> Tensor");
}

PORTRL_LIBRARY_IMPL(PORTRL_NS, CPU, m) { m.impl("forward", &decode_attention); }

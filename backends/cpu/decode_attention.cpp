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
// head dimension (unit stride along L: the decoder's CPU cache, portrl/rollout/fast_decode.py): then the scores of
// Vec::size() keys accumulate in one vector with no horizontal sums, which is what makes this kernel fast. Values
// are one row of D per key; the weighted sum holds the output row in registers. A row whose keys are all hidden
// gives NaN, as torch's softmax does. The output is allocated (B, 1, H, D) and returned as its (B, H, 1, D)
// transpose, so the caller's transpose(1, 2).reshape(B, 1, H * D) is a view. exp is torch's vectorised one
// (Sleef), so values match torch's to float32 summation order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

void check(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "decode_attention: ", name,
              " must be float32 on the CPU");
  TORCH_CHECK(t.dim() == dims, "decode_attention: ", name, " must be ", dims, "-D");
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, "decode_attention: ", name, " must have unit stride along D");
}

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float total = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// Query heads go R at a time (R <= RMAX, a template parameter so that their accumulators are registers); per
// vector of keys or of the output, BLOCKS vectors are in flight (AVX-512 has 32 vector registers, AVX2 16).
constexpr int RMAX = 8;
constexpr int64_t GRAIN = 1 << 16;  // cache floats per parallel task at least
constexpr int BLOCKS = Vec::size() == 16 ? 2 : 1;
constexpr int64_t W = Vec::size();

// s[r][l] = scale * q[r] . k[l] for keys stored one row of D per key (stride ksl): a dot product each
void scores_by_key(int R, const float* q, int64_t qs, const float* k, int64_t ksl, int64_t L, int64_t D, float scale,
                   float* s) {
  for (int64_t l = 0; l < L; ++l)
    for (int r = 0; r < R; ++r) s[r * L + l] = scale * dot(q + r * qs, k + l * ksl, D);
}

// The same for keys stored transposed, one row of L per head dimension (stride ksd; the decoder's CPU cache):
// BLOCKS x W keys at a time for all R heads, each key vector loaded once, no horizontal sums.
template <int R>
void scores_by_dim(const float* q, int64_t qs, const float* k, int64_t ksd, int64_t L, int64_t D, float scale,
                   float* s) {
  const Vec sc(scale);
  int64_t l = 0;
  for (; l + BLOCKS * W <= L; l += BLOCKS * W) {
    Vec a[R][BLOCKS];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < BLOCKS; ++j) a[r][j] = Vec(0.f);
    for (int64_t d = 0; d < D; ++d) {
      const float* kd = k + d * ksd + l;
      Vec kv[BLOCKS];
      for (int j = 0; j < BLOCKS; ++j) kv[j] = Vec::loadu(kd + j * W);
      for (int r = 0; r < R; ++r) {
        const Vec qd(q[r * qs + d]);
        for (int j = 0; j < BLOCKS; ++j) a[r][j] = at::vec::fmadd(qd, kv[j], a[r][j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < BLOCKS; ++j) (a[r][j] * sc).store(s + r * L + l + j * W);
  }
  for (; l < L; l += W) {  // whole vectors, then the last few keys (a partial load, zeros beyond)
    const int64_t n = std::min<int64_t>(W, L - l);
    Vec a[R];
    for (int r = 0; r < R; ++r) a[r] = Vec(0.f);
    for (int64_t d = 0; d < D; ++d) {
      const Vec kv = n == W ? Vec::loadu(k + d * ksd + l) : Vec::loadu(k + d * ksd + l, n);
      for (int r = 0; r < R; ++r) a[r] = at::vec::fmadd(Vec(q[r * qs + d]), kv, a[r]);
    }
    for (int r = 0; r < R; ++r) (a[r] * sc).store(s + r * L + l, n);
  }
}

// o[r] = inv[r] * sum_l p[r][l] v[l] for R heads (v: one row of D per key, stride vsl; hidden keys have p = 0):
// BLOCKS x W output columns at a time for all R heads, each value vector loaded once.
template <int R>
void weighted_values(const float* p, int64_t L, const float* v, int64_t vsl, int64_t D, const float* inv, float* o,
                     int64_t os) {
  int64_t c0 = 0;
  for (; c0 + BLOCKS * W <= D; c0 += BLOCKS * W) {
    Vec a[R][BLOCKS];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < BLOCKS; ++j) a[r][j] = Vec(0.f);
    for (int64_t l = 0; l < L; ++l) {
      const float* vl = v + l * vsl + c0;
      Vec vv[BLOCKS];
      for (int j = 0; j < BLOCKS; ++j) vv[j] = Vec::loadu(vl + j * W);
      for (int r = 0; r < R; ++r) {
        const Vec pr(p[r * L + l]);
        for (int j = 0; j < BLOCKS; ++j) a[r][j] = at::vec::fmadd(pr, vv[j], a[r][j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < BLOCKS; ++j) (a[r][j] * Vec(inv[r])).store(o + r * os + c0 + j * W);
  }
  for (int r = 0; r < R; ++r)  // columns beyond the last whole block
    for (int64_t c = c0; c < D; ++c) {
      float t = 0.f;
      for (int64_t l = 0; l < L; ++l) t += p[r * L + l] * v[l * vsl + c];
      o[r * os + c] = t * inv[r];
    }
}

// p[i] = exp(s[i] - max s) over n scores; returns 1 / sum p (NaN when every score is -inf, as torch's softmax)
inline float exp_shifted(float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
  const Vec mv(m);
  Vec sum(0.f);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const Vec e = (Vec::loadu(s + i) - mv).exp();
    e.store(s + i);
    sum = sum + e;
  }
  float total = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    total += s[i];
  }
  return 1.f / total;
}

// One group of R query heads of one row and KV head: scores, softmax, weighted values.
template <int R>
void heads(const float* q, int64_t qs, const float* k, int64_t kstep, bool by_dim, const float* v, int64_t vsl,
           const bool* hid, int64_t L, int64_t D, float scale, float* s, float* o, int64_t os) {
  if (by_dim)
    scores_by_dim<R>(q, qs, k, kstep, L, D, scale, s);
  else
    scores_by_key(R, q, qs, k, kstep, L, D, scale, s);
  float inv[R];
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * L;
    for (int64_t l = 0; l < L; ++l)
      if (hid[l]) sr[l] = -std::numeric_limits<float>::infinity();
    inv[r] = exp_shifted(sr, L);
  }
  weighted_values<R>(s, L, v, vsl, D, inv, o, os);
}

using HeadsFn = void (*)(const float*, int64_t, const float*, int64_t, bool, const float*, int64_t, const bool*, int64_t,
                         int64_t, float, float*, float*, int64_t);
constexpr HeadsFn HEADS[RMAX + 1] = {nullptr,  &heads<1>, &heads<2>, &heads<3>, &heads<4>,
                                     &heads<5>, &heads<6>, &heads<7>, &heads<8>};

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

// The namespace portrl_cpu_decode_attention_<PORTRL_ISA> (swiglu.cpp explains the macros).
#define PORTRL_CAT_(a, b) a##_##b
#define PORTRL_CAT(a, b) PORTRL_CAT_(a, b)
#define PORTRL_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define PORTRL_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)
#ifdef PORTRL_ISA
#define PORTRL_NS PORTRL_CAT(portrl_cpu_decode_attention, PORTRL_ISA)
#else
#define PORTRL_NS portrl_cpu_decode_attention
#endif

PORTRL_LIBRARY(PORTRL_NS, m) {
  m.def("forward(Tensor q, Tensor k, Tensor v, Tensor hidden, float scale) -> Tensor");
}

PORTRL_LIBRARY_IMPL(PORTRL_NS, CPU, m) { m.impl("forward", &decode_attention); }

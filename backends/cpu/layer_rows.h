// A decoder layer's row-wise pieces for decode_layer.cpp (whose comment has the formulas): a row's RMS norm, its
// SwiGLU, rope on its heads, and the attention of a row's query heads over its caches; and the per-thread scratch
// buffer they and the layer's phases share. Inside an anonymous namespace: the library shares no symbol.
#pragma once

#include "attention_heads.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using VecF = at::vec::Vectorized<float>;

float* scratch(int64_t n) {  // a per-thread buffer of at least n floats
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// out = x / sqrt(mean(x^2) + eps) * w
void rms_row(const float* x, const float* w, int64_t n, float eps, float* out) {
  VecF acc(0.f);
  int64_t i = 0;
  for (; i + VecF::size() <= n; i += VecF::size()) {
    const VecF v = VecF::loadu(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float ss = at::vec::vec_reduce_all<float>([](VecF& a, VecF& b) { return a + b; }, acc);
  for (; i < n; ++i) ss += x[i] * x[i];
  const VecF r(1.f / std::sqrt(ss / static_cast<float>(n) + eps));
  for (i = 0; i + VecF::size() <= n; i += VecF::size()) (VecF::loadu(x + i) * r * VecF::loadu(w + i)).store(out + i);
  const float rs = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (; i < n; ++i) out[i] = x[i] * rs * w[i];
}

// out = silu(g) * u, the formula of swiglu.cpp
void swiglu_row(const float* g, const float* u, int64_t n, float* out) {
  const VecF one(1.f);
  int64_t i = 0;
  for (; i + VecF::size() <= n; i += VecF::size()) {
    const VecF gv = VecF::loadu(g + i);
    (gv * (one / (one + gv.neg().exp())) * VecF::loadu(u + i)).store(out + i);
  }
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// out[h * os + d * ds] = t[d] cos[d] + t[(d + D/2) mod D] sin[d] for each of `heads` heads of D (t: heads x D)
void rope_heads(const float* t, int64_t heads, int64_t D, const float* cos, const float* sin, float* out, int64_t os,
                int64_t ds = 1) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* th = t + h * D;
    float* oh = out + h * os;
    for (int64_t d = 0; d < D; ++d) oh[d * ds] = th[d] * cos[d] + th[d < half ? d + half : d - half] * sin[d];
  }
}

// The attention of a decode step over its rows' caches: queries after rope (q: rows x H heads of D), the caches
// (keys transposed: k at [row][KV head][d][key], values v at [row][KV head][key][d]), the keys each row hides, and
// where the heads' outputs go (out: like q)
struct Attention {
  int64_t H, KV, D, L, start;
  float *q, *k, *v, *out;
  const bool* hidden;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2, hs0;
  float scale;

  // row m's rope on its query and key heads (r: its q, k and v; c, s: its cos and sin), its new key and value into
  // the cache at slot `start`
  void store(int64_t m, const float* r, const float* c, const float* s) const {
    rope_heads(r, H, D, c, s, q + m * H * D, D);
    rope_heads(r + H * D, KV, D, c, s, k + m * ks0 + start, ks1, ks2);
    for (int64_t g = 0; g < KV; ++g)
      std::copy(r + (H + KV + g) * D, r + (H + KV + g + 1) * D, v + m * vs0 + g * vs1 + start * vs2);
  }

  // the query heads of KV head g for rows m0 .. m0 + n - 1
  void heads(int64_t g, int64_t m0, int64_t n) const {
    const int64_t rep = H / KV;
    float* scores = scratch(attn::RMAX * L);
    for (int64_t m = m0; m < m0 + n; ++m)
      for (int64_t r0 = 0; r0 < rep; r0 += attn::RMAX) {
        const int R = static_cast<int>(std::min<int64_t>(attn::RMAX, rep - r0));
        const int64_t h = g * rep + r0;
        attn::HEADS[R](q + m * H * D + h * D, D, k + m * ks0 + g * ks1, ks2, true, v + m * vs0 + g * vs1, vs2,
                       hidden + m * hs0, L, D, scale, scores, out + m * H * D + h * D, D);
      }
  }
};

}  // namespace

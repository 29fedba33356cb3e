// The decode attention's per-(row, KV head) kernel (backends/cpu/decode_attention.cpp explains it): shared by
// decode_attention.cpp and decode_layer.cpp, each of which builds its own library from it (namespace attn inside
// an anonymous one: the libraries share no symbol).
#pragma once

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
namespace attn {

using Vec = at::vec::Vectorized<float>;

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

}  // namespace attn
}  // namespace

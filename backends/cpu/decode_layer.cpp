// One decoder layer of a one-token decode step, float32 on the CPU, in one call: the
// layer portrl/rollout/fast_decode.py runs op by op, for Llama-family pre-norm layers (Qwen2 / Qwen2.5, Llama,
// Mistral).
//
// Registered as torch ops (torch.ops.portrl_cpu_decode_layer_<isa>.layer, <isa> = PORTRL_ISA: avx512 or avx2);
// built per variant by backends/cpu/native_build.py, chosen by backends/cpu/isa.py, used by
// backends/cpu/decode_layer.py (op decode_layer, implementation "fused").
//
//   h = rms(x, ln1);  qkv = h [Wq; Wk; Wv]^T (+ b);  q, k = rope(q), rope(k);  k, v -> cache slot `start`
//   x += o = attn(q, cache[: start + 1]) Wo^T (+ bo);  gu = rms(x, ln2) [Wg; Wu]^T;  x += down = (silu(g) * u) Wd^T
//   rms(x, w) = x / sqrt(mean(x^2) + eps) * w;  rope(t) = t * cos + [t2, t1] * sin (sin signed: -sin on the first half)
//
// x (M, hidden) is updated in place, so are the layer's caches; qkv, o, gu and down (the outputs a forward recording
// saves, portrl/models/forward_tape.py) are written to the four tensors given last (contiguous: a recording's
// slots). The linears are the rows kernel's tiles (rows_tiles.h: the same tilings and sums as rows_linear), the
// attention the decode attention's (attention_heads.h), keys stored transposed; results equal the op-by-op layer up
// to float32 summation order (norm and rope).
//
// Why one call: op by op a layer is ~10 torch calls and 5 parallel regions, and between regions torch's OpenMP
// threads go to sleep (portrl sets GOMP_SPINCOUNT=1000); waking one costs 50-100 us on a VM. Here the layer's nine
// phases run in one call on the calling thread and spin_pool.h's helpers: each phase's items (rows, tiles, (row, KV
// head) pairs) go to whichever thread claims them next (an atomic counter), and a thread that finds none left waits
// for the phase's last items. A helper that arrives late finds work already taken and the calling thread does
// everything, so no phase waits for a thread to wake and no count of threads is assumed; and the helpers, unlike
// OpenMP's, stay awake from one of a decode step's calls to the next. A layer of fewer than INLINE_FLOATS weight
// floats runs on the calling thread alone. The library also has the step's last norm and head (op `head`), so the
// whole step runs on the same threads.
#include "op_namespace.h"
#include "attention_heads.h"
#include "rows_tiles.h"
#include "layer_rows.h"
#include "spin_pool.h"

#include <atomic>
#include <thread>

namespace {

// a layer with fewer weight floats stays on the calling thread. 2^16 (256 KiB), not 2^19: a small model's 1 MiB
// layers gain from both threads, most of it in the update that follows, since a vCPU left idle through the decode
// is slow to wake on a VM (docs/performance.md)
constexpr int64_t INLINE_FLOATS = 1 << 16;
constexpr int64_t ITEM_FLOATS = 1 << 18;    // weight floats a tile item reads at least: long runs of each weight a
                                            // thread (smaller items were slower: docs/performance.md)
constexpr int64_t SWIGLU_COLS = 512;       // columns a SwiGLU item (a multiple of 16)
constexpr int SPINS = 1 << 12;              // pauses before a waiting thread yields its core

// Items 0 .. total - 1, claimed one at a time by whichever thread asks; run() returns when all are done. The
// calling thread claims from the front, the helpers from the back: with both on time each step, each thread gets
// the same items step after step, so its share of the weights and caches stays in its own core's cache
// (docs/performance.md).
struct Phase {
  // items taken: the calling thread's from the front (low 32 bits), the helpers' from the back (high 32 bits)
  std::atomic<uint64_t> taken{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;

  int64_t claim(bool helper) {
    uint64_t t = taken.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(t & 0xffffffffu), back = static_cast<int64_t>(t >> 32);
      if (front + back >= total) return -1;
      const uint64_t want = helper ? t + (uint64_t{1} << 32) : t + 1;
      if (taken.compare_exchange_weak(t, want, std::memory_order_relaxed)) return helper ? total - 1 - back : front;
    }
  }

  template <typename Fn>
  void run(const Fn& fn) {
    const bool helper = spin_pool::is_helper();
    int64_t mine = 0;
    for (int64_t i; (i = claim(helper)) >= 0; ++mine) fn(i);
    if (mine) done.fetch_add(mine, std::memory_order_acq_rel);
    for (int spins = 0; done.load(std::memory_order_acquire) < total; ++spins) {
      if (spins < SPINS) _mm_pause(); else std::this_thread::yield();
    }
  }
};

// Where a linear's input goes: row-major (dot tiles) or transposed into (K, stride) (lane tiles, rows_tiles.h), and
// the phase items that fill it. Transposed, an item is a block of 16 rows (x cols columns), computed row-major into
// a scratch block and transposed in registers (rows::transpose_block): each thread writes whole cache lines. (Rows
// one at a time put two threads' scalar stores into the same lines of xT: the medium layer's norm and SwiGLU phases
// took 3-4x their one-thread time on two threads.)
struct Input {
  float* x;
  int64_t K;
  const rows::Plan& plan;
  int64_t M;
  int64_t cols;  // columns an item (a multiple of rows::LANES, or K: whole rows)
  int64_t row_items() const { return plan.lanes ? (M + rows::LANES - 1) / rows::LANES : M; }
  int64_t items() const { return row_items() * ((K + cols - 1) / cols); }
  // Item `it`: fn(m, c0, w, out) writes row m's columns c0 .. c0 + w - 1 to out, for each of the item's rows
  template <typename Fn>
  void fill(int64_t it, const Fn& fn) const {
    const int64_t chunks = (K + cols - 1) / cols, b = it / chunks, c0 = it % chunks * cols;
    const int64_t w = std::min(cols, K - c0);
#if defined(__AVX512F__)
    if (plan.lanes) {
      const int64_t m0 = b * rows::LANES, n = std::min<int64_t>(rows::LANES, M - m0);
      float* block = scratch(rows::LANES * w);
      for (int64_t i = 0; i < n; ++i) fn(m0 + i, c0, w, block + i * w);
      rows::transpose_block(block, w, n, w, x + c0 * plan.stride + m0, plan.stride);
      return;
    }
#endif
    fn(b, c0, w, x + b * K + c0);
  }
};

void check(const at::Tensor& t, const char* name, bool contiguous = true) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && (!contiguous || t.is_contiguous()),
              "decode_layer: ", name, " must be a", contiguous ? " contiguous" : "", " float32 CPU tensor");
}

const float* data_or_null(const std::optional<at::Tensor>& t, int64_t n, const char* name) {
  if (!t.has_value() || !t->defined()) return nullptr;
  check(*t, name);
  TORCH_CHECK(t->numel() == n, "decode_layer: ", name, " must have ", n, " elements");
  return t->data_ptr<float>();
}

// A stacked linear's tiles as phase items of about ITEM_FLOATS weight floats or more: y = in W^T (+ bias), then
// x[:, c] += y[:, c] when `residual` (the layer's x)
struct Linear {
  rows::Stack stack;
  const rows::Plan& plan;
  int64_t chunk;
  // items of about ITEM_FLOATS weight floats or more, as many as a multiple of `threads` (equal shares: a 1 MiB
  // weight split into 1 MiB items left one of two threads idle)
  Linear(at::TensorList w, int64_t K, const rows::Plan& p, int64_t threads)
      : stack(checked(w, K), K, p.nt), plan(p), chunk(1) {
    const int64_t floats = stack.tiles() * p.nt * K, share = threads * ITEM_FLOATS;
    const int64_t items = threads * std::max<int64_t>(1, (floats + share - 1) / share);
    chunk = std::max<int64_t>(1, (stack.tiles() + items - 1) / items);
  }
  static at::TensorList checked(at::TensorList w, int64_t K) {
    TORCH_CHECK(!w.empty(), "decode_layer: no weights");
    for (const at::Tensor& t : w) {
      check(t, "every weight");
      TORCH_CHECK(t.dim() == 2 && t.size(1) == K, "decode_layer: a weight must be (out_features, ", K, ")");
    }
    return w;
  }
  int64_t items() const { return (stack.tiles() + chunk - 1) / chunk; }
  void item(int64_t it, const float* in, int64_t M, float* y, const float* bias, float* residual) const {
    const int64_t t0 = it * chunk, t1 = std::min(stack.tiles(), t0 + chunk), N = stack.N();
    size_t i = stack.weight_of(t0);
    int n = 0;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c0 = stack.run(t, i, plan, in, in, M, y, N, bias, &n);
      if (residual)
        for (int64_t m = 0; m < M; ++m)
          for (int j = 0; j < n; ++j) residual[m * N + c0 + j] += y[m * N + c0 + j];
    }
  }
};

// Threads for a call of M rows over these weights: the calling thread alone under INLINE_FLOATS weight floats (or
// no rows), else torch's thread count (the calling thread and the rest as spin_pool helpers)
int64_t threads_for(std::initializer_list<at::TensorList> weights, int64_t M) {
  int64_t floats = 0;
  for (const at::TensorList ws : weights)
    for (const at::Tensor& t : ws) floats += t.numel();
  return floats < INLINE_FLOATS || M == 0 ? 1 : at::get_num_threads();
}

struct Dims {
  int64_t M, Hd, H, KV, D, I, L;  // rows, hidden, heads, KV heads, head dim, intermediate, keys (start + 1)
};

Dims check_arguments(const at::Tensor& x, const at::Tensor& ln1, const at::Tensor& ln2, const at::Tensor& down_w,
                     const at::Tensor& k_store, const at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& hidden, int64_t start, int64_t heads, int64_t kv_heads) {
  for (const auto& [t, name] : {std::pair{&x, "x"}, {&cos, "cos"}, {&sin, "sin"}, {&ln1, "ln1"}, {&ln2, "ln2"}})
    check(*t, name);
  check(k_store, "k_store", false);
  check(v_cache, "v_cache", false);
  TORCH_CHECK(x.dim() == 2, "decode_layer: x must be (rows, hidden)");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "decode_layer: heads must be a multiple of kv_heads");
  TORCH_CHECK(down_w.dim() == 2, "decode_layer: down_w must be (hidden, intermediate)");
  const Dims d{x.size(0), x.size(1), heads, kv_heads, k_store.dim() == 4 ? k_store.size(2) : 0, down_w.size(1),
               start + 1};
  TORCH_CHECK(start >= 0 && k_store.dim() == 4 && k_store.size(0) == d.M && k_store.size(1) == d.KV &&
                  k_store.stride(3) == 1 && k_store.size(3) >= d.L,
              "decode_layer: k_store must be (rows, kv_heads, head_dim, >= start + 1) with unit stride along the keys");
  TORCH_CHECK(v_cache.dim() == 4 && v_cache.size(0) == d.M && v_cache.size(1) == d.KV && v_cache.size(2) >= d.L &&
                  v_cache.size(3) == d.D && v_cache.stride(3) == 1,
              "decode_layer: v_cache must be (rows, kv_heads, >= start + 1, head_dim) with unit stride along D");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == d.M && cos.size(1) == d.D,
              "decode_layer: cos and sin must be (rows, head_dim)");
  TORCH_CHECK(hidden.scalar_type() == at::kBool && hidden.dim() == 2 && hidden.size(0) == d.M &&
                  hidden.size(1) == d.L && hidden.stride(1) == 1,
              "decode_layer: hidden must be (rows, start + 1) bool with unit stride");
  TORCH_CHECK(ln1.numel() == d.Hd && ln2.numel() == d.Hd, "decode_layer: ln1 and ln2 must have hidden elements");
  return d;
}

// An output's storage: (rows, n), contiguous float32 (the caller's, e.g. a recording's slots)
float* output(const at::Tensor& t, int64_t rows, int64_t n, const char* name) {
  check(t, name);
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == n, "decode_layer: ", name, " must be (", rows, ", ", n,
              ")");
  return t.data_ptr<float>();
}

void decode_layer(
    at::Tensor x, const at::Tensor& ln1, at::TensorList qkv_w, const std::optional<at::Tensor>& qkv_b,
    const at::Tensor& o_w, const std::optional<at::Tensor>& o_b, const at::Tensor& ln2, at::TensorList gate_up_w,
    const at::Tensor& down_w, at::Tensor k_store, at::Tensor v_cache, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& hidden, int64_t start, double eps1, double eps2, double scale, int64_t heads, int64_t kv_heads,
    const at::Tensor& qkv_out, const at::Tensor& o_out, const at::Tensor& gu_out, const at::Tensor& down_out) {
  const auto [M, Hd, H, KV, D, I, L] =
      check_arguments(x, ln1, ln2, down_w, k_store, v_cache, cos, sin, hidden, start, heads, kv_heads);
  const rows::Plan plan = rows::plan_for(M, Hd, -1), plan_o = rows::plan_for(M, H * D, -1),
                   plan_d = rows::plan_for(M, I, -1);
  const int64_t threads = threads_for({qkv_w, {o_w}, gate_up_w, {down_w}}, M);
  const Linear qkv_l(qkv_w, Hd, plan, threads), o_l({o_w}, H * D, plan_o, threads),
      gu_l(gate_up_w, Hd, plan, threads), down_l({down_w}, I, plan_d, threads);
  const int64_t Nqkv = qkv_l.stack.N(), Ngu = gu_l.stack.N();
  TORCH_CHECK(Nqkv == (H + 2 * KV) * D && o_l.stack.N() == Hd && Ngu == 2 * I && down_l.stack.N() == Hd,
              "decode_layer: the weights' shapes do not fit hidden, heads, kv_heads and head_dim");
  const float* bq = data_or_null(qkv_b, Nqkv, "qkv_bias");
  const float* bo = data_or_null(o_b, Hd, "o_bias");

  const auto opts = x.options();
  float *qkvp = output(qkv_out, M, Nqkv, "qkv_out"), *op = output(o_out, M, Hd, "o_out"),
        *gup = output(gu_out, M, Ngu, "gu_out"), *downp = output(down_out, M, Hd, "down_out");
  // the linears' inputs, row-major or transposed (every 16-row block written whole, the columns past M zero: lane
  // tiles read them)
  auto input = [&](int64_t K, const rows::Plan& p) {
    return p.lanes ? at::empty({K, p.stride}, opts) : at::empty({M, K}, opts);
  };
  at::Tensor h_in = input(Hd, plan), a_in = input(H * D, plan_o), s_in = input(I, plan_d);
  at::Tensor q = at::empty({M, H * D}, opts), attn = at::empty({M, H * D}, opts);
  const Input hin{h_in.data_ptr<float>(), Hd, plan, M, Hd}, act{s_in.data_ptr<float>(), I, plan_d, M, SWIGLU_COLS};
  float *xp = x.data_ptr<float>(), *attnp = attn.data_ptr<float>(), *ain = a_in.data_ptr<float>();
  const float *w1 = ln1.data_ptr<float>(), *w2 = ln2.data_ptr<float>(), *cp = cos.data_ptr<float>(),
              *sp = sin.data_ptr<float>();
  const Attention at{H, KV, D, L, start, q.data_ptr<float>(), k_store.data_ptr<float>(), v_cache.data_ptr<float>(),
                     attnp, hidden.data_ptr<bool>(), k_store.stride(0), k_store.stride(1), k_store.stride(2),
                     v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), hidden.stride(0),
                     static_cast<float>(scale)};
  const int64_t rep = H / KV;
  // attention items: (row, KV head), or (16-row block, KV head) when o's input is transposed (whole cache lines)
  const int64_t arows = plan_o.lanes ? rows::LANES : 1, ablocks = (M + arows - 1) / arows;

  Phase p[9];
  const int64_t counts[9] = {hin.items(), qkv_l.items(), M,           ablocks * KV,   o_l.items(),
                             hin.items(), gu_l.items(),  act.items(), down_l.items()};
  for (int i = 0; i < 9; ++i) p[i].total = counts[i];
  auto norm = [&](const float* w, double eps) {
    return [&, w, eps](int64_t m, int64_t, int64_t, float* out) {
      rms_row(xp + m * Hd, w, Hd, static_cast<float>(eps), out);
    };
  };
  auto body = [&] {
    p[0].run([&](int64_t it) { hin.fill(it, norm(w1, eps1)); });
    p[1].run([&](int64_t it) { qkv_l.item(it, hin.x, M, qkvp, bq, nullptr); });
    p[2].run([&](int64_t m) { at.store(m, qkvp + m * Nqkv, cp + m * D, sp + m * D); });  // rope, the cache
    p[3].run([&](int64_t t) {  // the query heads of one KV head, for one row or a block of rows
      const int64_t g = t % KV, m0 = t / KV * arows, n = std::min(arows, M - m0);
      at.heads(g, m0, n);
#if defined(__AVX512F__)
      if (plan_o.lanes) {
        const int64_t c0 = g * rep * D;
        rows::transpose_block(attnp + m0 * H * D + c0, H * D, n, rep * D, ain + c0 * plan_o.stride + m0,
                              plan_o.stride);
      }
#endif
    });
    p[4].run([&](int64_t it) { o_l.item(it, plan_o.lanes ? ain : attnp, M, op, bo, xp); });
    p[5].run([&](int64_t it) { hin.fill(it, norm(w2, eps2)); });
    p[6].run([&](int64_t it) { gu_l.item(it, hin.x, M, gup, nullptr, nullptr); });
    p[7].run([&](int64_t it) {
      act.fill(it, [&](int64_t m, int64_t c0, int64_t w, float* out) {
        swiglu_row(gup + m * Ngu + c0, gup + m * Ngu + I + c0, w, out);
      });
    });
    p[8].run([&](int64_t it) { down_l.item(it, act.x, M, downp, nullptr, xp); });
  };
  spin_pool::run(static_cast<int>(threads) - 1, body);
}

// The decode step's last norm and head on the layers' threads: logits = rms(x, w, eps) [W_1; W_2; ...]^T (+ b), the
// rows kernel's tiles and sums (rows_linear.cpp's results, bit for bit)
at::Tensor head(const at::Tensor& x, const at::Tensor& norm_w, double eps, at::TensorList head_w,
                const std::optional<at::Tensor>& head_b) {
  check(x, "x");
  check(norm_w, "norm_weight");
  TORCH_CHECK(x.dim() == 2 && norm_w.numel() == x.size(1), "decode_layer: head: x must be (rows, hidden) and the "
              "norm's weight have hidden elements");
  const int64_t M = x.size(0), K = x.size(1);
  const rows::Plan plan = rows::plan_for(M, K, -1);
  const int64_t threads = threads_for({head_w}, M);
  const Linear lin(head_w, K, plan, threads);
  const int64_t N = lin.stack.N();
  const float* b = data_or_null(head_b, N, "head_bias");
  const auto opts = x.options();
  at::Tensor in = plan.lanes ? at::empty({K, plan.stride}, opts) : at::empty({M, K}, opts);
  at::Tensor out = at::empty({M, N}, opts);
  if (M == 0) return out;
  const Input hin{in.data_ptr<float>(), K, plan, M, K};
  const float *xp = x.data_ptr<float>(), *w = norm_w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  Phase p[2];
  p[0].total = hin.items();
  p[1].total = lin.items();
  spin_pool::run(static_cast<int>(threads) - 1, [&] {
    p[0].run([&](int64_t it) {
      hin.fill(it, [&](int64_t m, int64_t, int64_t, float* o) { rms_row(xp + m * K, w, K, e, o); });
    });
    p[1].run([&](int64_t it) { lin.item(it, hin.x, M, op, b, nullptr); });
  });
  return out;
}

}  // namespace (everything: the two variants' libraries share no symbol)

// The namespace portrl_cpu_decode_layer_<PORTRL_ISA> (op_namespace.h).
#define PORTRL_NS PORTRL_OPS_NS(portrl_cpu_decode_layer)

PORTRL_LIBRARY(PORTRL_NS, m) {
  m.def(
      "layer(Tensor(a!) x, Tensor ln1, Tensor[] qkv_w, Tensor? qkv_b, Tensor o_w, Tensor? o_b, Tensor ln2, "
      "Tensor[] gate_up_w, Tensor down_w, Tensor(b!) k_store, Tensor(c!) v_cache, Tensor cos, Tensor sin, "
      "Tensor hidden, int start, float eps1, float eps2, float scale, int heads, int kv_heads, "
      "Tensor(d!) qkv_out, Tensor(e!) o_out, Tensor(f!) gu_out, Tensor(g!) down_out) -> ()");
  m.def("head(Tensor x, Tensor norm_w, float eps, Tensor[] head_w, Tensor? head_b) -> Tensor");
}

PORTRL_LIBRARY_IMPL(PORTRL_NS, CPU, m) {
  m.impl("layer", &decode_layer);
  m.impl("head", &head);
}

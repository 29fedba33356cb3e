// Helper threads for the decode step's kernels (decode_layer.cpp) that stay awake between a decode step's calls,
// where torch's OpenMP threads would sleep between them.
//
//   spin_pool::run(helpers, fn): fn() on the calling thread and on up to `helpers` pool threads that join while the
//   caller's fn() runs; returns once the caller's fn() has returned and every helper that joined has left fn().
//
// fn must be correct however many threads run it, complete when the calling thread runs it alone, and not throw: the
// kernels split their work into items that whichever thread asks next claims (decode_layer.cpp's Phase), so a helper
// that arrives late finds the work taken, and nothing waits for a helper to arrive. An OpenMP region cannot give that:
// its end waits for every thread of the team, and on a VM a thread woken from sleep takes 40-100 us to arrive
// (libgomp spins GOMP_SPINCOUNT times before it sleeps: 1000 under portrl, a few microseconds, for the reason
// portrl/process_env.py gives), so each of a decode step's regions paid for a wake even where the calling thread
// had done all its work.
//
// A helper done with a call spins for SPIN_WINDOW waiting for the next (a decode step's calls come tens to hundreds
// of microseconds apart; the step's sampling runs between the last call of one step and the first of the next),
// yielding its core every YIELD_EVERY pauses to any thread that wants it (torch's OpenMP threads, another process),
// then sleeps on a condition variable until a call wakes it. A second thread calling while a call runs runs fn alone;
// a process forked from one with helpers starts its own at its first call. (The spin window's and the pool's gain
// against an OpenMP region, alone and with a second run on the same cores: docs/performance.md.)
#pragma once

#include <immintrin.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

namespace {  // each library its own pool (no symbol shared between the variants' libraries)
namespace spin_pool {

constexpr std::chrono::microseconds SPIN_WINDOW{500};
constexpr int YIELD_EVERY = 256;

inline thread_local bool helper_thread = false;

// Whether the calling thread is one of a pool's helpers (not the thread that called run)
inline bool is_helper() { return helper_thread; }

class Pool {
 public:
  void run(int helpers, const std::function<void()>& fn) {
    std::unique_lock<std::mutex> busy(submit_, std::try_to_lock);
    if (helpers <= 0 || !busy.owns_lock()) return fn();
    grow(helpers);
    const uint64_t e = epoch_.load(std::memory_order_relaxed) + 1;
    job_.store(&fn, std::memory_order_relaxed);
    tickets_.store(helpers, std::memory_order_relaxed);
    open_.store(e, std::memory_order_seq_cst);
    epoch_.store(e, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_);
      wake_.notify_all();
    }
    fn();
    open_.store(0, std::memory_order_seq_cst);  // a helper that checks after this leaves without running fn
    for (int i = 1; inside_.load(std::memory_order_seq_cst) > 0; ++i) pause_or_yield(i);
  }

 private:
  static void pause_or_yield(int i) {
    if (i % YIELD_EVERY) _mm_pause();
    else std::this_thread::yield();
  }

  void grow(int helpers) {
    for (; started_ < helpers; ++started_) std::thread([this] { serve(); }).detach();
  }

  void serve() {
    helper_thread = true;
    uint64_t seen = epoch_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t e = next_epoch(seen);
      seen = e;
      inside_.fetch_add(1, std::memory_order_seq_cst);
      if (open_.load(std::memory_order_seq_cst) == e && tickets_.fetch_sub(1, std::memory_order_relaxed) > 0)
        (*job_.load(std::memory_order_relaxed))();
      inside_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  uint64_t next_epoch(uint64_t seen) {  // spin for SPIN_WINDOW, then sleep until a call starts
    const auto until = std::chrono::steady_clock::now() + SPIN_WINDOW;
    for (int i = 1;; ++i) {
      const uint64_t e = epoch_.load(std::memory_order_acquire);
      if (e != seen) return e;
      if (i % YIELD_EVERY || std::chrono::steady_clock::now() < until) {
        pause_or_yield(i);
      } else {
        std::unique_lock<std::mutex> lock(sleep_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return epoch_.load(std::memory_order_seq_cst) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        return epoch_.load(std::memory_order_acquire);
      }
    }
  }

  std::mutex submit_, sleep_;
  std::condition_variable wake_;
  std::atomic<uint64_t> epoch_{0}, open_{0};
  std::atomic<const std::function<void()>*> job_{nullptr};
  std::atomic<int> tickets_{0}, inside_{0}, sleepers_{0};
  int started_ = 0;
};

inline std::atomic<Pool*> current_pool{nullptr};

// The process's pool, made at its first call (never destroyed: its helpers are detached). A process forked from one
// with helpers starts a new pool at its first call: the parent's helpers do not exist in it.
inline Pool& pool() {
  static const int forks_reset = pthread_atfork(nullptr, nullptr, [] { current_pool.store(nullptr); });
  (void)forks_reset;
  Pool* p = current_pool.load(std::memory_order_acquire);
  if (p == nullptr) {
    auto* fresh = new Pool;
    if (current_pool.compare_exchange_strong(p, fresh)) p = fresh;
    else delete fresh;
  }
  return *p;
}

inline void run(int helpers, const std::function<void()>& fn) { pool().run(helpers, fn); }

}  // namespace spin_pool
}  // namespace

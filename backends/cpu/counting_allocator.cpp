// The CPU allocator the CPU backend installs (backends/cpu/heap.py): torch's own allocation (c10::alloc_cpu:
// its alignment, its transparent-huge-page advice) plus a count of the bytes of live tensors and their peak,
// the CPU's counterpart of a GPU caching allocator's "allocated" statistics.
//
// Why count: the CPU backend keeps freed memory in the process (glibc mallopt), so the process's resident size
// no longer falls when a phase's tensors are freed and cannot tell one phase's peak from another's. The count
// can: it is exact for every tensor allocated after install() (earlier ones keep their own deleter and are
// not counted), and it leaves out what the heap keeps, as CUDA's max_memory_allocated leaves out its cache.
//
// Registered as torch ops (torch.ops.portrl_cpu_memory.*); built and loaded by backends/cpu/native_build.py.
#include <ATen/core/Tensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

std::mutex mutex;
std::unordered_map<void*, size_t> sizes;  // live allocation -> bytes
int64_t live = 0, peak = 0;

void counted_free(void* ptr) {
  if (ptr == nullptr) return;
  {
    std::lock_guard<std::mutex> guard(mutex);
    auto it = sizes.find(ptr);
    if (it != sizes.end()) {
      live -= static_cast<int64_t>(it->second);
      sizes.erase(it);
    }
  }
  c10::profiledCPUMemoryReporter().Delete(ptr);
  c10::free_cpu(ptr);
}

struct CountingAllocator final : at::Allocator {
  at::DataPtr allocate(size_t nbytes) override {
    void* ptr = c10::alloc_cpu(nbytes);  // nullptr for 0 bytes
    if (ptr != nullptr) {
      {
        std::lock_guard<std::mutex> guard(mutex);
        sizes.emplace(ptr, nbytes);
        live += static_cast<int64_t>(nbytes);
        peak = std::max(peak, live);
      }
      c10::profiledCPUMemoryReporter().New(ptr, nbytes);  // what torch's default allocator reports too
    }
    return {ptr, ptr, &counted_free, at::Device(at::DeviceType::CPU)};
  }
  at::DeleterFnPtr raw_deleter() const override { return &counted_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

CountingAllocator allocator;

// Make it the CPU allocator of this process (priority 1: above torch's default); idempotent.
bool install() {
  c10::SetCPUAllocator(&allocator, /*priority=*/1);
  return c10::GetCPUAllocator() == &allocator;
}

// [live bytes, peak live bytes since the last reset_peak()]
std::vector<int64_t> stats() {
  std::lock_guard<std::mutex> guard(mutex);
  return {live, peak};
}

void reset_peak() {
  std::lock_guard<std::mutex> guard(mutex);
  peak = live;
}

}  // namespace

TORCH_LIBRARY(portrl_cpu_memory, m) {
  m.def("install", &install);
  m.def("stats", &stats);
  m.def("reset_peak", &reset_peak);
}

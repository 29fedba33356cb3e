// The CPU allocator the CPU backend installs (backends/cpu/heap.py): one malloc per tensor with c10::alloc_cpu's
// alignment and transparent-huge-page advice (below: why not c10::alloc_cpu itself), plus a count of the bytes of
// live tensors and their peak, the CPU's counterpart of a GPU caching allocator's "allocated" statistics.
//
// Why count: the CPU backend keeps freed memory in the process (glibc mallopt), so the process's resident size
// no longer falls when a phase's tensors are freed and cannot tell one phase's peak from another's. The count
// can: it is exact for every tensor allocated after install() (earlier ones keep their own deleter and are
// not counted), and it leaves out what the heap keeps, as CUDA's max_memory_allocated leaves out its cache.
//
// Registered as torch ops (torch.ops.portrl_cpu_memory.*); built and loaded by backends/cpu/native_build.py.
#include <ATen/core/Tensor.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace {

// Each allocation is one malloc of its bytes plus room to align them, with its start and size in a header just
// before the data, so counting allocates nothing else and the same size of tensor asks glibc for the same size of
// chunk every time: a freed one fits it again, its pages already faulted in (backends/cpu/heap.py keeps them).
// Two things of torch's own allocation undid that: a map of pointer -> size (its small nodes split the large
// chunks freed tensors left) and c10::alloc_cpu's posix_memalign for huge pages (glibc's memalign asks for the size
// plus 2 MiB and gives the ends back as separate free chunks, which small allocations then take); the medium
// benchmark's step faulted ~1,500 pages in during its decode alone, every step. The alignment and the huge-page
// advice are c10::alloc_cpu's: 64 bytes, or 2 MiB and madvise(MADV_HUGEPAGE) for 2 MiB or more when
// THP_MEM_ALLOC_ENABLE is set (portrl/process_env.py sets it).
constexpr size_t ALIGN = 64, HUGE_PAGE = size_t{2} << 20;

struct Header {  // just before each allocation's data
  void* start;   // what malloc returned
  size_t nbytes;
};

bool huge_pages_enabled() {  // c10's reading of the variable: "1" on, anything else off
  const char* v = std::getenv("THP_MEM_ALLOC_ENABLE");
  return v != nullptr && std::string(v) == "1";
}

std::mutex mutex;
int64_t live = 0, peak = 0;

void counted_free(void* data) {
  if (data == nullptr) return;
  const Header h = reinterpret_cast<Header*>(data)[-1];
  {
    std::lock_guard<std::mutex> guard(mutex);
    live -= static_cast<int64_t>(h.nbytes);
  }
  c10::profiledCPUMemoryReporter().Delete(data);
  std::free(h.start);
}

struct CountingAllocator final : at::Allocator {
  bool huge = huge_pages_enabled();
  at::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return {nullptr, nullptr, &counted_free, at::Device(at::DeviceType::CPU)};
    const size_t align = huge && nbytes >= HUGE_PAGE ? HUGE_PAGE : ALIGN;
    void* start = nbytes <= SIZE_MAX - align - sizeof(Header) ? std::malloc(nbytes + align + sizeof(Header)) : nullptr;
    TORCH_CHECK_WITH(OutOfMemoryError, start != nullptr, "CPU: not enough memory: tried to allocate ", nbytes,
                     " bytes");
    const uintptr_t first = reinterpret_cast<uintptr_t>(start) + sizeof(Header);
    void* data = reinterpret_cast<void*>((first + align - 1) / align * align);
    reinterpret_cast<Header*>(data)[-1] = Header{start, nbytes};
#ifdef MADV_HUGEPAGE
    if (align == HUGE_PAGE) madvise(data, nbytes, MADV_HUGEPAGE);  // advice: failure only means small pages
#endif
    {
      std::lock_guard<std::mutex> guard(mutex);
      live += static_cast<int64_t>(nbytes);
      peak = std::max(peak, live);
    }
    c10::profiledCPUMemoryReporter().New(data, nbytes);  // what torch's default allocator reports too
    return {data, data, &counted_free, at::Device(at::DeviceType::CPU)};
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

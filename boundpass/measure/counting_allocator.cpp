// A CPU allocator that counts: it wraps c10's CPU allocator and keeps the bytes of every block it handed out and
// that is not yet freed, on whatever thread the free happens (the profiler's memory events miss frees made on
// threads it does not follow, such as gloo's workers). Loaded by boundpass/measure/counting_allocator.py.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace {

std::mutex mu;
std::unordered_map<void*, size_t> sizes;  // every live block this allocator handed out
std::unordered_set<void*> excluded;       // live blocks the caller set aside (host buffers on a CPU-only run)
int64_t counted_live = 0;                 // bytes of `sizes` not in `excluded`
int64_t counted_peak = 0;
c10::Allocator* base = nullptr;
c10::DeleterFnPtr base_delete = nullptr;

void counting_delete(void* p) {
  if (p != nullptr) {
    std::lock_guard<std::mutex> guard(mu);
    auto it = sizes.find(p);
    if (it != sizes.end()) {
      if (excluded.erase(p) == 0) counted_live -= static_cast<int64_t>(it->second);
      sizes.erase(it);
    }
  }
  base_delete(p);
}

struct CountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base->allocate(n);
    void* p = inner.get();
    c10::Device device = inner.device();
    // the base frees by address (its context is the data pointer), so this allocator can own the block itself
    TORCH_CHECK(inner.get_context() == p, "boundpass counting allocator: the CPU allocator's context is not its pointer");
    inner.release_context();
    if (p != nullptr) {
      std::lock_guard<std::mutex> guard(mu);
      sizes[p] = n;
      counted_live += static_cast<int64_t>(n);
      if (counted_live > counted_peak) counted_peak = counted_live;
    }
    return {p, p, &counting_delete, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

CountingAllocator counting;

}  // namespace

extern "C" {

// 0: installed (or already); 1: the current CPU allocator has no raw deleter; 2: c10 kept another allocator
int bp_install() {
  if (c10::GetCPUAllocator() == &counting) return 0;
  base = c10::GetCPUAllocator();
  base_delete = base->raw_deleter();
  if (base_delete == nullptr) return 1;
  c10::SetCPUAllocator(&counting, /*priority=*/UINT8_MAX);
  return c10::GetCPUAllocator() == &counting ? 0 : 2;
}

int64_t bp_live() { std::lock_guard<std::mutex> guard(mu); return counted_live; }
int64_t bp_peak() { std::lock_guard<std::mutex> guard(mu); return counted_peak; }
void bp_reset_peak() { std::lock_guard<std::mutex> guard(mu); counted_peak = counted_live; }

// bytes of the live block at p, set aside from the count until it is freed (0: not a live block of this allocator)
int64_t bp_exclude(void* p) {
  std::lock_guard<std::mutex> guard(mu);
  auto it = sizes.find(p);
  if (it == sizes.end() || !excluded.insert(p).second) return 0;
  counted_live -= static_cast<int64_t>(it->second);
  return static_cast<int64_t>(it->second);
}

// bytes of the live block at p (0: not one of this allocator's)
int64_t bp_size(void* p) {
  std::lock_guard<std::mutex> guard(mu);
  auto it = sizes.find(p);
  return it == sizes.end() ? 0 : static_cast<int64_t>(it->second);
}

}

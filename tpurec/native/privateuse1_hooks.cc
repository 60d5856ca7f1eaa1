// The tpu device's PrivateUse1 hooks in C++, with a pinned host-memory allocator.
//
// PyTorch asks the current accelerator's hooks for a pinned host allocator whenever a CPU tensor
// is made with pin_memory=True, and for isPinnedPtr() when it checks is_pinned(). The hooks a
// Python backend registers (torch._C._acc.PrivateUse1Hooks) forward only isAvailable, isBuilt and
// hasPrimaryContext; the allocator fails with "implement getPinnedMemoryAllocator". DDP's reducer
// stages its map of used parameters through such a pinned tensor for PrivateUse1 devices
// (find_unused_parameters=True, static_graph=True), so it failed on tpu.
//
// JAX stages host memory for its transfers itself, so "pinned for tpu" is ordinary host memory
// from PyTorch's CPU allocator; this allocator remembers which blocks it handed out, so that
// is_pinned() is true for them and only for them. Everything else answers as the Python hooks did.

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>

#include <mutex>
#include <unordered_set>

namespace {

std::mutex live_mutex;

// Blocks handed out and not yet freed (never destroyed: frees may come during exit).
std::unordered_set<const void*>& live_blocks() {
  static auto* blocks = new std::unordered_set<const void*>();
  return *blocks;
}

void free_block(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(live_mutex);
    live_blocks().erase(ptr);
  }
  c10::GetDefaultCPUAllocator()->raw_deallocate(ptr);
}

struct HostAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t bytes) override {
    void* ptr = bytes ? c10::GetDefaultCPUAllocator()->raw_allocate(bytes) : nullptr;
    if (ptr != nullptr) {
      std::lock_guard<std::mutex> lock(live_mutex);
      live_blocks().insert(ptr);
    }
    return {ptr, ptr, &free_block, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_block; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }

  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> lock(live_mutex);
    return live_blocks().count(data) > 0;
  }

  at::Allocator* getPinnedMemoryAllocator() const override {
    static HostAllocator allocator;
    return &allocator;
  }
};

}  // namespace

// Makes these hooks PrivateUse1's: 1, or 0 when PrivateUse1 already has hooks (PyTorch takes
// hooks once per process, so this must run before the Python ones are registered).
extern "C" int tpurec_register_privateuse1_hooks() {
  if (at::isPrivateUse1HooksRegistered()) {
    return 0;
  }
  static Hooks* hooks = new Hooks();  // lives as long as the process: PyTorch keeps the pointer
  at::RegisterPrivateUse1HooksInterface(hooks);
  return 1;
}

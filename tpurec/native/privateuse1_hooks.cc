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
//
// The device guard: PyTorch asks PrivateUse1's guard for its device type whenever a device guard
// is set up around work on tpu tensors (the autograd engine does per node, about 190 times a
// training step of a small MLP). The guard a Python backend registers answers that by calling
// into Python each time; this one answers the same things in C++: one device (index 0) whose
// streams are the default stream and whose events are no-ops, as the Python guard does. Unlike
// that guard, synchronizing the device or a stream (torch.accelerator.synchronize(),
// torch.Stream(device="tpu").synchronize()) waits for the device's work, through tpurec's
// synchronize() handed over by tpurec_set_synchronize.

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <mutex>
#include <string>
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

// tpurec's synchronize(): 0 when it waited, else nonzero with a message in `error` (NUL-terminated,
// at most `capacity` bytes). A ctypes callback, so it takes the GIL itself.
using SynchronizeFn = int (*)(char* error, int capacity);
std::atomic<SynchronizeFn> synchronize_fn{nullptr};

void synchronize_device() {
  SynchronizeFn fn = synchronize_fn.load();
  TORCH_CHECK(fn != nullptr, "tpu: synchronize is not available (tpurec has not finished registering the device)");
  std::string error(1024, '\0');
  if (fn(error.data(), static_cast<int>(error.size())) != 0) {
    TORCH_CHECK(false, error.c_str());
  }
}

struct Guard final : c10::impl::DeviceGuardImplInterface {
  static c10::Device device() { return c10::Device(c10::DeviceType::PrivateUse1, 0); }
  static c10::Stream stream() { return c10::Stream(c10::Stream::DEFAULT, device()); }

  c10::DeviceType type() const override { return c10::DeviceType::PrivateUse1; }
  c10::Device exchangeDevice(c10::Device) const override { return device(); }
  c10::Device getDevice() const override { return device(); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override { return stream(); }
  c10::Stream getNewStream(c10::Device, int) const override { return stream(); }
  c10::Stream exchangeStream(c10::Stream) const noexcept override { return stream(); }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override { synchronize_device(); }
  void synchronizeDevice(const c10::DeviceIndex) const override { synchronize_device(); }
};

}  // namespace

// Makes this guard PrivateUse1's: 1, or 0 when PrivateUse1 already has one (PyTorch keeps the
// first, so this must run before the Python backend's guard is registered).
extern "C" int tpurec_register_privateuse1_guard() {
  if (c10::impl::hasDeviceGuardImpl(c10::DeviceType::PrivateUse1)) {
    return 0;
  }
  static Guard* guard = new Guard();  // lives as long as the process: PyTorch keeps the pointer
  c10::impl::registerDeviceGuard(c10::DeviceType::PrivateUse1, guard);
  return 1;
}

// Hands over tpurec's synchronize() (see SynchronizeFn).
extern "C" void tpurec_set_synchronize(SynchronizeFn fn) { synchronize_fn.store(fn); }

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

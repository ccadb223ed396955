// The stand-in's `neuron` device memory: PyTorch's PrivateUse1 backend given host memory, a device guard, the
// kernels that must know where a tensor's bytes live (allocation, views, copies, resize, set_, reading a scalar)
// and PyTorch's own CPU fallback for every other operator, as PyTorch's open-registration example does
// (test/cpp_extensions/open_registration_extension). Only ATen/c10 headers: no pybind11, no torch/extension.h.
//
// The first allocation is the first use of the device: it calls the hook the Python side set
// (neuron_standin_set_first_use), which initialises the stand-in's runtime, once per process.

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/copy_native.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_cpu_dispatch.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace {

using FirstUseHook = void (*)(const char*);
std::atomic<FirstUseHook> first_use_hook{nullptr};
std::once_flag first_use;
std::atomic<c10::DeviceIndex> device_count{1};
thread_local c10::DeviceIndex current_device = 0;

void used(const char* why) {
  std::call_once(first_use, [why] {
    if (auto hook = first_use_hook.load()) {
      hook(why);
    }
  });
}

void release(void* ptr) {
  std::free(ptr);
}

struct HostMemory final : c10::Allocator {
  c10::DataPtr allocate(size_t bytes) override {
    used("allocation");
    void* data = bytes ? std::malloc(bytes) : nullptr;
    TORCH_CHECK(!bytes || data, "TorchNeuron stand-in: out of host memory for ", bytes, " bytes");
    return {data, data, &release, c10::Device(c10::DeviceType::PrivateUse1, current_device)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &release;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

HostMemory host_memory;

struct Guard final : c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceType kind = c10::DeviceType::PrivateUse1;
  c10::DeviceType type() const override {
    return kind;
  }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = current_device;
    current_device = d.index() < 0 ? 0 : d.index();
    return {kind, old};
  }
  c10::Device getDevice() const override {
    return {kind, current_device};
  }
  void setDevice(c10::Device d) const override {
    current_device = d.index() < 0 ? 0 : d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    current_device = d.index() < 0 ? 0 : d.index();
  }
  c10::Stream getStream(c10::Device d) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, s.device());
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return device_count.load();
  }
  // host memory and synchronous kernels: every event has happened, every stream is idle
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override {
    return true;
  }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override {
    return true;
  }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
};

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  bool hasPrimaryContext(c10::DeviceIndex) const override {
    return true;
  }
  c10::DeviceIndex deviceCount() const override {
    return device_count.load();
  }
  at::Device getDeviceFromPtr(void*) const override {
    return {c10::DeviceType::PrivateUse1, current_device};
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t bytes) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    auto fresh = impl->allocator()->allocate(bytes);
    if (storage.data() && fresh.get()) {
      std::memcpy(fresh.get(), storage.data(), std::min(bytes, storage.nbytes()));
    }
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(bytes);
  }
};

const bool registered = [] {
  c10::SetAllocator(c10::DeviceType::PrivateUse1, &host_memory);
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return true;
}();

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

at::Tensor on_host(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(at::kCPU));
}

void check_device(const std::optional<c10::Device>& device, const std::optional<c10::Layout>& layout,
                  const std::optional<bool>& pinned) {
  TORCH_CHECK(c10::device_or_default(device).is_privateuseone(), "TorchNeuron stand-in: not a neuron device");
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "TorchNeuron stand-in: strided only");
  TORCH_CHECK(!c10::pinned_memory_or_default(pinned), "TorchNeuron stand-in: pinned memory is on the CPU only");
}

at::Tensor empty(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                 std::optional<c10::Device> device, std::optional<bool> pinned,
                 std::optional<c10::MemoryFormat> memory_format) {
  check_device(device, layout, pinned);
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return at::detail::empty_generic(size, &host_memory, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pinned) {
  check_device(device, layout, pinned);
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return at::detail::empty_strided_generic(size, stride, &host_memory,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                      std::optional<c10::SymInt> offset) {
  std::optional<int64_t> plain;
  if (offset.has_value()) {
    plain = offset->expect_int();
  }
  return at::native::as_strided_tensorimpl(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride),
                                           plain);
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

const at::Tensor& resize(const at::Tensor& self, c10::SymIntArrayRef size, std::optional<at::MemoryFormat> format) {
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), format);
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  at::Tensor to = dst.is_cpu() ? dst : on_host(dst);
  at::native::copy_(to, self.is_cpu() ? self : on_host(self), non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Scalar local_scalar(const at::Tensor& self) {
  return at::native::_local_scalar_dense_cpu(on_host(self));
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

at::Tensor& set_storage(at::Tensor& self, at::Storage source) {
  return at::native::set_(self, source);
}

at::Tensor& set_storage_offset(at::Tensor& self, at::Storage source, int64_t offset, c10::IntArrayRef size,
                               c10::IntArrayRef stride) {
  return at::cpu::set_(self, source, offset, size, stride);
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  at::native::cpu_fallback(op, stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("resize_", resize);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar);
  m.impl("set_.source_Tensor", set_tensor);
  m.impl("set_.source_Storage", set_storage);
  m.impl("set_.source_Storage_storage_offset", set_storage_offset);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// Operators registered without an autograd kernel (FSDP2's `fsdp::` copy-in and copy-out, c10d's collectives)
// pass through autograd to their PrivateUse1 kernel, as they do on the CPU and CUDA.
TORCH_LIBRARY_IMPL(_, AutogradPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

extern "C" {
void neuron_standin_set_first_use(FirstUseHook hook) {
  first_use_hook.store(hook);
}
void neuron_standin_set_device_count(int count) {
  device_count.store(static_cast<c10::DeviceIndex>(count));
}
}

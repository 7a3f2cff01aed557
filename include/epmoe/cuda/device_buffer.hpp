// RAII device memory, streams, events and graphs, and host <-> device copies of tensors.
//
// Everything here allocates only where it says so (constructors, to_host/to_device); the copy
// helpers and views never allocate, so they are safe on hot paths. Every CUDA call is checked
// with EPMOE_CUDA_CHECK (epmoe::Error with file:line).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <span>

#include <cuda_runtime_api.h>

#include "epmoe/cuda/launch.hpp"
#include "epmoe/cuda/runtime.hpp"
#include "epmoe/tensor.hpp"

namespace epmoe::cuda {

// ---------------------------------------------------------------- DeviceBuffer
// An owning, move-only block of device memory (cudaMalloc, at least 256-byte aligned).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes);  // zero bytes gives an empty buffer (no allocation)
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;

  void* data() const { return data_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::size_t size() const { return bytes_; }  // bytes
  bool empty() const { return bytes_ == 0; }
  void reset();  // frees (cudaFree; errors at teardown are ignored)

  // A contiguous Device::cuda view of the first bytes of the buffer; throws when the shape needs
  // more bytes than the buffer holds.
  TensorView view(DType dtype, std::initializer_list<std::int64_t> shape) const;
  TensorView view(DType dtype, std::span<const std::int64_t> shape) const;

  // Sets every byte (cudaMemsetAsync on `stream`), e.g. to poison an output before a run.
  void fill_bytes(std::uint8_t byte, cudaStream_t stream = nullptr) const;

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// ---------------------------------------------------------------- DeviceTensor
// An owning, contiguous device tensor: a DeviceBuffer with its view (the device twin of
// HostTensor).
class DeviceTensor : public OwningTensor {
 public:
  DeviceTensor() = default;
  DeviceTensor(DType dtype, std::initializer_list<std::int64_t> shape);
  DeviceTensor(DType dtype, std::span<const std::int64_t> shape);

  bool defined() const { return defined_; }
  void fill_bytes(std::uint8_t byte, cudaStream_t stream = nullptr) const {
    buffer_.fill_bytes(byte, stream);
  }

 private:
  DeviceBuffer buffer_;
  bool defined_ = false;
};

// ---------------------------------------------------------------- Stream
// An owning, move-only CUDA stream (non-blocking with respect to the legacy default stream).
class Stream {
 public:
  Stream();
  // With a scheduling priority (cudaStreamCreateWithPriority; lower numbers run first when both
  // have work ready), e.g. highest_priority() for communication that compute should not starve.
  explicit Stream(int priority);
  static int highest_priority();
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;

  cudaStream_t get() const { return stream_; }
  operator cudaStream_t() const { return stream_; }  // NOLINT: passes straight to launchers
  void synchronize() const;

 private:
  cudaStream_t stream_ = nullptr;
};

// ---------------------------------------------------------------- Event
// An owning, move-only CUDA event. Timing events by default; pass cudaEventDisableTiming for
// pure synchronisation.
class Event {
 public:
  explicit Event(unsigned flags = cudaEventDefault);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;

  cudaEvent_t get() const { return event_; }
  operator cudaEvent_t() const { return event_; }  // NOLINT
  void record(cudaStream_t stream = nullptr) const;
  void synchronize() const;
  // Whether the work before the last record() has completed (cudaEventQuery; throws on an error).
  bool done() const;
  // Milliseconds between two recorded, completed events.
  static float elapsed_ms(const Event& start, const Event& end);

 private:
  cudaEvent_t event_ = nullptr;
};

// ---------------------------------------------------------------- Graph
// An owning, move-only instantiated CUDA graph. capture() records what `enqueue` puts on `stream`
// (thread-local capture mode; if enqueue throws, the capture is ended and discarded and the error
// passes on) and instantiates it; instantiate() takes a graph captured by the caller (destroyed here
// once instantiated). launch() replays it on a stream.
class Graph {
 public:
  Graph() = default;
  static Graph capture(cudaStream_t stream, const std::function<void()>& enqueue);
  static Graph instantiate(cudaGraph_t graph);
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  Graph(Graph&& other) noexcept;
  Graph& operator=(Graph&& other) noexcept;

  cudaGraphExec_t get() const { return exec_; }
  void launch(cudaStream_t stream) const;

 private:
  cudaGraphExec_t exec_ = nullptr;
};

// ---------------------------------------------------------------- copies
// Asynchronous copies on `stream` between tensors of the same dtype and shape, both contiguous;
// the direction follows the views' devices (cpu -> cuda, cuda -> cpu, cuda -> cuda). The host
// tensor must stay alive until the stream has passed the copy. (With pageable host memory the
// runtime may finish the copy before returning.)
void copy(TensorView dst, TensorView src, cudaStream_t stream);
inline void copy_to_device(TensorView dst_device, TensorView src_host, cudaStream_t stream) {
  expect_device(dst_device, Device::cuda, "dst");
  expect_device(src_host, Device::cpu, "src");
  copy(dst_device, src_host, stream);
}
inline void copy_to_host(TensorView dst_host, TensorView src_device, cudaStream_t stream) {
  expect_device(dst_host, Device::cpu, "dst");
  expect_device(src_device, Device::cuda, "src");
  copy(dst_host, src_device, stream);
}
// Allocating conveniences for tests and tools (not for hot paths): copy, then wait on `stream`.
DeviceTensor to_device(TensorView src_host, cudaStream_t stream);
HostTensor to_host(TensorView src_device, cudaStream_t stream);

}  // namespace epmoe::cuda

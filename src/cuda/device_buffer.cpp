#include "epmoe/cuda/device_buffer.hpp"

#include <utility>

namespace epmoe::cuda {

// ---------------------------------------------------------------- DeviceBuffer
DeviceBuffer::DeviceBuffer(std::size_t bytes) {
  if (bytes == 0) return;
  EPMOE_CUDA_CHECK(cudaMalloc(&data_, bytes));
  bytes_ = bytes;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void DeviceBuffer::reset() {
  if (data_ != nullptr) (void)cudaFree(data_);  // a destructor cannot throw; teardown errors are moot
  data_ = nullptr;
  bytes_ = 0;
}

TensorView DeviceBuffer::view(DType dtype, std::span<const std::int64_t> shape) const {
  TensorView v = TensorView::contiguous(data_, dtype, shape, Device::cuda);
  EPMOE_CHECK(v.nbytes() <= bytes_, "view {} needs {} bytes, the device buffer holds {}", v.describe(),
              v.nbytes(), bytes_);
  return v;
}

TensorView DeviceBuffer::view(DType dtype, std::initializer_list<std::int64_t> shape) const {
  return view(dtype, std::span<const std::int64_t>(shape.begin(), shape.size()));
}

void DeviceBuffer::fill_bytes(std::uint8_t byte, cudaStream_t stream) const {
  if (bytes_ == 0) return;
  EPMOE_CUDA_CHECK(cudaMemsetAsync(data_, byte, bytes_, stream));
}

// ---------------------------------------------------------------- DeviceTensor
DeviceTensor::DeviceTensor(DType dtype, std::span<const std::int64_t> shape) {
  view_ = TensorView::contiguous(nullptr, dtype, shape, Device::cuda);
  buffer_ = DeviceBuffer(view_.nbytes());
  view_.data = buffer_.data();
  defined_ = true;
}

DeviceTensor::DeviceTensor(DType dtype, std::initializer_list<std::int64_t> shape)
    : DeviceTensor(dtype, std::span<const std::int64_t>(shape.begin(), shape.size())) {}

// ---------------------------------------------------------------- Stream
Stream::Stream() {
  EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

Stream::Stream(int priority) {
  EPMOE_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority));
}

int Stream::highest_priority() {
  int least = 0, greatest = 0;
  EPMOE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  return greatest;
}

Stream::~Stream() {
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

Stream::Stream(Stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

void Stream::synchronize() const {
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

// ---------------------------------------------------------------- Event
Event::Event(unsigned flags) {
  EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&event_, flags));
}

Event::~Event() {
  if (event_ != nullptr) (void)cudaEventDestroy(event_);
}

Event::Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    if (event_ != nullptr) (void)cudaEventDestroy(event_);
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

void Event::record(cudaStream_t stream) const {
  EPMOE_CUDA_CHECK(cudaEventRecord(event_, stream));
}
void Event::synchronize() const {
  EPMOE_CUDA_CHECK(cudaEventSynchronize(event_));
}

bool Event::done() const {
  const cudaError_t e = cudaEventQuery(event_);
  if (e == cudaErrorNotReady) return false;
  EPMOE_CUDA_CHECK(e);
  return true;
}

float Event::elapsed_ms(const Event& start, const Event& end) {
  float ms = 0.0f;
  EPMOE_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, end.event_));
  return ms;
}

// ---------------------------------------------------------------- Graph
Graph Graph::capture(cudaStream_t stream, const std::function<void()>& enqueue) {
  EPMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    enqueue();
  } catch (...) {
    cudaGraph_t partial = nullptr;
    (void)cudaStreamEndCapture(stream, &partial);
    if (partial != nullptr) (void)cudaGraphDestroy(partial);
    (void)cudaGetLastError();
    throw;
  }
  cudaGraph_t graph = nullptr;
  EPMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  return instantiate(graph);
}

Graph Graph::instantiate(cudaGraph_t graph) {
  Graph g;
  const cudaError_t status = cudaGraphInstantiate(&g.exec_, graph, 0);
  (void)cudaGraphDestroy(graph);  // (the instantiated graph does not need it)
  EPMOE_CUDA_CHECK(status);
  return g;
}

Graph::~Graph() {
  if (exec_ != nullptr) (void)cudaGraphExecDestroy(exec_);
}

Graph::Graph(Graph&& other) noexcept : exec_(std::exchange(other.exec_, nullptr)) {}

Graph& Graph::operator=(Graph&& other) noexcept {
  if (this != &other) {
    if (exec_ != nullptr) (void)cudaGraphExecDestroy(exec_);
    exec_ = std::exchange(other.exec_, nullptr);
  }
  return *this;
}

void Graph::launch(cudaStream_t stream) const {
  EPMOE_CUDA_CHECK(cudaGraphLaunch(exec_, stream));
}

// ---------------------------------------------------------------- copies
void copy(TensorView dst, TensorView src, cudaStream_t stream) {
  EPMOE_CHECK(dst.dtype == src.dtype, "copy: dst {} and src {} differ in dtype", dst.describe(),
              src.describe());
  bool same_shape = dst.rank == src.rank;
  for (int d = 0; same_shape && d < dst.rank; ++d) same_shape = dst.shape[d] == src.shape[d];
  EPMOE_CHECK(same_shape, "copy: dst {} and src {} differ in shape", dst.describe(), src.describe());
  expect_contiguous(dst, "dst");
  expect_contiguous(src, "src");
  EPMOE_CHECK(dst.device == Device::cuda || src.device == Device::cuda,
              "copy: host-to-host copy of {} requested from the CUDA helpers", src.describe());
  if (dst.nbytes() == 0) return;
  cudaMemcpyKind kind = cudaMemcpyDeviceToDevice;
  if (src.device == Device::cpu) kind = cudaMemcpyHostToDevice;
  if (dst.device == Device::cpu) kind = cudaMemcpyDeviceToHost;
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, dst.nbytes(), kind, stream));
}

DeviceTensor to_device(TensorView src_host, cudaStream_t stream) {
  expect_device(src_host, Device::cpu, "src");
  DeviceTensor out(src_host.dtype, src_host.dims());
  copy(out.view(), src_host, stream);
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

HostTensor to_host(TensorView src_device, cudaStream_t stream) {
  expect_device(src_device, Device::cuda, "src");
  HostTensor out(src_device.dtype, src_device.dims());
  copy(out.view(), src_device, stream);
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

}  // namespace epmoe::cuda

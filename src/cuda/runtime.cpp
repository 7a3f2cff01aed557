#include "epmoe/cuda/runtime.hpp"

#include <cstdlib>
#include <filesystem>
#include <system_error>

namespace epmoe::cuda {

namespace {

// The errors a kernel raises on the device. CUDA reports them at whatever call comes next on the host, and
// they are sticky: the context is lost. (The GEMM kernels' pipeline waits trap after a 10 s watchdog, so a
// hang there ends as one of these, without a message of its own.)
bool kernel_fault(cudaError_t status) {
  switch (status) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
      return true;
    default:
      return false;
  }
}

}  // namespace

void throw_cuda_error(cudaError_t status, const char* expr, const char* file, int line) {
  std::string message =
      fmt::format("CUDA error {} ({}) in {}", cudaGetErrorName(status), cudaGetErrorString(status), expr);
  if (kernel_fault(status))
    message +=
        ": a kernel failed on the device, possibly one launched before this call (a fault, or a trap: "
        "the GEMM kernels trap when a pipeline wait passes its 10 s watchdog). The CUDA context is lost "
        "and every later call fails: restart the process; compute-sanitizer --tool memcheck names the "
        "kernel";
  detail::throw_error(file, line, message);
}

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" / "no driver" status
    return 0;
  }
  return count;
}

int listed_gpu_count() {
  std::error_code ec;
  int listed = 0;
  for (std::filesystem::directory_iterator it("/proc/driver/nvidia/gpus", ec), end; !ec && it != end;
       it.increment(ec))
    ++listed;
  return ec ? 0 : listed;
}

int device_count_without_cuda_init() {
  if (std::getenv("CUDA_VISIBLE_DEVICES") == nullptr) {
    const int listed = listed_gpu_count();
    if (listed > 0) return listed;
  }
  return device_count();
}

std::string device_description(int device) {
  if (device_count() <= device) return "no GPU";
  cudaDeviceProp prop{};
  EPMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return fmt::format("{} (sm_{}{}, {} SMs, {:.1f} GiB)", prop.name, prop.major, prop.minor,
                     prop.multiProcessorCount,
                     static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
}

}  // namespace epmoe::cuda

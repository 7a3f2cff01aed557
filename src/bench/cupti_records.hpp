// What epmoe's two CUPTI activity clients share: bench::DeviceActivity (CUPTI loaded with dlopen) and
// tools/kernel_trace (an injection library linked against it). Both hand CUPTI the same buffers and
// read the same records out of them; the record layouts (the versioned CUpti_Activity* structs) are
// named here only. Header-only, needs <cupti.h>; calls no CUPTI function.
#pragma once

#include <cupti.h>
#include <cxxabi.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace epmoe::cupti {

// A kernel, memcpy or memset as both clients read it (GPU timestamps in ns).
struct Record {
  std::string name;  // the kernel's demangled name; "memcpy" or "memset" for copies
  std::uint64_t start = 0, end = 0;
  std::uint32_t device = 0, stream = 0, correlation = 0;
  std::uint32_t graph = 0;           // CUDA graph id (0: not in a graph)
  std::int32_t grid = 0, block = 0;  // kernels: blocks and threads per block
  bool is_copy = false;              // memcpy or memset
  std::uint64_t bytes = 0;           // copies
  int copy_kind = -1;                // memcpy: CUpti_ActivityMemcpyKind
};

inline std::string demangled(const char* name) {
  if (name == nullptr) return "?";
  int status = 0;
  const std::unique_ptr<char, decltype(&std::free)> d(abi::__cxa_demangle(name, nullptr, nullptr, &status),
                                                      std::free);
  return status == 0 && d ? std::string(d.get()) : std::string(name);
}

// CUpti_BuffersCallbackRequestFunc: a buffer for CUPTI to fill (the completion callback frees it).
inline void CUPTIAPI request_buffer(std::uint8_t** buffer, std::size_t* size, std::size_t* max_records) {
  constexpr std::size_t kBytes = 8u << 20;
  *buffer = static_cast<std::uint8_t*>(std::aligned_alloc(8, kBytes));
  *size = *buffer != nullptr ? kBytes : 0;
  *max_records = 0;  // as many as fit
}

// The fields every activity kind enabled here shares.
template <typename Activity>
Record common_fields(std::string name, const Activity& x) {
  Record r;
  r.name = std::move(name);
  r.start = x.start;
  r.end = x.end;
  r.device = x.deviceId;
  r.stream = x.streamId;
  r.correlation = x.correlationId;
  r.graph = x.graphId;
  return r;
}

// A memcpy's or memset's: the shared fields and the bytes.
template <typename Copy>
Record copy_fields(std::string name, const Copy& x) {
  Record r = common_fields(std::move(name), x);
  r.is_copy = true;
  r.bytes = x.bytes;
  return r;
}

// The record `a` holds, or nothing for the activity kinds neither client enables.
inline std::optional<Record> read_record(const CUpti_Activity* a) {
  switch (a->kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
      const auto& k = *reinterpret_cast<const CUpti_ActivityKernel10*>(a);
      Record r = common_fields(demangled(k.name), k);
      r.grid = k.gridX * k.gridY * k.gridZ;
      r.block = k.blockX * k.blockY * k.blockZ;
      return r;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      const auto& m = *reinterpret_cast<const CUpti_ActivityMemcpy6*>(a);
      Record r = copy_fields("memcpy", m);
      r.copy_kind = m.copyKind;
      return r;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET:
      return copy_fields("memset", *reinterpret_cast<const CUpti_ActivityMemset4*>(a));
    default:
      return std::nullopt;
  }
}

}  // namespace epmoe::cupti

// Internal pieces of the communication runtime shared by src/comm/*.
#pragma once

#include <cstddef>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "epmoe/comm.hpp"
#include "epmoe/error.hpp"

// EPMOE_NCCL_CHECK(call): throws epmoe::Error("... NCCL error <name>: <last error> in <call>").
#define EPMOE_NCCL_CHECK(expr)                                                                    \
  do {                                                                                            \
    const ncclResult_t epmoe_nccl_status_ = (expr);                                               \
    if (epmoe_nccl_status_ != ncclSuccess && epmoe_nccl_status_ != ncclInProgress) [[unlikely]] { \
      ::epmoe::comm_detail::throw_nccl_error(epmoe_nccl_status_, #expr, __FILE__, __LINE__);      \
    }                                                                                             \
  } while (0)

namespace epmoe::comm_detail {

[[noreturn]] void throw_nccl_error(ncclResult_t status, const char* expr, const char* file, int line);

// `bytes` of zeroed host-mapped pinned memory (cudaHostAlloc, cudaHostAllocMapped): device code writes
// it and the host reads it without a sync. Returns the host address (free it with cudaFreeHost);
// *device gets the address device code uses.
void* alloc_host_mapped(std::size_t bytes, void** device);

// Device API pieces (symmetric.cu: nccl_device.h compiles only as CUDA).
// ncclDevCommCreate with no requirements (no barriers, no multimem); reports the LSA team.
ncclDevComm* create_dev_comm(ncclComm_t comm, int* lsa_rank, int* lsa_size);
void destroy_dev_comm(ncclComm_t comm, ncclDevComm* dev_comm);
// out_device[r] = the window's LSA pointer of world rank r (nullptr outside the LSA team), for
// r in [0, world_size); the kernel runs on `stream` and is waited for.
void fill_peer_pointers(ncclWindow_t window, int world_rank, int lsa_rank, int lsa_size, int world_size,
                        void** out_device, cudaStream_t stream);

}  // namespace epmoe::comm_detail

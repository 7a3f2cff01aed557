// Internal pieces of the communication runtime shared by src/comm/*.
#pragma once

#include <cstddef>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "epmoe/comm.hpp"
#include "epmoe/error.hpp"

// EPMOE_NCCL_CHECK(call): throws epmoe::Error("... NCCL error <name>: <last error> in <call>"). For
// the calls that answer at once (versions, ids, ncclMemAlloc, queries); a call on a communicator
// goes through EPMOE_NCCL_COMM_CHECK, which completes a nonblocking communicator's ncclInProgress.
#define EPMOE_NCCL_CHECK(expr)                                                               \
  do {                                                                                       \
    const ncclResult_t epmoe_nccl_status_ = (expr);                                          \
    if (epmoe_nccl_status_ != ncclSuccess) [[unlikely]] {                                    \
      ::epmoe::comm_detail::throw_nccl_error(epmoe_nccl_status_, #expr, __FILE__, __LINE__); \
    }                                                                                        \
  } while (0)

// EPMOE_NCCL_COMM_CHECK(communicator, call): a call on the communicator's ncclComm_t, completed
// (Communicator::complete_nccl: a nonblocking communicator's ncclInProgress is waited for, bounded).
#define EPMOE_NCCL_COMM_CHECK(communicator, expr) \
  (communicator).complete_nccl((expr), #expr, __FILE__, __LINE__)

namespace epmoe::comm_detail {

[[noreturn]] void throw_nccl_error(ncclResult_t status, const char* expr, const char* file, int line);

// `bytes` of zeroed host-mapped pinned memory (cudaHostAlloc, cudaHostAllocMapped): device code writes
// it and the host reads it without a sync. Returns the host address (free it with cudaFreeHost);
// *device gets the address device code uses.
void* alloc_host_mapped(std::size_t bytes, void** device);

// Device API pieces (symmetric.cu: nccl_device.h compiles only as CUDA).
// ncclDevCommCreate on comm.nccl() with no requirements (no barriers, no multimem); reports the LSA
// team.
ncclDevComm* create_dev_comm(Communicator& comm, int* lsa_rank, int* lsa_size);
// Teardown (never throws): `nccl` is comm's NCCL communicator.
void destroy_dev_comm(Communicator& comm, ncclComm_t nccl, ncclDevComm* dev_comm) noexcept;
// out_device[r] = the window's LSA pointer of world rank r (nullptr outside the LSA team), for
// r in [0, world_size); the kernel runs on `stream` and is waited for.
void fill_peer_pointers(ncclWindow_t window, int world_rank, int lsa_rank, int lsa_size, int world_size,
                        void** out_device, cudaStream_t stream);

}  // namespace epmoe::comm_detail

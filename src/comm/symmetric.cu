// The NCCL device API where epmoe uses it: the device communicator (to learn the LSA team) and
// the LSA pointers of a symmetric window, read once per window (they are fixed for its life).
#include <nccl_device.h>

#include <memory>

#include "comm/comm_internal.hpp"
#include "comm/symmetric_kernels.cuh"
#include "epmoe/cuda/launch.hpp"

namespace epmoe::comm_detail {

ncclDevComm* create_dev_comm(Communicator& comm, int* lsa_rank, int* lsa_size) {
  auto dev = std::make_unique<ncclDevComm>();
  ncclDevCommRequirements reqs{};  // zero: no barriers, no GIN, and never multimem (NVLS stays off)
  reqs.lsaMultimem = false;
  EPMOE_NCCL_COMM_CHECK(comm, ncclDevCommCreate(comm.nccl(), &reqs, dev.get()));
  *lsa_rank = dev->lsaRank;
  *lsa_size = dev->lsaSize;
  return dev.release();
}

void destroy_dev_comm(Communicator& comm, ncclComm_t nccl, ncclDevComm* dev_comm) noexcept {
  if (dev_comm == nullptr) return;
  // Teardown: errors are not actionable. (Skipped on a communicator broken by an earlier error: its
  // owner aborts it.)
  if (comm.can_make_collective_calls()) (void)comm.complete_nccl_quietly(ncclDevCommDestroy(nccl, dev_comm));
  delete dev_comm;
}

void fill_peer_pointers(ncclWindow_t window, int world_rank, int lsa_rank, int lsa_size, int world_size,
                        void** out_device, cudaStream_t stream) {
  peer_pointers_kernel<<<1, 128, 0, stream>>>(window, world_rank, lsa_rank, lsa_size, world_size, out_device);
  EPMOE_CUDA_CHECK_LAUNCH();
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace epmoe::comm_detail

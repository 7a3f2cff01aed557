// The router's gate GEMM on the GPU: logits [T, E] f32 = x [T, H] bf16 · gate_weight [E, H]^T bf16,
// through cuBLAS (tensor cores, f32 accumulation). CPU twin: epmoe::router_logits_cpu, which sums
// in index order: the two agree to f32 rounding, not bitwise, so a token whose top-k choice is a
// near tie may pick another expert. Checks of a GPU forward therefore route the CPU reference
// from the GPU's logits (reference_forward's `logits` argument); the router itself is bit-exact
// given the logits (epmoe/cuda/router.hpp).
#pragma once

#include <cuda_runtime_api.h>

#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/tensor.hpp"

namespace epmoe::cuda {

class GateGemm {
 public:
  GateGemm();  // creates a cuBLAS handle and its workspace on the current device
  ~GateGemm();
  GateGemm(const GateGemm&) = delete;
  GateGemm& operator=(const GateGemm&) = delete;

  // Contiguous Device::cuda views; T may be 0. Only enqueues work on `stream` (no allocation: the
  // workspace is fixed, so the call can be captured in a CUDA graph).
  void run(TensorView x, TensorView gate_weight, TensorView logits, cudaStream_t stream);

  // Runs the GEMM once for every token count in [1, min(max_tokens, 256)] (zeros), then waits for
  // `stream`. cuBLAS's first GEMM on a handle takes ~0.1 s, and its first use of a kernel for a new
  // shape waits for the whole device (measured with loopback ranks: a rank's first gate GEMM with 31
  // tokens blocked until a peer's dispatch, which waited for this rank, timed out), so the owner pays
  // both at set-up instead of in a forward: every decode-sized batch is covered (~1 ms in all).
  // Allocates and frees scratch.
  void warm_up(TensorView gate_weight, std::int64_t max_tokens, cudaStream_t stream);

 private:
  void* handle_ = nullptr;  // cublasHandle_t
  DeviceBuffer workspace_;
};

}  // namespace epmoe::cuda

#include <cublas_v2.h>

#include <algorithm>

#include "epmoe/cuda/gate.hpp"

namespace epmoe::cuda {
namespace {

#define EPMOE_CUBLAS_CHECK(expr)                                                               \
  do {                                                                                         \
    const cublasStatus_t epmoe_cublas_status_ = (expr);                                        \
    EPMOE_CHECK(epmoe_cublas_status_ == CUBLAS_STATUS_SUCCESS, "{} failed: {} ({}:{})", #expr, \
                cublasGetStatusString(epmoe_cublas_status_), __FILE__, __LINE__);              \
  } while (0)

// cuBLAS's recommended workspace for Hopper (enough for every algorithm it picks).
constexpr std::size_t kWorkspaceBytes = 32u << 20;

}  // namespace

GateGemm::GateGemm() : workspace_(kWorkspaceBytes) {
  // Zeroed once: cuBLAS's split-K reduction reads workspace words its GEMM kernel did not write
  // (compute-sanitizer initcheck reports them), so they hold zeros rather than whatever was there.
  EPMOE_CUDA_CHECK(cudaMemset(workspace_.data(), 0, workspace_.size()));
  cublasHandle_t handle = nullptr;
  EPMOE_CUBLAS_CHECK(cublasCreate(&handle));
  handle_ = handle;
}

GateGemm::~GateGemm() {
  if (handle_) (void)cublasDestroy(static_cast<cublasHandle_t>(handle_));  // (teardown: cannot throw)
}

void GateGemm::run(TensorView x, TensorView gate_weight, TensorView logits, cudaStream_t stream) {
  expect_rank(x, 2, "x");
  expect_rank(gate_weight, 2, "gate_weight");
  const std::int64_t T = x.size(0), H = x.size(1), E = gate_weight.size(0);
  expect_dtype(x, DType::bf16, "x");
  expect_dtype(gate_weight, DType::bf16, "gate_weight");
  expect_shape(gate_weight, {E, H}, "gate_weight");
  expect_dtype(logits, DType::f32, "logits");
  expect_shape(logits, {T, E}, "logits");
  for (const auto& [t, name] : {std::pair{x, "x"}, {gate_weight, "gate_weight"}, {logits, "logits"}}) {
    expect_device(t, Device::cuda, name);
    expect_contiguous(t, name);
  }
  if (T == 0) return;
  auto handle = static_cast<cublasHandle_t>(handle_);
  EPMOE_CUBLAS_CHECK(cublasSetStream(handle, stream));
  // cublasSetStream resets the workspace to cuBLAS's own pool (which may allocate): ours again.
  EPMOE_CUBLAS_CHECK(cublasSetWorkspace(handle, workspace_.data(), workspace_.size()));
  const float alpha = 1.0f, beta = 0.0f;
  // Column-major view: logits^T [E, T] = gate [H, E]^T · x^T [H, T].
  EPMOE_CUBLAS_CHECK(cublasGemmEx(
      handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(E), static_cast<int>(T), static_cast<int>(H), &alpha,
      gate_weight.data, CUDA_R_16BF, static_cast<int>(H), x.data, CUDA_R_16BF, static_cast<int>(H), &beta,
      logits.data, CUDA_R_32F, static_cast<int>(E), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void GateGemm::warm_up(TensorView gate_weight, std::int64_t max_tokens, cudaStream_t stream) {
  expect_rank(gate_weight, 2, "gate_weight");
  EPMOE_CHECK(max_tokens >= 1, "GateGemm::warm_up: max_tokens must be >= 1, got {}", max_tokens);
  const std::int64_t E = gate_weight.size(0), H = gate_weight.size(1);
  const std::int64_t rows = std::min<std::int64_t>(max_tokens, 256);
  DeviceTensor x(DType::bf16, {rows, H}), logits(DType::f32, {rows, E});
  x.fill_bytes(0, stream);
  for (std::int64_t T = 1; T <= rows; ++T)
    run(x.view().slice_rows(0, T), gate_weight, logits.view().slice_rows(0, T), stream);
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace epmoe::cuda

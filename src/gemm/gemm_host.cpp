#include "gemm/gemm_host.hpp"

#include "epmoe/cuda/launch.hpp"

namespace epmoe::cuda::gemm_host {

void require_hopper(std::string_view what) {
  const DeviceProps& props = device_props();
  EPMOE_CHECK(props.cc_major == 9, "{} needs a Hopper GPU (sm_90), got {} (sm_{}{})", what, props.name,
              props.cc_major, props.cc_minor);
}

std::vector<GemmCtaStamps> take_cta_stamps(const void* symbol, int ctas, int max_ctas, cudaStream_t stream) {
  EPMOE_CHECK(ctas >= 1 && ctas <= max_ctas, "ctas must be in [1, {}], got {}", max_ctas, ctas);
  std::vector<unsigned long long> raw(static_cast<std::size_t>(3 * ctas));
  EPMOE_CUDA_CHECK(cudaMemcpyFromSymbolAsync(raw.data(), symbol, raw.size() * sizeof(raw[0]), 0,
                                             cudaMemcpyDeviceToHost, stream));
  const std::vector<unsigned long long> zeros(raw.size(), 0);
  EPMOE_CUDA_CHECK(cudaMemcpyToSymbolAsync(symbol, zeros.data(), zeros.size() * sizeof(zeros[0]), 0,
                                           cudaMemcpyHostToDevice, stream));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<GemmCtaStamps> out(static_cast<std::size_t>(ctas));
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = {raw[3 * i], raw[3 * i + 1], raw[3 * i + 2]};
  return out;
}

}  // namespace epmoe::cuda::gemm_host

// One expert MLP on the CPU: GEMM1 -> SiLU·mul -> GEMM2, the piece every CPU path shares.
//
// The GEMMs are evaluated in f64 on the dequantized operands (each product of an fp8/int4 value
// and its f32 (or bf16) scale is exact in f64), so the only roundings are the ones the GPU pipeline
// has at its quantization points (Numerics::mirror), or none at all (Numerics::exact).
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.hpp"
#include "epmoe/quant.hpp"
#include "epmoe/runner.hpp"
#include "epmoe/silu_quant.hpp"

namespace epmoe {

std::string_view to_string(Numerics n) {
  return n == Numerics::mirror ? "mirror" : "exact";
}

namespace {

// Row n of a weight matrix [N, K] in checkpoint format, dequantized into `row` (f64): with the W4A8
// scales the kernels multiply by under mirror numerics, the checkpoint's f32 ones rounded once to bf16
// (nearest-even) as the packer stores them (gemm/w4a8_layout.hpp); exact numerics keep the checkpoint's.
void dequantize_weight_row(QuantScheme quant, const HostTensor& w, const HostTensor& scale, std::int64_t n,
                           std::int64_t K, Numerics numerics, double* row) {
  switch (quant) {
    case QuantScheme::fp8: {
      const fp8_e4m3* q = w.data<fp8_e4m3>() + n * K;
      const float* s = scale.data<float>() + (n / 128) * (K / 128);
      for (std::int64_t k = 0; k < K; ++k) row[k] = static_cast<double>(q[k].to_float()) * s[k / 128];
      break;
    }
    case QuantScheme::w4a8: {
      const auto* packed = static_cast<const std::uint8_t*>(w.view().data) + n * (K / 2);
      const float* s = scale.data<float>() + n * (K / 128);
      for (std::int64_t kb = 0; kb < K / 128; ++kb) {
        const double block_scale = numerics == Numerics::mirror ? bf16::from_float(s[kb]).to_float() : s[kb];
        for (std::int64_t k = kb * 128; k < (kb + 1) * 128; ++k)
          row[k] = static_cast<double>(unpack_int4(packed, k)) * block_scale;
      }
      break;
    }
    case QuantScheme::none: {
      const bf16* q = w.data<bf16>() + n * K;
      for (std::int64_t k = 0; k < K; ++k) row[k] = q[k].to_float();
      break;
    }
  }
}

// Activations [rows, K] in `format`, dequantized to f64.
std::vector<double> dequantize_activations(ActivationFormat format, TensorView x, TensorView x_scales,
                                           float x_tensor_scale) {
  const std::int64_t rows = x.size(0), K = x.size(1);
  std::vector<double> a(static_cast<std::size_t>(rows * K));
  for (std::int64_t m = 0; m < rows; ++m) {
    for (std::int64_t k = 0; k < K; ++k) {
      double v = 0;
      switch (format) {
        case ActivationFormat::bf16:
          v = x.as<bf16>()[m * K + k].to_float();
          break;
        case ActivationFormat::fp8_group:
          v = static_cast<double>(x.as<fp8_e4m3>()[m * K + k].to_float()) *
              x_scales.as<float>()[m * (K / 128) + k / 128];
          break;
        case ActivationFormat::fp8_tensor:
          v = static_cast<double>(x.as<fp8_e4m3>()[m * K + k].to_float()) * x_tensor_scale;
          break;
      }
      a[static_cast<std::size_t>(m * K + k)] = v;
    }
  }
  return a;
}

// out[m, n] = Σ_k a[m, k] * W[n, k] in f64. Output columns are split over the cores for large
// problems; each element is still summed by one thread in k order, so results do not depend on
// the thread count.
std::vector<double> gemm_f64(QuantScheme quant, const HostTensor& w, const HostTensor& scale,
                             const std::vector<double>& a, std::int64_t rows, std::int64_t N, std::int64_t K,
                             Numerics numerics) {
  std::vector<double> out(static_cast<std::size_t>(rows * N));
  auto columns = [&](std::int64_t n_begin, std::int64_t n_end) {
    std::vector<double> wrow(static_cast<std::size_t>(K));
    for (std::int64_t n = n_begin; n < n_end; ++n) {
      dequantize_weight_row(quant, w, scale, n, K, numerics, wrow.data());
      for (std::int64_t m = 0; m < rows; ++m) {
        const double* am = a.data() + m * K;
        double acc = 0;
        for (std::int64_t k = 0; k < K; ++k) acc += am[k] * wrow[static_cast<std::size_t>(k)];
        out[static_cast<std::size_t>(m * N + n)] = acc;
      }
    }
  };
  // Below ~4M multiply-adds a thread costs more than it saves; 16 columns per work item.
  const double work = static_cast<double>(rows + 1) * static_cast<double>(N) * static_cast<double>(K);
  parallel_chunks(N, 16, threads_for(work, 1 << 22), columns);
  return out;
}

}  // namespace

void expert_mlp_cpu(const ExpertWeights& weights, ActivationFormat format, TensorView x, TensorView x_scales,
                    float x_tensor_scale, float a2_scale, bool power_of_two_scales, Numerics numerics,
                    TensorView out) {
  weights.validate();  // (shapes only: cheap)
  const std::int64_t H = weights.hidden, I = weights.intermediate;
  expect_rank(x, 2, "x");
  const std::int64_t rows = x.size(0);
  expect_shape(x, {rows, H}, "x");
  expect_contiguous(x, "x");
  expect_device(x, Device::cpu, "x");
  expect_dtype(x, format == ActivationFormat::bf16 ? DType::bf16 : DType::fp8_e4m3, "x");
  if (format == ActivationFormat::fp8_group) {
    expect_dtype(x_scales, DType::f32, "x_scales");
    expect_shape(x_scales, {rows, H / 128}, "x_scales");
    expect_scales(x_scales, "x_scales");  // (host, contiguous, positive and finite)
  }
  if (format == ActivationFormat::fp8_tensor) {
    expect_scale(x_tensor_scale, "x_tensor_scale");
    expect_scale(a2_scale, "a2_scale");
  }
  expect_shape(out, {rows, H}, "out");
  expect_host(out, "out");
  EPMOE_CHECK(out.dtype == DType::bf16 || out.dtype == DType::f64, "out must be bf16 or f64, got {}",
              out.describe());
  if (rows == 0) return;

  // GEMM1: [rows, H] x [2I, H]^T -> [rows, 2I].
  const std::vector<double> a1 = dequantize_activations(format, x, x_scales, x_tensor_scale);
  std::vector<double> h =
      gemm_f64(weights.quant, weights.w13, weights.w13_scale, a1, rows, 2 * I, H, numerics);

  // SiLU(gate) * up, then the GEMM2 input in the same activation format as the GEMM1 input.
  std::vector<double> a2(static_cast<std::size_t>(rows * I));
  if (numerics == Numerics::exact) {
    for (std::int64_t m = 0; m < rows; ++m)
      for (std::int64_t j = 0; j < I; ++j) {
        const double g = h[static_cast<std::size_t>(m * 2 * I + j)],
                     u = h[static_cast<std::size_t>(m * 2 * I + I + j)];
        a2[static_cast<std::size_t>(m * I + j)] = g / (1.0 + std::exp(-g)) * u;
      }
  } else {
    // GEMM1 writes bf16; SiLU·mul runs in f32 on those values and is quantized as the GEMM2 input
    // (silu_mul_quant_cpu: the definition; the GPU kernel matches it within design.md §8 tolerances,
    // its SiLU being a fast approximation).
    HostTensor h_bf16(DType::bf16, {rows, 2 * I});
    for (std::int64_t i = 0; i < rows * 2 * I; ++i)
      h_bf16.data<bf16>()[i] = bf16::from_float(static_cast<float>(h[static_cast<std::size_t>(i)]));
    const ActQuant quant{format, power_of_two_scales, a2_scale};
    switch (format) {
      case ActivationFormat::bf16: {
        HostTensor q(DType::bf16, {rows, I});
        silu_mul_quant_cpu(h_bf16, q, TensorView{}, quant);
        a2 = dequantize_activations(format, q, TensorView{}, 1.0f);
        break;
      }
      case ActivationFormat::fp8_group: {
        HostTensor q(DType::fp8_e4m3, {rows, I}), s(DType::f32, {rows, I / 128});
        silu_mul_quant_cpu(h_bf16, q, s, quant);
        a2 = dequantize_activations(format, q, s, 1.0f);
        break;
      }
      case ActivationFormat::fp8_tensor: {
        HostTensor q(DType::fp8_e4m3, {rows, I});
        silu_mul_quant_cpu(h_bf16, q, TensorView{}, quant);
        a2 = dequantize_activations(format, q, TensorView{}, a2_scale);
        break;
      }
    }
  }

  // GEMM2: [rows, I] x [H, I]^T -> [rows, H].
  const std::vector<double> y =
      gemm_f64(weights.quant, weights.w2, weights.w2_scale, a2, rows, H, I, numerics);
  if (out.dtype == DType::f64) {
    for (std::int64_t i = 0; i < rows * H; ++i) out.as<double>()[i] = y[static_cast<std::size_t>(i)];
  } else {
    for (std::int64_t i = 0; i < rows * H; ++i)
      out.as<bf16>()[i] = bf16::from_float(static_cast<float>(y[static_cast<std::size_t>(i)]));
  }
}

}  // namespace epmoe

// SiLU·mul + quantization of the GEMM2 input on the CPU (epmoe/silu_quant.hpp): the definition the
// GPU kernels (silu_quant.cu) are checked against bit for bit.
#include "epmoe/silu_quant.hpp"

#include <cmath>
#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "epmoe/quant.hpp"
#include "runner/silu_math.hpp"

namespace epmoe {

float silu_mul(float gate, float up) {
  return act::silu_mul(gate, up);
}

namespace {

DType output_dtype(ActivationFormat format) {
  return format == ActivationFormat::bf16 ? DType::bf16 : DType::fp8_e4m3;
}

// Checks h ([.., 2I] bf16 of rank `rank`), q and scales; returns I.
std::int64_t check_tensors(const TensorView& h, const TensorView& q, const TensorView& scales,
                           const ActQuant& quant, int rank) {
  expect_rank(h, rank, "h");
  expect_dtype(h, DType::bf16, "h");
  expect_host(h, "h");
  const std::int64_t two_i = h.shape[rank - 1];
  EPMOE_CHECK(two_i > 0 && two_i % 256 == 0,
              "h: the last dimension (2I = {}) must be twice a positive multiple of 128", two_i);
  const std::int64_t inter = two_i / 2;
  auto expect_like = [&](const TensorView& t, std::int64_t last, std::string_view name) {
    bool same = t.rank == rank;
    for (int d = 0; same && d < rank - 1; ++d) same = t.shape[d] == h.shape[d];
    same = same && t.shape[rank - 1] == last;
    TensorView w = h;
    w.shape[rank - 1] = last;
    w.dtype = t.dtype;
    EPMOE_CHECK(same, "{} must have shape {} (h's with 2I -> {}), got {}", name, w.describe(), last,
                t.describe());
  };
  expect_dtype(q, output_dtype(quant.format), "q");
  expect_like(q, inter, "q");
  expect_host(q, "q");
  if (quant.format == ActivationFormat::fp8_group) {
    expect_dtype(scales, DType::f32, "scales");
    expect_like(scales, inter / 128, "scales");
    expect_host(scales, "scales");
  }
  if (quant.format == ActivationFormat::fp8_tensor) {
    expect_scale(quant.tensor_scale, "tensor_scale");
  }
  return inter;
}

// Row `row` of the flattened [rows, 2I] h into row `row` of q / scales; act is scratch of I floats.
void silu_quant_row(const TensorView& h, const TensorView& q, const TensorView& scales, const ActQuant& quant,
                    std::int64_t inter, std::int64_t row, std::vector<float>& act) {
  const bf16* gate = h.as<bf16>() + row * 2 * inter;
  const bf16* up = gate + inter;
  for (std::int64_t j = 0; j < inter; ++j) {
    const float a = act::silu_mul(gate[j].to_float(), up[j].to_float());
    EPMOE_CHECK(std::isfinite(a), "silu(gate) * up is not finite at row {}, column {} (gate {}, up {})", row,
                j, gate[j].to_float(), up[j].to_float());
    act[static_cast<std::size_t>(j)] = a;
  }
  const TensorView act_row = TensorView::contiguous(act.data(), DType::f32, {1, inter});
  switch (quant.format) {
    case ActivationFormat::bf16: {
      bf16* out = q.as<bf16>() + row * inter;
      for (std::int64_t j = 0; j < inter; ++j) out[j] = bf16::from_float(act[static_cast<std::size_t>(j)]);
      break;
    }
    case ActivationFormat::fp8_group: {
      const TensorView q_row =
          TensorView::contiguous(q.as<fp8_e4m3>() + row * inter, DType::fp8_e4m3, {1, inter});
      const TensorView s_row =
          TensorView::contiguous(scales.as<float>() + row * (inter / 128), DType::f32, {1, inter / 128});
      quantize_per_token_group_fp8(act_row, q_row, s_row, 128, quant.power_of_two);
      break;
    }
    case ActivationFormat::fp8_tensor: {
      const TensorView q_row =
          TensorView::contiguous(q.as<fp8_e4m3>() + row * inter, DType::fp8_e4m3, {1, inter});
      quantize_per_tensor_fp8(act_row, q_row, quant.tensor_scale);
      break;
    }
  }
}

void for_rows(const TensorView& h, const TensorView& q, const TensorView& scales, const ActQuant& quant,
              std::int64_t inter, std::int64_t rows, const std::function<bool(std::int64_t)>& selected) {
  std::vector<float> act(static_cast<std::size_t>(inter));
  for (std::int64_t r = 0; r < rows; ++r)
    if (selected(r)) silu_quant_row(h, q, scales, quant, inter, r, act);
}

}  // namespace

void silu_mul_quant_cpu(TensorView h, TensorView q, TensorView scales, const ActQuant& quant) {
  const std::int64_t inter = check_tensors(h, q, scales, quant, 2);
  for_rows(h, q, scales, quant, inter, h.shape[0], [](std::int64_t) { return true; });
}

void silu_mul_quant_contiguous_cpu(TensorView h, TensorView m_indices, TensorView q, TensorView scales,
                                   const ActQuant& quant) {
  const std::int64_t inter = check_tensors(h, q, scales, quant, 2);
  const std::int64_t rows = h.shape[0];
  expect_dtype(m_indices, DType::i32, "m_indices");
  expect_shape(m_indices, {rows}, "m_indices");
  expect_host(m_indices, "m_indices");
  const std::int32_t* m = m_indices.as<std::int32_t>();
  for_rows(h, q, scales, quant, inter, rows, [m](std::int64_t r) { return m[r] >= 0; });
}

void silu_mul_quant_masked_cpu(TensorView h, TensorView masked_m, TensorView q, TensorView scales,
                               const ActQuant& quant) {
  const std::int64_t inter = check_tensors(h, q, scales, quant, 3);
  const std::int64_t experts = h.shape[0], m_max = h.shape[1];
  expect_dtype(masked_m, DType::i32, "masked_m");
  expect_shape(masked_m, {experts}, "masked_m");
  expect_host(masked_m, "masked_m");
  const std::int32_t* mm = masked_m.as<std::int32_t>();
  for (std::int64_t e = 0; e < experts; ++e)
    EPMOE_CHECK(mm[e] >= 0 && mm[e] <= m_max, "masked_m[{}] = {} must lie in [0, M_max = {}]", e, mm[e],
                m_max);
  for_rows(h, q, scales, quant, inter, experts * m_max,
           [mm, m_max](std::int64_t r) { return r % m_max < mm[r / m_max]; });
}

}  // namespace epmoe

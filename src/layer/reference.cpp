// The direct evaluation of design.md §1 that the N-rank simulation (and later the GPU layer) is
// checked against: no ranks, no dispatch, no padding — each token's experts by logical id.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "epmoe/layer.hpp"
#include "layer/layer_common.hpp"

namespace epmoe {

void reference_forward(const ModelWeights& weights, TensorView x, TensorView y, Numerics numerics) {
  reference_forward(weights, x, TensorView{}, y, numerics);
}

void reference_forward(const ModelWeights& weights, TensorView x, TensorView logits, TensorView y,
                       Numerics numerics) {
  const MoeConfig& c = weights.config();
  const std::int64_t H = c.hidden;
  expect_rank(x, 2, "x");
  const std::int64_t T = x.size(0);
  expect_shape(x, {T, H}, "x");
  expect_dtype(x, DType::bf16, "x");
  expect_contiguous(x, "x");
  expect_finite(x, "x");
  expect_shape(y, {T, H}, "y");
  expect_host(y, "y");
  EPMOE_CHECK(y.dtype == DType::bf16 || y.dtype == DType::f64, "y must be bf16 or f64, got {}", y.describe());
  const int K = c.topk;

  HostTensor ids, topk_weights;
  if (logits.empty_view()) {
    detail::route_tokens(weights, x, ids, topk_weights);
  } else {
    expect_shape(logits, {T, c.num_experts}, "logits");
    expect_dtype(logits, DType::f32, "logits");
    expect_device(logits, Device::cpu, "logits");
    expect_contiguous(logits, "logits");
    detail::route_from_logits(weights, logits, ids, topk_weights);
  }
  const ActivationFormat format = activation_format(c.quant);
  const detail::QuantizedTokens q =
      detail::quantize_tokens(format, x, weights.a1_scale(), c.power_of_two_scales);
  const DType out_dtype = numerics == Numerics::mirror ? DType::bf16 : DType::f64;
  auto value = [&](const HostTensor& t, std::int64_t i) {
    return out_dtype == DType::bf16 ? static_cast<double>(t.data<bf16>()[i].to_float()) : t.data<double>()[i];
  };

  // Each logical expert once, on all the rows that chose it (rows are independent in every format).
  std::vector<std::vector<std::int64_t>> pairs(static_cast<std::size_t>(c.num_experts));
  for (std::int64_t i = 0; i < T * K; ++i)
    pairs[static_cast<std::size_t>(ids.data<std::int32_t>()[i])].push_back(i);
  std::vector<double> routed(static_cast<std::size_t>(T * H), 0.0);
  const std::size_t row_bytes = static_cast<std::size_t>(H) * dtype_size(q.x.dtype);
  for (int e = 0; e < c.num_experts; ++e) {
    const auto& list = pairs[static_cast<std::size_t>(e)];
    if (list.empty()) continue;
    const std::int64_t n = static_cast<std::int64_t>(list.size());
    HostTensor xe(q.x.dtype, {n, H}), se(DType::f32, {n, H / 128}), ye(out_dtype, {n, H});
    for (std::int64_t r = 0; r < n; ++r) {
      const std::int64_t t = list[static_cast<std::size_t>(r)] / K;
      std::memcpy(xe.view().select(r).data, q.x.select(t).data, row_bytes);
      if (format == ActivationFormat::fp8_group)
        std::memcpy(se.data<float>() + r * (H / 128), q.scales.data<float>() + t * (H / 128),
                    (H / 128) * sizeof(float));
    }
    expert_mlp_cpu(weights.routed_expert(e), format, xe, se, q.tensor_scale, weights.a2_scale(),
                   c.power_of_two_scales, numerics, ye);
    for (std::int64_t r = 0; r < n; ++r) {
      const std::int64_t pair = list[static_cast<std::size_t>(r)];
      const double w = topk_weights.data<float>()[pair];
      double* dst = routed.data() + (pair / K) * H;
      for (std::int64_t h = 0; h < H; ++h) dst[h] += w * value(ye, r * H + h);
    }
  }

  HostTensor shared;
  if (c.num_shared_experts > 0) {
    shared = HostTensor(out_dtype, {T, H});
    detail::shared_expert_forward(weights, x, shared, numerics);
  }
  for (std::int64_t i = 0; i < T * H; ++i) {
    double v = routed[static_cast<std::size_t>(i)];
    if (numerics == Numerics::mirror) v = round_to_bf16(static_cast<float>(v));  // the combine writes bf16
    if (c.num_shared_experts > 0) v += value(shared, i);
    if (y.dtype == DType::f64) {
      y.as<double>()[i] = v;
    } else {
      y.as<bf16>()[i] = bf16::from_float(static_cast<float>(v));
    }
  }
  // Finite x can still overflow bf16 on the way (the combine's bf16 sum, the output): an error, not Inf /
  // NaN.
  expect_finite(y, detail::kOverflowedOutput);
}

namespace {
double element(const TensorView& t, std::int64_t i) {
  switch (t.dtype) {
    case DType::bf16:
      return t.as<bf16>()[i].to_float();
    case DType::f32:
      return t.as<float>()[i];
    case DType::f64:
      return t.as<double>()[i];
    default:
      EPMOE_FAIL("compare() takes bf16, f32 or f64 tensors, got {}", t.describe());
  }
}
}  // namespace

double layer_tolerance(const MoeConfig& config, std::int64_t tokens) {
  if (config.hidden < 2048) return tokens < 16 ? 3e-2 : 2e-2;
  return tokens < 16 ? 1.5e-2 : 1e-2;
}

ErrorReport compare(TensorView actual, TensorView expected) {
  EPMOE_CHECK(actual.numel() == expected.numel(), "compare: actual has {} elements, expected has {}",
              actual.numel(), expected.numel());
  expect_host(actual, "actual");
  expect_host(expected, "expected");
  ErrorReport report;
  report.count = actual.numel();
  double sxy = 0, sxx = 0, syy = 0, sdd = 0;
  for (std::int64_t i = 0; i < report.count; ++i) {
    const double a = element(actual, i), e = element(expected, i);
    if (!std::isfinite(a) || !std::isfinite(e)) {
      ++report.non_finite;
      continue;
    }
    sxy += a * e;
    sxx += a * a;
    syy += e * e;
    sdd += (a - e) * (a - e);
  }
  report.calc_diff = (sxx + syy) > 0 ? 1.0 - 2.0 * sxy / (sxx + syy) : 0.0;
  report.rel_l2 = syy > 0 ? std::sqrt(sdd / syy) : std::sqrt(sdd);
  if (report.non_finite > 0) {
    report.calc_diff = std::numeric_limits<double>::infinity();
    report.rel_l2 = std::numeric_limits<double>::infinity();
  }
  return report;
}

}  // namespace epmoe

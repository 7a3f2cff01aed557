// Shared by the GPU layer tests on one GPU (tests/layer) and on N ranks (tests/comm_ranks): one
// forward with a poisoned output, and the check against the CPU reference.
#pragma once

#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <gtest/gtest.h>

#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/layer.hpp"
#include "epmoe/layer.hpp"
#include "epmoe/weights.hpp"

namespace epmoe::testing {

struct LayerForward {
  HostTensor y, logits;  // the output and the gate logits the reference routes from
};

// x (host) through the layer, eagerly or by graph replay; y is NaN-poisoned first, so every element
// must be written. The optional hooks are for the multi-rank tests, whose ranks meet at barriers:
// before_forward runs once x and y are on the device (allocated, copied, poisoned), before_free once
// the outputs are on the host and before the device buffers of x and y are freed. With loopback ranks
// (one GPU) a rank must not allocate, free, set or copy device memory while a peer's dispatch already
// waits for it: those calls may wait for the whole device (CUDA's implicit synchronization).
// kind: the eager forward's batch kind (an auto-mode layer needs one); none: forward(x, y).
inline LayerForward layer_forward(cuda::GpuMoeLayer& layer, const HostTensor& x, bool graph,
                                  const std::function<void()>& before_free = {},
                                  const std::function<void()>& before_forward = {},
                                  std::optional<BatchKind> kind = std::nullopt) {
  cudaStream_t s = layer.stream();
  cuda::DeviceTensor dx = cuda::to_device(x, s);
  cuda::DeviceTensor dy(DType::bf16, {x.size(0), x.size(1)});
  dy.fill_bytes(0xff, s);
  if (before_forward) before_forward();
  if (graph) {
    layer.forward_graph(dx, dy);
  } else if (kind) {
    layer.forward(dx, dy, *kind);
  } else {
    layer.forward(dx, dy);
  }
  LayerForward out{cuda::to_host(dy, s), cuda::to_host(layer.last_logits(), s)};
  if (before_free) before_free();
  return out;
}

// Within layer_tolerance() (design.md §8, with the small-model and few-token allowances it explains).
inline void expect_matches_reference(const ModelWeights& w, const HostTensor& x, const LayerForward& f,
                                     const std::string& what) {
  HostTensor ref(DType::bf16, {x.size(0), x.size(1)});
  reference_forward(w, x, f.logits, ref, Numerics::mirror);
  const ErrorReport r = compare(f.y, ref);
  const double tolerance = layer_tolerance(w.config(), x.size(0));
  EXPECT_EQ(r.non_finite, 0) << what;
  EXPECT_LE(r.rel_l2, tolerance) << what;
  EXPECT_LE(r.calc_diff, 1e-3) << what;
  // Every check's margin in the log (one line: a run's worst is a grep away), so that the tolerances can
  // be watched over fresh seeds, passes included.
  std::printf("reference check: %s: rel_l2 %.3e of %.1e (%.2f), %lld tokens, %s\n", what.c_str(), r.rel_l2,
              tolerance, r.rel_l2 / tolerance, static_cast<long long>(x.size(0)), w.config().name.c_str());
  if (r.rel_l2 <= tolerance || r.non_finite > 0) return;
  // Which side is off: both against the exact (f64) reference, and the error of each token, so that a
  // failure tells a GPU fault (far from both) from the quantization points' spread (mirror and GPU about as
  // far from exact, the difference in a token or two).
  const std::int64_t T = x.size(0), H = x.size(1);
  HostTensor exact(DType::f64, {T, H});
  reference_forward(w, x, f.logits, exact, Numerics::exact);
  std::string per_token;
  for (std::int64_t t = 0; t < T && t < 16; ++t)
    per_token += " " + std::to_string(compare(f.y.view().select(t), ref.view().select(t)).rel_l2);
  ADD_FAILURE() << what << ": rel_l2 against exact: GPU " << compare(f.y, exact).rel_l2 << ", mirror "
                << compare(ref, exact).rel_l2 << "; GPU against mirror per token (first 16):" << per_token;
}

// The synthetic weights, read through the plain ModelWeights interface (the path a checkpoint takes),
// refusing one expert once when asked: a slot that cannot take its expert (in life: W4A8 sign-magnitude
// codes and a -8, a bad scale).
class RefusingWeights final : public ModelWeights {
 public:
  explicit RefusingWeights(std::shared_ptr<SyntheticWeights> inner) : inner_(std::move(inner)) {}
  const MoeConfig& config() const override { return inner_->config(); }
  const ExpertWeights& routed_expert(int logical) const override {
    if (logical == refuse_once) {
      refuse_once = -1;
      throw Error(fmt::format("expert {} refused by the test", logical));
    }
    return inner_->routed_expert(logical);
  }
  const ExpertWeights& shared_expert() const override { return inner_->shared_expert(); }
  TensorView gate_weight() const override { return inner_->gate_weight(); }
  TensorView correction_bias() const override {
    return bias_override.defined() ? bias_override.view() : inner_->correction_bias();
  }
  float a1_scale() const override { return inner_->a1_scale(); }
  float a2_scale() const override { return inner_->a2_scale(); }
  mutable int refuse_once = -1;
  HostTensor bias_override;  // when not empty, the correction bias instead of the inner one's

 private:
  std::shared_ptr<SyntheticWeights> inner_;
};

}  // namespace epmoe::testing

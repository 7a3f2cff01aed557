// The device-activity summary (src/bench/device_activity.hpp) on hand-made records: the window, the
// union of overlapping records, idle gaps charged to what ran next, per-kind unions, the mean of
// several forwards, and the kernel-name classification on names shaped as the layer's kernels' demangled
// names.
#include <gtest/gtest.h>

#include <vector>

#include "bench/device_activity.hpp"

namespace epmoe::bench {
namespace {

constexpr std::uint64_t kMs = 1000000;  // ns

ActivityRecord rec(const char* name, std::uint64_t start_ms, std::uint64_t end_ms, bool copy = false) {
  return {name, start_ms * kMs, end_ms * kMs, copy};
}

TEST(DeviceActivity, ClassifiesTheLayersKernelsByName) {
  auto kind = [](const char* name) { return classify_activity(name, false); };
  EXPECT_EQ(
      kind("void epmoe::kernels::fp8_grouped_gemm_kernel<128, 256, 2, true>(epmoe::kernels::Fp8GemmParams)"),
      ActivityKind::experts);
  EXPECT_EQ(kind("void epmoe::kernels::w4a8_grouped_gemm_kernel<64>(epmoe::kernels::W4a8Params)"),
            ActivityKind::experts);
  EXPECT_EQ(kind("void epmoe::kernels::silu_quant_kernel<8>(epmoe::kernels::SiluQuantArgs)"),
            ActivityKind::experts);
  EXPECT_EQ(kind("void epmoe::kernels::per_token_group_fp8_kernel<128>(const __nv_bfloat16*, int)"),
            ActivityKind::experts);
  EXPECT_EQ(kind("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"), ActivityKind::dispatch_combine);
  EXPECT_EQ(
      kind("void epmoe::comm_detail::(anonymous namespace)::send_kernel<true>(epmoe::comm_detail::SendArgs)"),
      ActivityKind::dispatch_combine);
  EXPECT_EQ(kind("void epmoe::kernels::permute_copy_kernel<16>(epmoe::kernels::PermuteArgs)"),
            ActivityKind::dispatch_combine);
  EXPECT_EQ(kind("void epmoe::kernels::routing::route_g8_kernel<8, 256>(epmoe::kernels::routing::RouteArgs)"),
            ActivityKind::route);
  EXPECT_EQ(kind("void epmoe::kernels::eplb_map_kernel(epmoe::kernels::EplbMapArgs)"), ActivityKind::route);
  EXPECT_EQ(kind("nvjet_sm90_hsh_64x16_64x8_1x1_v_bz_TNT"), ActivityKind::route);  // cuBLAS's gate GEMM
  EXPECT_EQ(
      kind("void epmoe::layer_detail::(anonymous namespace)::add_bf16_kernel(uint4 const*, uint4 const*)"),
      ActivityKind::other);
  EXPECT_EQ(classify_activity("memcpy", true), ActivityKind::copies);
  // The parameters' types do not count; an anonymous namespace does not end the name.
  EXPECT_EQ(kind("void epmoe::kernels::(anonymous namespace)::silu_quant_kernel<8>(epmoe::comm_detail::Args, "
                 "void (*)(int))"),
            ActivityKind::experts);
  EXPECT_EQ(kind("void epmoe::layer_detail::copy_kernel<int>(epmoe::kernels::routing::RouteArgs const*)"),
            ActivityKind::other);
  EXPECT_STREQ(to_string(ActivityKind::dispatch_combine), "dispatch_combine");
}

TEST(DeviceActivity, IdleIsTheWindowLessTheUnionChargedToWhatRanNext) {
  // route [0, 10) and experts [5, 20) overlap (two streams); 10 ms idle; dispatch [30, 40) with a
  // copy inside it; 10 ms idle; experts [50, 60). Given out of order.
  const ActivitySummary s = summarize_activity(
      {rec("fp8_grouped_gemm_kernel", 50, 60), rec("route_kernel", 0, 10), rec("memset", 35, 36, true),
       rec("comm_detail::send_kernel", 30, 40), rec("fp8_grouped_gemm_kernel", 5, 20)});
  EXPECT_EQ(s.forwards, 1);
  EXPECT_EQ(s.records, 5);
  EXPECT_DOUBLE_EQ(s.window_ms, 60);
  EXPECT_DOUBLE_EQ(s.busy_ms, 40);
  EXPECT_DOUBLE_EQ(s.idle_ms, 20);
  auto at = [](const auto& a, ActivityKind k) { return a[static_cast<std::size_t>(k)]; };
  EXPECT_DOUBLE_EQ(at(s.idle_before_kind_ms, ActivityKind::dispatch_combine), 10);
  EXPECT_DOUBLE_EQ(at(s.idle_before_kind_ms, ActivityKind::experts), 10);
  EXPECT_DOUBLE_EQ(at(s.idle_before_kind_ms, ActivityKind::route), 0);
  EXPECT_DOUBLE_EQ(at(s.busy_by_kind_ms, ActivityKind::experts), 25);  // [5, 20) and [50, 60)
  EXPECT_DOUBLE_EQ(at(s.busy_by_kind_ms, ActivityKind::route), 10);
  EXPECT_DOUBLE_EQ(at(s.busy_by_kind_ms, ActivityKind::dispatch_combine), 10);
  EXPECT_DOUBLE_EQ(at(s.busy_by_kind_ms, ActivityKind::copies), 1);
  const nlohmann::json j = s.json();
  EXPECT_DOUBLE_EQ(j["idle_ms"].get<double>(), 20);
  EXPECT_DOUBLE_EQ(j["idle_before_kind_ms"]["experts"].get<double>(), 10);
}

TEST(DeviceActivity, ARecordInsideAnotherAddsNothingAndNoGap) {
  const ActivitySummary s = summarize_activity({rec("a", 0, 100), rec("b", 10, 20), rec("c", 30, 100)});
  EXPECT_DOUBLE_EQ(s.window_ms, 100);
  EXPECT_DOUBLE_EQ(s.busy_ms, 100);
  EXPECT_DOUBLE_EQ(s.idle_ms, 0);
}

TEST(DeviceActivity, NoRecordsIsNoForwardAndTheMeanSkipsIt) {
  const ActivitySummary none = summarize_activity({});
  EXPECT_EQ(none.forwards, 0);
  EXPECT_TRUE(none.json().is_null());
  const ActivitySummary a = summarize_activity({rec("x", 0, 10), rec("y", 14, 20)});       // idle 4
  const ActivitySummary b = summarize_activity({rec("x", 100, 110), rec("y", 112, 130)});  // idle 2
  const ActivitySummary m = mean_activity({a, none, b});
  EXPECT_EQ(m.forwards, 2);
  EXPECT_DOUBLE_EQ(m.window_ms, 25);
  EXPECT_DOUBLE_EQ(m.idle_ms, 3);
  EXPECT_DOUBLE_EQ(m.busy_ms, 22);
  EXPECT_EQ(mean_activity({}).forwards, 0);
}

}  // namespace
}  // namespace epmoe::bench

// Benchmark suite "gemm": the FP8 block-scaled grouped GEMM (epmoe/cuda/grouped_gemm.hpp) at every
// shape of DeepGEMM's tables in anchors.md, with DeepGEMM 2.6.1's time beside ours.
//
// Shapes as DeepGEMM's own tests make them: contiguous, each group gets m_per_group * U(0.7, 1.3)
// rows, padded to 128 with -1 rows; masked, masked_m[g] = expected_m * U(0.7, 1.3) (at most max_m).
// Group sizes come from a fixed seed, so every run measures the same problem. TFLOPS count valid
// rows only; bytes = weights + valid activation rows + valid output rows (bf16), as anchors.md
// counts them. A scales are MN-major (the layout the GPU quantizer writes for the kernel).
// floor_us = max(bytes / copy ceiling, flops / 1979 TFLOP/s); deepgemm_us / time_us > 1 means
// faster than DeepGEMM. The masked decode rows (128 groups) also carry copy_us / vs_copy: a device copy of
// the same bytes timed the same way in the same run (issue 4's bar there: >= 95% of the measured copy
// bandwidth, i.e. vs_copy <= 1 / 0.95). Rows with 128-row tiles are also timed in the v2 configuration
// (".v2": no cluster, no ping-pong, 4-byte stores), with the other cluster size (".c1" contiguous, ".c2"
// masked) and (contiguous) with the ping-pong on (".pingpong"), side by side with the main line.
// `--quant w4a8` times the W4A8 kernel (epmoe/cuda/w4a8_gemm.hpp) on the same rows instead, and the
// FP8 kernel's main line beside it in the same run: "gemm.<layout>.w4a8*" lines carry
// time_vs_fp8 = W4A8 time / FP8 time. W4A8 bytes = int4 weights + their scales + valid activation
// and output rows.
// EPMOE_BENCH_GEMM_EXPERIMENTS=1 adds timing experiments (ablations with and without the cluster
// and the ping-pong, each v3 choice flipped, pipeline depth, half the SMs) on three of the shapes,
// as ".exp.*" lines.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <variant>
#include <vector>

#include "bench/bench.hpp"
#include "bench/line_order.hpp"
#include "bench/suite_gemm_fill.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/grouped_gemm.hpp"
#include "epmoe/cuda/launch.hpp"
#include "epmoe/cuda/w4a8_gemm.hpp"
#include "gemm/w4a8_kernel_choice.hpp"

namespace epmoe::bench {
namespace {

constexpr double kFp8PeakTflops = 1979.0;  // dense FP8 tensor-core peak (datasheet; anchors.md)

struct Anchor {
  bool masked;
  std::int64_t groups;
  std::int64_t m;           // contiguous: m per group; masked: max_m
  std::int64_t expected_m;  // masked only
  std::int64_t n, k;
  double deepgemm_us;
  double deepgemm_tflops;  // rows as its test counts them (finish): its group sizes are not ours
  bool exact = false;      // every group exactly m rows (EPMOE_BENCH_GEMM_CUSTOM), not m x U(0.7, 1.3)
};

// DeepGEMM 2.6.1 on one H200 (132 SMs), FP8 e4m3, 1x128 activation scales, 128x128 weight scales,
// bf16 output: the "time" and "TFLOPS" columns of the two DeepGEMM tables of ../shared/anchors.md
// (measured 2026-11-30).
constexpr Anchor kAnchors[] = {
    // contiguous: groups x m/group, n x k
    {false, 32, 256, 0, 4096, 7168, 476, 1311},
    {false, 32, 256, 0, 7168, 2048, 250, 1249},
    {false, 32, 1024, 0, 4096, 7168, 1605, 1353},
    {false, 32, 1024, 0, 7168, 2048, 760, 1321},
    {false, 128, 128, 0, 4096, 7168, 1340, 1032},
    {false, 128, 128, 0, 7168, 2048, 677, 1022},
    {false, 8, 4096, 0, 4096, 7168, 1564, 1398},
    {false, 8, 4096, 0, 7168, 2048, 782, 1341},
    {false, 4, 8192, 0, 4096, 7168, 1298, 1413},
    {false, 4, 8192, 0, 7168, 2048, 684, 1352},
    // masked: groups, max_m, expected m, n x k
    {true, 128, 256, 8, 4096, 7168, 971, 58},
    {true, 128, 256, 8, 7168, 2048, 485, 56},
    {true, 128, 256, 16, 4096, 7168, 970, 118},
    {true, 128, 256, 16, 7168, 2048, 487, 119},
    {true, 32, 1024, 32, 4096, 7168, 241, 240},
    {true, 32, 1024, 32, 7168, 2048, 132, 231},
    {true, 32, 1024, 128, 4096, 7168, 319, 768},
    {true, 32, 1024, 128, 7168, 2048, 179, 713},
    {true, 32, 4096, 192, 4096, 7168, 373, 1005},
    {true, 32, 4096, 192, 7168, 2048, 205, 857},
};

// Row counts per group, DeepGEMM-style: int(m * U(0.7, 1.3)).
std::vector<std::int64_t> group_sizes(const Anchor& s, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.7, 1.3);
  const std::int64_t mean = s.masked ? s.expected_m : s.m;
  std::vector<std::int64_t> sizes;
  for (std::int64_t g = 0; g < s.groups; ++g) {
    auto rows = s.exact ? mean : static_cast<std::int64_t>(static_cast<double>(mean) * u(rng));
    if (s.masked) rows = std::min(rows, s.m);
    sizes.push_back(rows);
  }
  return sizes;
}

// The FP8 operands: activations a (rows x K, one 128-value block per row) and weights b (G x N x K,
// 128 x 128 blocks), as EPMOE_BENCH_GEMM_DATA says (fp8_data_from_env).
void fill_operands(TensorView a, TensorView b, std::uint64_t seed, cudaStream_t stream) {
  if (fp8_data_from_env() == Fp8Data::uniform) {
    fill_random_fp8(a, seed + 1, stream);
    fill_random_fp8(b, seed + 3, stream);
  } else {
    fill_quantized_normal_fp8(a, 1, seed + 1, stream);
    fill_quantized_normal_fp8(b, 128, seed + 3, stream);
  }
}

// EPMOE_BENCH_GEMM_TIMING: "burst" (default; DeepGEMM's method, which measured anchors.md's rows:
// TimingOptions::burst) or "sustained" (back-to-back runs, the median: the clock a power-limited card
// holds under continuous tensor-core work, as a long prefill sees it).
bool burst_timing() {
  const char* e = std::getenv("EPMOE_BENCH_GEMM_TIMING");
  const std::string_view v = e == nullptr ? "" : e;
  EPMOE_CHECK(v.empty() || v == "burst" || v == "sustained",
              "EPMOE_BENCH_GEMM_TIMING must be 'burst' or 'sustained', got '{}'", v);
  return v != "sustained";
}
TimingOptions gemm_timing(const SuiteOptions& options) {
  TimingOptions t = timing_for(options);
  if (burst_timing()) {
    t.burst = true;
    t.iterations = options.quick ? 10 : 30;  // DeepGEMM's num_tests
  }
  return t;
}

Result finish(std::string name, Params params, double us, double bytes, double flops, const Anchor& s) {
  params["data"] = std::string(fp8_data_name(fp8_data_from_env()));
  params["timing"] = std::string(burst_timing() ? "burst" : "sustained");
  Result r = make_result(std::move(name), std::move(params), us, bytes, flops);
  r.floor_us = std::max(r.floor_us, flops / (kFp8PeakTflops * 1e6));
  r.params["deepgemm_us"] = s.deepgemm_us;
  r.params["vs_deepgemm"] = us > 0 ? s.deepgemm_us / us : 0.0;
  // The rate ratio: each side's group sizes are its own random draw (int(m * U(0.7, 1.3))), so the
  // same row holds up to ~15% more or less work here than in DeepGEMM's run (the time ratio above
  // compares unequal work); issue 4's contiguous bar is in TFLOPS.
  // DeepGEMM's test counts the contiguous rows padded to 128 per group (its m is the aligned total)
  // and the masked rows as valid: the same count here (padded_m) for the ratio.
  double rate = r.tflops;
  if (const auto it = r.params.find("padded_m"); it != r.params.end() && us > 0) {
    const auto dim = [&](const char* key) {
      return static_cast<double>(std::get<std::int64_t>(r.params.at(key)));
    };
    rate = 2.0 * dim("padded_m") * dim("n") * dim("k") / (us * 1e6);
  }
  r.params["deepgemm_tflops"] = s.deepgemm_tflops;
  r.params["vs_deepgemm_tflops"] = s.deepgemm_tflops > 0 ? rate / s.deepgemm_tflops : 0.0;
  return r;
}

// One timed configuration of a shape: a name suffix ("" for the main line) and the options.
struct Variant {
  std::string suffix;
  cuda::GroupedGemmOptions options;
  // The A scales token-major ([rows, K/128], the layer's layout) instead of the DeepGEMM layout
  // (mn_major_tma, [K/128, rows]) that every other line and DeepGEMM's anchors use.
  bool token_major_scales = false;
};

// Timed beside the main line in the same run: the v2 kernel's configuration (".v2": no cluster,
// no ping-pong, 4-byte stores), the CTA pair (".c2") and the ping-pong on.
Variant v2_variant() {
  Variant v{".v2", {}};
  v.options.cluster = 1;
  v.options.pingpong = false;
  v.options.vector_epilogue = false;
  return v;
}
Variant c2_variant() {
  Variant v{".c2", {}};
  v.options.cluster = 2;
  return v;
}
Variant skew_variant() {
  Variant v{".skew", {}};
  v.options.consumer_skew = true;
  return v;
}
Variant plain_loop_variant() {  // the K loop not unrolled (the default before session 11)
  Variant v{".plain", {}};
  v.options.unrolled_k_loop = false;
  return v;
}
Variant pingpong_variant() {
  Variant v{".pingpong", {}};
  v.options.pingpong = true;
  return v;
}
Variant direct_variant() {  // the consumers' own 16-byte stores (the default before v12)
  Variant v{".direct", {}};
  v.options.borrow_epilogue = 0;
  return v;
}
Variant
borrow_variant() {  // v12 on every row it applies to (masked K = 7168's default; contiguous before v33)
  Variant v{".borrow", {}};
  v.options.borrow_epilogue = 1;
  return v;
}
Variant wave0_variant() {  // v31: wave 0 staged, wave 1 stored by the consumers (masked K <= 2048 default)
  Variant v{".wave0", {}};
  v.options.borrow_epilogue = 2;
  return v;
}
Variant wave0_first_variant() {  // v33: v12 with wave 0 staged before the consumers meet (contiguous default)
  Variant v{".wave0_first", {}};
  v.options.borrow_epilogue = 3;
  return v;
}
Variant token_major_variant() {  // the layer's scale layout (ScaleLayout::token_major)
  Variant v{".token_major", {}};
  v.token_major_scales = true;
  return v;
}
// A line's A scales: the DeepGEMM layout's, or the token-major copy for Variant::token_major_scales.
cuda::ScaleLayout scale_layout_of(const Variant& v) {
  return v.token_major_scales ? cuda::ScaleLayout::token_major : cuda::ScaleLayout::mn_major_tma;
}
const cuda::DeviceTensor& scales_of(const Variant& v, const cuda::DeviceTensor& mn_major,
                                    const cuda::DeviceTensor& token_major) {
  return v.token_major_scales ? token_major : mn_major;
}
Variant split_variant() {  // v11: 128 x 256 tiles with <= 64 valid rows split, on every row (always)
  Variant v{".split", {}};
  v.options.split_tiles = 1;
  return v;
}
Variant nosplit_variant() {  // the default before session 30: never split
  Variant v{".nosplit", {}};
  v.options.split_tiles = 0;
  return v;
}
Variant no_split_tail_variant() {  // the default before v21 (session 38): the tail tiles whole
  Variant v{".no_split_tail", {}};
  v.options.split_tail = 0;
  return v;
}
Variant no_zero_padding_variant() {  // the default before v29 (session 43): padding rows' A as it is
  Variant v{".no_zero_padding", {}};
  v.options.zero_padding_rows = false;
  return v;
}
Variant no_trim_variant() {  // the default before v30 (session 44): every SM a CTA
  Variant v{".no_trim", {}};
  v.options.trim_ctas = 0;
  return v;
}
Variant trim_variant() {  // v30's trimmed grid asked for (masked: the device still decides)
  Variant v{".trim", {}};
  v.options.trim_ctas = 1;
  return v;
}
Variant no_tail_pieces_variant() {  // masked: the default before v22 (session 39): v21's split tail only
  Variant v{".no_tail_pieces", {}};
  v.options.tail_pieces = 0;
  return v;
}

// Timing experiments (EPMOE_BENCH_GEMM_EXPERIMENTS=1): ablations that locate the bottleneck
// (no tensor-core work, no loads), pipeline depth, half the SMs, L2 promotion, the A box.
std::vector<Variant> experiments(bool masked) {
  std::vector<Variant> v;
  auto add = [&](std::string name, auto&& set) {
    cuda::GroupedGemmOptions o;
    set(o);
    v.push_back({".exp." + std::move(name), o});
  };
  add("no_math", [](auto& o) { o.ablation = 1; });
  add("no_loads", [](auto& o) { o.ablation = 2; });
  add("no_loads_pingpong", [](auto& o) {
    o.ablation = 2;
    o.pingpong = true;
  });
  add("no_math_cluster1", [](auto& o) {
    o.ablation = 1;
    o.cluster = 1;
  });
  add("no_loads_cluster1", [](auto& o) {
    o.ablation = 2;
    o.cluster = 1;
  });
  add("no_loads_cluster1_pingpong", [](auto& o) {
    o.ablation = 2;
    o.cluster = 1;
    o.pingpong = true;
  });
  add("pingpong", [](auto& o) { o.pingpong = true; });
  add("scalar_epilogue", [](auto& o) { o.vector_epilogue = false; });
  add("stages2", [](auto& o) { o.stages = 2; });
  // What a whole-tile staged epilogue would cost and leave (its 64 KB take one of 128 x 256's four
  // stages): three stages with the stores, and without them.
  add("stages3", [](auto& o) { o.stages = 3; });
  add("no_epilogue_stages3", [](auto& o) {
    o.ablation = 16;
    o.stages = 3;
  });
  add("half_sms", [](auto& o) { o.max_ctas = 66; });
  // Session 30: the contiguous tile order's band width (1024 columns by default; "all": N).
  if (!masked) {
    add("band_512", [](auto& o) { o.band_columns = 512; });
    add("band_2048", [](auto& o) { o.band_columns = 2048; });
    add("band_all", [](auto& o) { o.band_columns = 1 << 30; });
  }
  // Is the epilogue's cost the CTAs' stores meeting in L2 at once (less with half the SMs storing)?
  add("half_sms_no_epilogue", [](auto& o) {
    o.max_ctas = 66;
    o.ablation = 16;
  });
  // v5: where the consumers' time goes (bits of GroupedGemmOptions::ablation).
  add("no_promote", [](auto& o) { o.ablation = 4; });
  add("one_wait", [](auto& o) { o.ablation = 8; });
  add("one_wait_no_promote", [](auto& o) { o.ablation = 8 | 4; });
  add("no_epilogue", [](auto& o) { o.ablation = 16; });
  // Session 16: v12 without the producer's wait for the store warp (garbage output): what the
  // hand-off costs each next tile's K blocks 2 and 3.
  add("no_epi_gate", [](auto& o) { o.ablation = 1024; });
  // Whole-tile stores (GroupedGemmOptions::tile_store) on every row, or never (sessions 36-37).
  add("tile_store", [](auto& o) { o.tile_store = 1; });
  add("no_tile_store", [](auto& o) { o.tile_store = 0; });
  add("no_scales", [](auto& o) { o.ablation = 32; });
  add("no_loads_no_scales", [](auto& o) { o.ablation = 2 | 32; });
  add("no_loads_no_promote", [](auto& o) { o.ablation = 2 | 32 | 4; });
  add("tensor_only", [](auto& o) { o.ablation = 2 | 32 | 4 | 8 | 16; });
  // Session 10: the tensor-only loop without the consumers' "full" waits, and without any pipeline.
  add("tensor_only_no_full_wait", [](auto& o) { o.ablation = 2 | 32 | 4 | 8 | 16 | 64; });
  add("tensor_only_no_pipe", [](auto& o) { o.ablation = 2 | 32 | 4 | 8 | 16 | 128; });
  // Session 11: each consumer warp spins 200 cycles per K block (ablation 512): is the loop's
  // turnaround hidden by the other warpgroup's wgmma? (Read with EPMOE_BENCH_GEMM_TRACE=1.)
  add("spin", [](auto& o) { o.ablation = 512; });
  add("tensor_only_spin", [](auto& o) { o.ablation = 2 | 32 | 4 | 8 | 16 | 512; });
  add("tensor_only_no_pipe_spin", [](auto& o) { o.ablation = 2 | 32 | 4 | 8 | 16 | 128 | 512; });
  add("tensor_only_cluster1", [](auto& o) {
    o.ablation = 2 | 32 | 4 | 8 | 16;
    o.cluster = 1;
  });
  add("tensor_only_two_waits", [](auto& o) { o.ablation = 2 | 32 | 4 | 16; });
  add("tensor_only_n128", [](auto& o) {
    o.ablation = 2 | 32 | 4 | 16;
    o.block_n = 128;
  });
  add("tensor_only_n128_cluster1", [](auto& o) {
    o.ablation = 2 | 32 | 4 | 16;
    o.block_n = 128;
    o.cluster = 1;
  });
  if (masked) add("full_a_box", [](auto& o) { o.small_a_box = false; });
  return v;
}

// EPMOE_BENCH_GEMM_VARIANTS=main,.exp.no_promote,...: the contiguous rows time only the listed lines
// ("main" is the heuristic's line; VARIANTS=main for profiling), each EPMOE_BENCH_GEMM_REPEAT times (default
// 1; one result per time), e.g. to watch the clocks of one configuration for seconds (power-capped cards).
// With --quant w4a8 it picks the W4A8 lines of every row (".w4a8", ".w4a8.v2.s.m128", ...; the FP8 line
// always runs: the ratios need it).
bool variant_listed(const std::string& suffix) {
  return env_list_has("EPMOE_BENCH_GEMM_VARIANTS", suffix.empty() ? "main" : suffix);
}
// EPMOE_BENCH_GEMM_ROUNDS=R (1..100, default 1): a row's listed lines are timed in R rounds, the order
// rotated by one line per round (rotated_line_order); with R > 1 each result names its round and place.
int line_rounds() {
  const char* e = std::getenv("EPMOE_BENCH_GEMM_ROUNDS");
  const int n = e != nullptr && *e != '\0' ? std::atoi(e) : 1;
  EPMOE_CHECK(n >= 1 && n <= 100, "EPMOE_BENCH_GEMM_ROUNDS must be 1..100, got '{}'", e == nullptr ? "" : e);
  return n;
}
// The timings of a row's lines (variants with a `suffix`), in line_rounds() rotated rounds.
template <typename V>
std::vector<LinePlace> line_order(const std::vector<V>& variants) {
  std::vector<std::size_t> listed;
  for (std::size_t i = 0; i < variants.size(); ++i) {
    if (variant_listed(variants[i].suffix)) listed.push_back(i);
  }
  return rotated_line_order(listed, line_rounds());
}
// A timing's round and place in its row, when there are rounds.
void add_place(Params& p, const LinePlace& l) {
  if (line_rounds() == 1) return;
  p["round"] = static_cast<std::int64_t>(l.round);
  p["place"] = static_cast<std::int64_t>(l.place);
}
int variant_repeat() {
  const char* e = std::getenv("EPMOE_BENCH_GEMM_REPEAT");
  const int n = e != nullptr ? std::atoi(e) : 1;
  EPMOE_CHECK(n >= 1 && n <= 1000, "EPMOE_BENCH_GEMM_REPEAT must be 1..1000, got '{}'",
              e == nullptr ? "" : e);
  return n;
}

// EPMOE_BENCH_GEMM_TRACE=1: every FP8 line runs with the consumer-loop trace (options.ablation bit
// 256; the output stays intact) and reports it (with_trace).
bool trace_enabled() {
  const char* e = std::getenv("EPMOE_BENCH_GEMM_TRACE");
  return e != nullptr && *e != '\0' && *e != '0';
}
// EPMOE_BENCH_GEMM_CTA_STAMPS=1: every FP8 line also reports its CTAs' stamps (add_cta_stamps; three
// launches with options.ablation bit 2048, apart from the timed ones).
bool cta_stamps_enabled() {
  const char* e = std::getenv("EPMOE_BENCH_GEMM_CTA_STAMPS");
  return e != nullptr && *e != '\0' && *e != '0';
}
void add_cta_stamps(Params& p, const std::function<void()>& launch,
                    const std::function<std::vector<cuda::GemmCtaStamps>()>& take, cudaStream_t stream);
// An FP8 line's CTA stamps into p (where asked), from the line's `launch` (stream, options) with `options`
// and the stamp bit.
void add_fp8_cta_stamps(Params& p, const cuda::GroupedGemmOptions& options,
                        const std::function<void(cudaStream_t, const cuda::GroupedGemmOptions&)>& launch,
                        cudaStream_t stream) {
  if (!cta_stamps_enabled()) return;
  cuda::GroupedGemmOptions stamped = options;
  stamped.ablation |= 2048;
  add_cta_stamps(
      p, [&] { launch(stream, stamped); },
      [&] { return cuda::fp8_grouped_gemm_take_cta_trace(cuda::kGemmTraceMaxCtas, stream); }, stream);
}
// Every line's options: the trace where asked, and v21's split-tail workspace (one per process, zeroed
// once; the lines run one at a time on one stream).
cuda::GroupedGemmOptions line_options(cuda::GroupedGemmOptions o) {
  if (trace_enabled()) o.ablation |= 256;
  // (Never freed: it would outlive the CUDA context at exit.)
  static const cuda::DeviceTensor* const workspace = [] {
    auto* w = new cuda::DeviceTensor(DType::i32,
                                     {static_cast<std::int64_t>(cuda::grouped_gemm_workspace_bytes() / 4)});
    cuda::Stream stream;
    w->fill_bytes(0x00, stream);
    stream.synchronize();
    return w;
  }();
  o.workspace = workspace->view().data;
  o.workspace_bytes = workspace->nbytes();
  return o;
}

// The FP8 consumer-loop trace (options.ablation bit 256) of a line's launches, as parameters:
// loop_cycles_per_wgmma (SM cycles per wgmma instruction per CTA in the consumer loop; 64 is the
// dense peak of m64n128k32), loop_mhz (the SM clock the loops ran at) and loop_of_span (the loops'
// mean time over the launch's span, first CTA entry to last loop exit). Lines without it: p as is.
Params with_trace(Params p, const cuda::Fp8GemmTrace& t) {
  if (t.launches == 0 || t.k_blocks == 0 || t.loop_ns == 0 || t.span_ns == 0) return p;
  const auto dim = [&](const char* key) {
    const auto it = p.find(key);
    return it != p.end() && std::holds_alternative<std::int64_t>(it->second)
               ? std::get<std::int64_t>(it->second)
               : std::int64_t{0};
  };
  const double wgmma_per_kb = static_cast<double>(dim("block_m") / 64 * dim("block_n") / 128 * 4);
  if (wgmma_per_kb > 0)
    p["loop_cycles_per_wgmma"] =
        static_cast<double>(t.loop_cycles) / static_cast<double>(t.k_blocks) / wgmma_per_kb;
  p["loop_mhz"] = 1e3 * static_cast<double>(t.loop_cycles) / static_cast<double>(t.loop_ns);
  p["loop_of_span"] = static_cast<double>(t.loop_ns) / static_cast<double>(t.ctas) /
                      (static_cast<double>(t.span_ns) / static_cast<double>(t.launches));
  if (t.stored_tiles > 0) {  // v12's hand-off, cycles per tile (the loop's too, for scale)
    const auto tiles = static_cast<double>(t.stored_tiles);
    p["loop_cycles_per_tile"] = static_cast<double>(t.loop_cycles) / tiles;
    p["epi_done_wait_per_tile"] = static_cast<double>(t.epi_done_wait_cycles) / tiles;
    p["empty_wait_per_tile"] = static_cast<double>(t.empty_wait_cycles) / tiles;
    p["store_per_tile"] = static_cast<double>(t.store_cycles) / tiles;
    p["staged_wait_per_tile"] = static_cast<double>(t.staged_wait_cycles) / tiles;
  }
  if (t.consumer_tiles > 0) {  // the traced consumer's epilogue; the TMA warp's turn (session 35)
    const auto tiles = static_cast<double>(t.consumer_tiles);
    p["epilogue_per_tile"] = static_cast<double>(t.epilogue_cycles) / tiles;
    p["producer_turn_per_tile"] = static_cast<double>(t.producer_turn_cycles) / tiles;
    p["producer_kb0_wait_per_tile"] = static_cast<double>(t.producer_kb0_wait_cycles) / tiles;
  }
  if (t.split_chunks > 0) {  // v21's split tail (session 38): per chunk, and per sum
    p["split_chunks"] = static_cast<std::int64_t>(t.split_chunks);
    p["split_write_per_chunk"] =
        static_cast<double>(t.split_write_cycles) / static_cast<double>(t.split_chunks);
    if (t.split_reductions > 0)
      p["split_sum_per_tile"] =
          static_cast<double>(t.split_sum_cycles) / static_cast<double>(t.split_reductions);
  }
  return p;
}

// One bench line timed variant_repeat() times, one result each; `run(stream)` launches it once. With
// `copy`, each result also carries the same-bytes copy's time of this run (copy_us, vs_copy).
template <typename Run>
void time_line(const SuiteOptions& options, std::vector<Result>& results, const std::string& name,
               const Params& p, double bytes, double flops, const Anchor& s, cudaStream_t stream,
               SameBytesCopy* copy, Run&& run) {
  const bool trace = trace_enabled();
  for (int r = 0, repeat = variant_repeat(); r < repeat; ++r) {
    if (trace) cuda::fp8_grouped_gemm_take_trace();  // zero it
    const double us = time_us([&](int, cudaStream_t st) { run(st); }, 1, stream, gemm_timing(options));
    Result result =
        finish(name, trace ? with_trace(p, cuda::fp8_grouped_gemm_take_trace()) : p, us, bytes, flops, s);
    emit(options, results, copy != nullptr ? copy->attach(std::move(result), bytes) : std::move(result));
  }
}

bool experiments_enabled() {
  const char* e = std::getenv("EPMOE_BENCH_GEMM_EXPERIMENTS");
  return e != nullptr && *e != '\0' && *e != '0';
}

void run_contiguous(const Anchor& s, std::uint64_t seed, const SuiteOptions& options, bool experiment,
                    std::vector<Result>& results) {
  const std::vector<std::int64_t> sizes = group_sizes(s, seed);
  std::vector<std::int32_t> ids;
  std::int64_t valid = 0;
  for (std::size_t g = 0; g < sizes.size(); ++g) {
    const std::int64_t padded = (sizes[g] + 127) / 128 * 128;
    for (std::int64_t r = 0; r < padded; ++r) ids.push_back(r < sizes[g] ? static_cast<std::int32_t>(g) : -1);
    valid += sizes[g];
  }
  const auto M = static_cast<std::int64_t>(ids.size());
  const std::int64_t G = s.groups, N = s.n, K = s.k, KB = K / 128;

  cuda::Stream stream;
  const cuda::DeviceTensor a(DType::fp8_e4m3, {M, K}), sa(DType::f32, {KB, cuda::tma_aligned_tokens(M)}),
      b(DType::fp8_e4m3, {G, N, K}), sb(DType::f32, {G, N / 128, KB}), m_indices(DType::i32, {M}),
      d(DType::bf16, {M, N});
  fill_operands(a, b, seed, stream);
  const cuda::DeviceTensor sa_token_major(DType::f32, {M, KB});
  fill_random_scales(sa, seed + 2, stream);
  fill_random_scales(sa_token_major, seed + 2, stream);
  fill_random_scales(sb, seed + 4, stream);
  HostTensor host_ids(DType::i32, {M});
  std::copy(ids.begin(), ids.end(), host_ids.data<std::int32_t>());
  cuda::copy_to_device(m_indices, host_ids, stream);
  d.fill_bytes(0xff, stream);
  stream.synchronize();

  const double flops = 2.0 * static_cast<double>(valid) * static_cast<double>(N) * static_cast<double>(K);
  const double bytes =
      static_cast<double>(G * N * K) + static_cast<double>(valid) * static_cast<double>(K + 2 * N);
  // The heuristic's tile first, then 128 x 128 (".alt") when the heuristic picked 128 x 256.
  const cuda::GemmTileShape chosen = cuda::grouped_gemm_tile(false, s.m, N);
  std::vector<Variant> variants{{"", {}},
                                no_split_tail_variant(),
                                no_zero_padding_variant(),
                                no_trim_variant(),
                                c2_variant(),
                                pingpong_variant(),
                                skew_variant(),
                                plain_loop_variant(),
                                v2_variant(),
                                token_major_variant()};
  if (chosen.block_n == 256) {
    variants.push_back(direct_variant());
    variants.push_back(borrow_variant());
    variants.push_back(split_variant());
    variants.push_back(nosplit_variant());
    variants.push_back({".alt", {}});
    variants.back().options.block_n = 128;
    variants.push_back({".alt.p1", {}});  // 128 x 128 with one partial (before v7)
    variants.back().options.block_n = 128;
    variants.back().options.two_partials = false;
  }
  if (experiment) {
    for (Variant& v : experiments(false)) variants.push_back(std::move(v));
  }
  for (const LinePlace& l : line_order(variants)) {
    const Variant& v = variants[l.line];
    Params p{
        {"layout", std::string("contiguous")},
        {"quant", std::string("fp8")},
        {"groups", G},
        {"m_per_group", s.m},
        {"n", N},
        {"k", K},
        {"valid_m", valid},
        {"padded_m", M},
        {"block_m", static_cast<std::int64_t>(v.options.block_m != 0 ? v.options.block_m : chosen.block_m)},
        {"block_n", static_cast<std::int64_t>(v.options.block_n != 0 ? v.options.block_n : chosen.block_n)}};
    add_place(p, l);
    const auto launch = [&](cudaStream_t st, const cuda::GroupedGemmOptions& o) {
      cuda::fp8_grouped_gemm_contiguous(a, scales_of(v, sa, sa_token_major), scale_layout_of(v), b, sb,
                                        m_indices, d, st, o);
    };
    add_fp8_cta_stamps(p, line_options(v.options), launch, stream);
    time_line(options, results, "gemm.contiguous" + v.suffix, p, bytes, flops, s, stream, nullptr,
              [&](cudaStream_t st) { launch(st, line_options(v.options)); });
  }
}

void run_masked(const Anchor& s, std::uint64_t seed, const SuiteOptions& options, bool experiment,
                std::vector<Result>& results) {
  const std::vector<std::int64_t> sizes = group_sizes(s, seed);
  const std::int64_t G = s.groups, M_max = s.m, N = s.n, K = s.k, KB = K / 128;
  std::int64_t valid = 0;
  HostTensor counts(DType::i32, {G});
  for (std::int64_t g = 0; g < G; ++g) {
    counts.data<std::int32_t>()[g] = static_cast<std::int32_t>(sizes[static_cast<std::size_t>(g)]);
    valid += sizes[static_cast<std::size_t>(g)];
  }

  cuda::Stream stream;
  const cuda::DeviceTensor a(DType::fp8_e4m3, {G, M_max, K}),
      sa(DType::f32, {G, KB, cuda::tma_aligned_tokens(M_max)}), b(DType::fp8_e4m3, {G, N, K}),
      sb(DType::f32, {G, N / 128, KB}), masked_m(DType::i32, {G}), d(DType::bf16, {G, M_max, N});
  fill_operands(a, b, seed, stream);
  // EPMOE_BENCH_GEMM_ZERO_PADDING=1: the rows past each group's count (which the kernels compute where a
  // tile holds valid rows too, and never store) zero instead of random (session 43: what the padding
  // rows' operand values cost a card whose clock drops under tensor work).
  if (const char* e = std::getenv("EPMOE_BENCH_GEMM_ZERO_PADDING");
      e != nullptr && std::string_view(e) == "1") {
    for (std::int64_t g = 0; g < G; ++g) {
      const std::int64_t rows = sizes[static_cast<std::size_t>(g)];
      if (rows < M_max)
        EPMOE_CUDA_CHECK(cudaMemsetAsync(static_cast<std::uint8_t*>(a.view().data) + (g * M_max + rows) * K,
                                         0, static_cast<std::size_t>((M_max - rows) * K), stream));
    }
  }
  const cuda::DeviceTensor sa_token_major(DType::f32, {G, M_max, KB});
  fill_random_scales(sa, seed + 2, stream);
  fill_random_scales(sa_token_major, seed + 2, stream);
  fill_random_scales(sb, seed + 4, stream);
  cuda::copy_to_device(masked_m, counts, stream);
  d.fill_bytes(0xff, stream);
  stream.synchronize();

  const double flops = 2.0 * static_cast<double>(valid) * static_cast<double>(N) * static_cast<double>(K);
  const double bytes =
      static_cast<double>(G * N * K) + static_cast<double>(valid) * static_cast<double>(K + 2 * N);
  // The decode rows' bar is a share of the measured copy bandwidth (issue 4: >= 95%): their lines carry
  // a copy of the same bytes timed the same way in this run (copy_us; vs_copy <= 1/0.95 meets it).
  SameBytesCopy same_bytes(stream, gemm_timing(options));
  SameBytesCopy* decode_copy = s.groups == 128 ? &same_bytes : nullptr;
  // The heuristic's tile first, then the others (".alt*") to keep the choice honest.
  const cuda::GemmTileShape chosen = cuda::grouped_gemm_tile(true, s.expected_m, N);
  std::vector<Variant> variants{
      {"", {}},          no_split_tail_variant(), no_tail_pieces_variant(), no_zero_padding_variant(),
      no_trim_variant(), trim_variant(),          token_major_variant()};
  if (chosen.block_m == 128) {
    variants.push_back(c2_variant());
    variants.push_back(v2_variant());
    if (chosen.block_n == 256) {
      variants.push_back(direct_variant());
      variants.push_back(borrow_variant());
      variants.push_back(wave0_variant());
      variants.push_back(wave0_first_variant());
      // v36 (session 48): groups of 1-64 expected rows run split 128 x 256 tiles, the rest whole.
      if (cuda::grouped_gemm_split_tiles(true, s.expected_m * G, G, K))
        variants.push_back(nosplit_variant());
      else
        variants.push_back(split_variant());
    }
  } else {
    variants.push_back({".p1", {}});  // the 64 x 128 tile with one partial (before v7)
    variants.back().options.two_partials = false;
  }
  // A without row boxes (64-row tiles: one 32-row box or all 64 rows, before v35; zero-padding 128-row
  // tiles: 32-row boxes, before v37 and where the automatic choice has none) and in 16-row boxes whatever
  // the expected rows.
  variants.push_back({".no_row_boxes", {}});
  variants.back().options.a_row_box_rows = 0;
  variants.push_back({".row_boxes16", {}});
  variants.back().options.a_row_box_rows = 16;
  if (chosen.block_m == 64) {
    // The heuristic's 128-row tile (split where the automatic rule splits: <= 64 expected rows; v37's row
    // boxes where the automatic choice has them), and the same in 32-row boxes.
    variants.push_back({".alt", {}});
    variants.back().options.block_m = 128;
    variants.push_back({".alt.no_row_boxes", {}});
    variants.back().options.block_m = 128;
    variants.back().options.a_row_box_rows = 0;
  } else {
    variants.push_back({".alt", {}});
    variants.back().options.block_m = 64;
    variants.back().options.block_n = 128;
    if (chosen.block_n == 256) {
      variants.push_back({".alt_n", {}});
      variants.back().options.block_n = 128;
    }
  }
  // The swapped-operand kernel (options.swap_ab), beside the row-major one.
  variants.push_back({".swap", {}});
  variants.back().options.swap_ab = 1;
  if (experiment) {
    for (Variant& v : experiments(true)) variants.push_back(std::move(v));
    // The swapped kernel's timing ablations (sessions 41-42): without its loads, its epilogue, its scale
    // copies, the consumers' full waits (stale stages), their math (the pipeline's barriers alone).
    for (const auto& [name, bits] :
         {std::pair{"no_loads", 2}, std::pair{"no_epilogue", 16}, std::pair{"no_scales", 32},
          std::pair{"no_loads_no_scales", 2 | 32}, std::pair{"no_loads_no_scales_no_full_wait", 2 | 32 | 64},
          std::pair{"no_loads_no_scales_no_math", 1 | 2 | 32},
          std::pair{"no_loads_no_scales_no_full_wait_no_promote", 2 | 4 | 32 | 64},
          std::pair{"no_loads_no_scales_no_promote", 2 | 4 | 32}, std::pair{"no_promote", 4},
          std::pair{"scalar_promote", 8}, std::pair{"no_loads_scalar_promote", 2 | 8},
          std::pair{"tensor_only", 2 | 4 | 32}, std::pair{"tensor_only_one_consumer", 2 | 4 | 32 | 512},
          std::pair{"no_loads_no_scales_one_consumer", 2 | 32 | 512}}) {
      variants.push_back({std::string(".swap.exp.") + name, {}});
      variants.back().options.swap_ab = 1;
      variants.back().options.ablation = bits;
    }
  }
  for (const LinePlace& l : line_order(variants)) {
    const Variant& v = variants[l.line];
    cuda::GemmTileShape tile = chosen;
    if (v.options.block_m != 0) tile = cuda::grouped_gemm_tile(v.options.block_m == 128, 1000, N);
    if (v.options.block_m == 64) tile = {64, 128};
    if (v.options.block_n != 0) tile.block_n = v.options.block_n;
    Params p{{"layout", std::string("masked")},
             {"quant", std::string("fp8")},
             {"groups", G},
             {"m_per_group", s.expected_m},
             {"max_m", M_max},
             {"n", N},
             {"k", K},
             {"valid_m", valid},
             {"block_m", static_cast<std::int64_t>(tile.block_m)},
             {"block_n", static_cast<std::int64_t>(tile.block_n)},
             {"swap_ab", std::int64_t{v.options.swap_ab == 1 || (v.options.swap_ab == -1 &&
                                                                 cuda::grouped_gemm_swap_ab(s.expected_m))}}};
    add_place(p, l);
    const auto launch = [&](cudaStream_t st, const cuda::GroupedGemmOptions& o) {
      cuda::fp8_grouped_gemm_masked(a, scales_of(v, sa, sa_token_major), scale_layout_of(v), b, sb, masked_m,
                                    s.expected_m, d, st, o);
    };
    add_fp8_cta_stamps(p, line_options(v.options), launch, stream);
    time_line(options, results, "gemm.masked" + v.suffix, p, bytes, flops, s, stream, decode_copy,
              [&](cudaStream_t st) { launch(st, line_options(v.options)); });
  }
}

// The per-CTA stamps (`take`: cuda::w4a8_take_cta_trace, cuda::fp8_grouped_gemm_take_cta_trace) of three
// single launches of `launch` (with the stamp bit) on an idle GPU, of the launch with the median span,
// into p, in µs from the first CTA's entry: the CTAs' entry spread, their last loads issued (median,
// last), their stages all released (first, median, last), and the launch's event time.
void add_cta_stamps(Params& p, const std::function<void()>& launch,
                    const std::function<std::vector<cuda::GemmCtaStamps>()>& take, cudaStream_t stream) {
  struct LaunchStamps {
    double entry_spread, issued_median, issued_last, drained_first, drained_median, drained_last, event_us;
    std::int64_t ctas;
  };
  static_cast<void>(take());  // (earlier launches' stamps)
  std::vector<LaunchStamps> launches;
  for (int r = 0; r < 3; ++r) {
    const cuda::Event start, end;
    start.record(stream);
    launch();
    end.record(stream);
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<cuda::GemmCtaStamps> st = take();
    std::erase_if(st, [](const cuda::GemmCtaStamps& x) { return x.entry == 0 || x.drained == 0; });
    if (st.empty()) return;
    std::uint64_t t0 = st[0].entry;
    for (const auto& x : st) t0 = std::min(t0, x.entry);
    const auto us = [t0](std::uint64_t ns) { return 1e-3 * static_cast<double>(ns - t0); };
    double entry_last = 0;
    std::vector<double> issued, drained;
    for (const auto& x : st) {
      entry_last = std::max(entry_last, us(x.entry));
      issued.push_back(us(x.loads_issued));
      drained.push_back(us(x.drained));
    }
    std::sort(issued.begin(), issued.end());
    std::sort(drained.begin(), drained.end());
    launches.push_back({entry_last, issued[issued.size() / 2], issued.back(), drained.front(),
                        drained[drained.size() / 2], drained.back(),
                        1e3 * static_cast<double>(cuda::Event::elapsed_ms(start, end)),
                        static_cast<std::int64_t>(st.size())});
  }
  std::sort(launches.begin(), launches.end(),
            [](const LaunchStamps& a, const LaunchStamps& b) { return a.drained_last < b.drained_last; });
  const LaunchStamps& m = launches[1];
  p["cta_entry_spread_us"] = m.entry_spread;
  p["cta_loads_issued_median_us"] = m.issued_median;
  p["cta_loads_issued_last_us"] = m.issued_last;
  p["cta_drained_first_us"] = m.drained_first;
  p["cta_drained_median_us"] = m.drained_median;
  p["cta_drained_last_us"] = m.drained_last;
  p["cta_traced"] = m.ctas;
  p["cta_launch_event_us"] = m.event_us;
}

// --quant w4a8: the W4A8 kernel on an anchor row (its tile heuristic and a few alternatives), and
// the FP8 kernel's main line on the same problem (same group sizes, same activation bytes).
void run_w4a8(const Anchor& s, std::uint64_t seed, const SuiteOptions& options, bool experiment,
              std::vector<Result>& results) {
  const std::vector<std::int64_t> sizes = group_sizes(s, seed);
  const std::int64_t G = s.groups, N = s.n, K = s.k, KB = K / 128;
  std::vector<std::int32_t> ids;  // contiguous
  HostTensor counts(DType::i32, {G});
  std::int64_t valid = 0;
  for (std::int64_t g = 0; g < G; ++g) {
    const std::int64_t rows = sizes[static_cast<std::size_t>(g)];
    valid += rows;
    counts.data<std::int32_t>()[g] = static_cast<std::int32_t>(rows);
    const std::int64_t padded = (rows + 127) / 128 * 128;
    if (!s.masked)
      for (std::int64_t r = 0; r < padded; ++r) ids.push_back(r < rows ? static_cast<std::int32_t>(g) : -1);
  }
  const std::int64_t rows_total = s.masked ? G * s.m : static_cast<std::int64_t>(ids.size());
  const std::int64_t sa_rows = s.masked ? s.m : rows_total;

  cuda::Stream stream;
  // Inputs of both kernels. The activations are one tensor viewed in either layout.
  const cuda::DeviceTensor a(DType::fp8_e4m3, {rows_total, K}), d(DType::bf16, {rows_total, N}),
      layout_ids(DType::i32, {s.masked ? G : rows_total});
  const cuda::DeviceTensor sa(DType::f32, {s.masked ? G : 1, KB, cuda::tma_aligned_tokens(sa_rows)});
  const cuda::DeviceTensor b(DType::fp8_e4m3, {G, N, K}), sb(DType::f32, {G, N / 128, KB});
  const cuda::DeviceTensor w(DType::i4x2, {G, N, K / 2}), ws(DType::f32, {G, N, KB}),
      pw(DType::i4x2, {G, N, K / 2}), ps(DType::bf16, {G, N, KB});
  // The masked W4A8 calls' workspace (the row-sum pre-pass, where their kernel takes it), allocated
  // once as the runner does.
  const cuda::DeviceTensor w4_workspace(
      DType::f32, {s.masked ? static_cast<std::int64_t>(cuda::w4a8_workspace_bytes(G, s.m, K) / 4) : 0});
  w4_workspace.fill_bytes(0, stream);  // zeroed once (W4A8GemmOptions::workspace)
  fill_operands(a, b, seed, stream);
  fill_random_scales(sa, seed + 2, stream);
  fill_random_scales(sb, seed + 4, stream);
  TensorView w_bytes = w.view();
  w_bytes.dtype = DType::u8;  // random bytes: every int4 value
  fill_random_fp8(w_bytes, seed + 5, stream);
  fill_random_scales(ws, seed + 6, stream);
  cuda::w4a8_prepare_weights(w, ws, pw, ps, stream);
  // The ".w4a8.sm" line's weights: the same with every -8 made -7, prepared with the sign-magnitude
  // codes (session 28; a symmetric amax / 7 quantizer never writes -8).
  const bool sm_listed = variant_listed(".w4a8.sm");
  const cuda::DeviceTensor pw_sm(DType::i4x2, {sm_listed ? G : 0, N, K / 2}),
      ps_sm(DType::bf16, {sm_listed ? G : 0, N, KB});
  if (sm_listed) {
    clear_int4_minus8(w, stream);
    cuda::w4a8_prepare_weights(w, ws, pw_sm, ps_sm, stream, cuda::W4A8Codes::sign_magnitude);
  }
  if (s.masked) {
    cuda::copy_to_device(layout_ids, counts, stream);
  } else {
    HostTensor host_ids(DType::i32, {rows_total});
    std::copy(ids.begin(), ids.end(), host_ids.data<std::int32_t>());
    cuda::copy_to_device(layout_ids, host_ids, stream);
  }
  d.fill_bytes(0xff, stream);
  stream.synchronize();

  TensorView a_view = a.view(), d_view = d.view(), sa_view = sa.view();
  if (s.masked) {
    a_view.rank = 3;
    a_view.shape = {G, s.m, K, 0};
    a_view.stride = {s.m * K, K, 1, 0};
    d_view.rank = 3;
    d_view.shape = {G, s.m, N, 0};
    d_view.stride = {s.m * N, N, 1, 0};
  } else {
    sa_view.rank = 2;
    sa_view.shape = {KB, cuda::tma_aligned_tokens(sa_rows), 0, 0};
    sa_view.stride = {cuda::tma_aligned_tokens(sa_rows), 1, 0, 0};
  }
  const double flops = 2.0 * static_cast<double>(valid) * static_cast<double>(N) * static_cast<double>(K);
  const double act_out = static_cast<double>(valid) * static_cast<double>(K + 2 * N);
  const double fp8_bytes = static_cast<double>(G * N * K) + act_out;
  const double w4_bytes = static_cast<double>(cuda::w4a8_packed_weight_bytes(G, N, K)) +
                          static_cast<double>(cuda::w4a8_packed_scale_bytes(G, N, K)) + act_out;
  Params base{{"layout", std::string(s.masked ? "masked" : "contiguous")},
              {"groups", G},
              {"m_per_group", s.masked ? s.expected_m : s.m},
              {"n", N},
              {"k", K},
              {"valid_m", valid}};
  if (s.masked) {
    base["max_m"] = s.m;
  } else {
    base["padded_m"] = rows_total;
  }
  const std::string name = s.masked ? "gemm.masked" : "gemm.contiguous";

  const double fp8_us = time_us(
      [&](int, cudaStream_t st) {
        if (s.masked) {
          cuda::fp8_grouped_gemm_masked(a_view, sa_view, cuda::ScaleLayout::mn_major_tma, b, sb, layout_ids,
                                        s.expected_m, d_view, st);
        } else {
          cuda::fp8_grouped_gemm_contiguous(a_view, sa_view, cuda::ScaleLayout::mn_major_tma, b, sb,
                                            layout_ids, d_view, st);
        }
      },
      1, stream, gemm_timing(options));
  Params fp8_params = base;
  fp8_params["quant"] = std::string("fp8");
  emit(options, results, finish(name, fp8_params, fp8_us, fp8_bytes, flops, s));

  // The automatic choice first (".w4a8"), then whichever of the register-operand kernel (v2, its tile
  // heuristic: ".w4a8.v2") and the shared-memory-conversion kernel (v3, its tile heuristic:
  // ".w4a8.v3") it is not, then v3's other tiles (".w4a8.v3.m<rows>n<cols>w<waves>"), pinned
  // through gemm/w4a8_kernel_choice.hpp.
  struct W4A8Variant {
    std::string suffix;
    cuda::W4A8KernelChoice pin;
    cuda::W4A8GemmOptions options{};
  };
  // (Contiguous: the API's hint is the average rows per group, padding included.)
  const cuda::W4A8KernelChoice chosen =
      cuda::w4a8_kernel_choice(s.masked, s.masked ? s.expected_m : rows_total / G, N, K);
  const cuda::W4A8KernelChoice v3 = cuda::w4a8_resolve_v3(
      {.version = 3, .signed_codes = !s.masked || s.expected_m > 64 ? 1 : 0}, s.masked, s.expected_m, N);
  std::vector<W4A8Variant> variants{{".w4a8", chosen}};
  // A v2 variant is listed unless it is the choice (the ".w4a8" line).
  const auto add_v2 = [&](const cuda::W4A8KernelChoice& c) {
    const bool same = chosen.version == 2 && chosen.offset_warp == c.offset_warp &&
                      std::max(chosen.stage_k_blocks, 1) == std::max(c.stage_k_blocks, 1) &&
                      chosen.parts == c.parts && chosen.row_sums == c.row_sums;
    if (same) return;
    std::string suffix = ".w4a8.v2";
    if (c.stage_k_blocks > 1) suffix += ".k" + std::to_string(c.stage_k_blocks);
    if (c.parts == 2) suffix += ".p2";
    if (c.row_sums != 0) suffix += ".rs";
    variants.push_back({suffix, c});
  };
  add_v2({2});
  // Plain v2 with two and three K blocks per stage (bench/NOTES.md, W4A8 v6).
  for (const int kb : {2, 3}) add_v2({.version = 2, .stage_k_blocks = kb});
  // The 32-row decode tile with two partials (".p2"), with one and two K blocks per stage.
  if (s.masked && s.expected_m > 12 && s.expected_m <= 24) {
    add_v2({.version = 2, .parts = 2});
    add_v2({.version = 2, .stage_k_blocks = 2, .parts = 2});
  }
  // The decode tiles with the offset term from the row-sum pre-pass (".rs"; the time includes the
  // pre-pass kernel): one and two partials, two K blocks per stage.
  if (s.masked && s.expected_m <= 24) {
    add_v2({.version = 2, .row_sums = 1});
    add_v2({.version = 2, .stage_k_blocks = 2, .row_sums = 1});
    if (s.expected_m > 12) add_v2({.version = 2, .parts = 2, .row_sums = 1});
  }
  // v2 with signed codes (no offset term): 128 x 128 (".w4a8.v2.s.m128"), and the wide tile (256
  // activation rows as two waves against each converted weight block; contiguous only) as its two
  // kernels, with the half-tile loop (".w4a8.v2.s.m256.half": half_tiles = 1) and without (".nohalf": 2;
  // the automatic choice from kW4A8WideNoHalfRows rows per group, session 27).
  {
    const bool same = chosen.version == 2 && chosen.signed_codes == 1 && chosen.block_m == 128;
    if (!same && (!s.masked || s.expected_m > 24) && N % 128 == 0)
      variants.push_back({".w4a8.v2.s.m128", {.version = 2, .block_m = 128, .signed_codes = 1}});
  }
  if (!s.masked && N % 128 == 0) {
    variants.push_back(
        {".w4a8.v2.s.m256.half", {.version = 2, .block_m = 256, .signed_codes = 1, .half_tiles = 1}});
    variants.push_back(
        {".w4a8.v2.s.m256.nohalf", {.version = 2, .block_m = 256, .signed_codes = 1, .half_tiles = 2}});
  }
  if (chosen.version != 3) variants.push_back({".w4a8.v3", v3});
  // A v3 tile's line name: "m<rows>n<cols>w<waves>".
  const auto tile_name = [](const cuda::W4A8KernelChoice& c) {
    return "m" + std::to_string(c.block_m) + "n" + std::to_string(c.block_n) + "w" + std::to_string(c.waves);
  };
  // v3's tiles with the offset-binary codes (the default before session 23), for comparison.
  for (const cuda::W4A8KernelChoice c :
       {cuda::W4A8KernelChoice{3, 64, 256, 1}, cuda::W4A8KernelChoice{3, 64, 128, 1},
        cuda::W4A8KernelChoice{3, 128, 128, 1}}) {
    if (v3.signed_codes == 0 && c.block_m == v3.block_m && c.block_n == v3.block_n) continue;
    const bool near = s.masked && s.expected_m <= 24 ? c.block_m == 64
                                                     : (c.block_m == 128 || (s.masked && s.expected_m <= 64));
    if (near && N % c.block_n == 0) variants.push_back({".w4a8.v3." + tile_name(c), c});
  }
  // v3's other tiles with the signed conversion (".w4a8.v3.s.m<rows>n<cols>w<waves>": no offset term;
  // 128 x 256 with two waves per consumer, and the tall tile).
  const auto add_signed = [&](const cuda::W4A8KernelChoice& c) {
    const auto is = [&](const cuda::W4A8KernelChoice& x) {
      return x.version == 3 && x.signed_codes == 1 && c.block_m == x.block_m && c.block_n == x.block_n &&
             c.waves == x.waves;
    };
    // (Listed unless it is the ".w4a8" line, or the ".w4a8.v3" line when that one is listed.)
    const bool same = is(chosen) || (chosen.version != 3 && is(v3));
    if (!same && N % c.block_n == 0) variants.push_back({".w4a8.v3.s." + tile_name(c), c});
  };
  // (The tall tile, 256 x 128 with two 64-row waves per consumer: contiguous only.)
  if (!s.masked) add_signed({.version = 3, .block_m = 256, .block_n = 128, .waves = 2, .signed_codes = 1});
  if (!s.masked || s.expected_m > 64) {
    add_signed({.version = 3, .block_m = 128, .block_n = 256, .waves = 2, .signed_codes = 1});
    add_signed({.version = 3, .block_m = 128, .block_n = 128, .waves = 1, .signed_codes = 1});
  } else if (s.expected_m > 24) {
    add_signed({.version = 3, .block_m = 64, .block_n = 256, .waves = 1, .signed_codes = 1});
    add_signed({.version = 3, .block_m = 64, .block_n = 128, .waves = 1, .signed_codes = 1});
  }
  // EPMOE_BENCH_GEMM_EXPERIMENTS: v2 and v3 ablations on the experiment shapes (garbage output,
  // timing only; v3 = its default, the signed conversion).
  if (experiment) {
    for (const auto& [label, bits] :
         {std::pair{"noconvert", 1}, std::pair{"nofence", 2}, std::pair{"nomath", 4}, std::pair{"noload", 8},
          std::pair{"onlyload", 1 | 4}}) {
      cuda::W4A8KernelChoice c = v3;
      c.ablation = bits;
      variants.push_back({std::string(".w4a8.v3.ablate_") + label, c});
      if (!s.masked && (bits == 1 || bits == 5)) {
        c = {.version = 3, .block_m = 256, .block_n = 128, .waves = 2, .ablation = bits, .signed_codes = 1};
        variants.push_back({".w4a8.v3.s." + tile_name(c) + ".ablate_" + label, c});
      }
      if ((bits & (2 | 4)) != 0) continue;  // v2: no proxy fence, no math ablation
      c = cuda::W4A8KernelChoice{2};
      c.ablation = bits;
      variants.push_back({std::string(".w4a8.v2.ablate_") + label, c});
    }
  }
  // v2 with the codes' offset term summed by its producer-side offset warp and two K blocks per
  // stage (".w4a8.v2.offwarp.k2", bench/NOTES.md W4A8 v5), on every row beside the plain v2 line.
  // (Its one-block-per-stage line was retired in v6: slower than v2 on every row of the v5 runs.)
  {
    cuda::W4A8KernelChoice c{.version = 2, .offset_warp = 1, .stage_k_blocks = 2};
    variants.push_back({".w4a8.v2.offwarp.k2", c});
    if (experiment) {
      c.ablation = 8;  // no weight loads: is it still bound by the consumers' per-stage work?
      variants.push_back({".w4a8.v2.offwarp.k2.ablate_noload", c});
    }
  }
  // Decode rows: the choice on every SM (max_ctas = SM count) against the default, which trims the
  // CTAs to balance the tile rounds. (The two-consumer decode tiles and the offset warp's all-SM
  // line were retired in v6: 25-30% slower, and within noise of the trimmed count, in v4 / v5.)
  if (s.masked && s.groups == 128) {
    W4A8Variant all_sms{".w4a8.all_sms", chosen};
    all_sms.options.max_ctas = cuda::device_props().sm_count;
    variants.push_back(all_sms);
  }
  // Decode rows with the register-operand kernel: the choice again with per-CTA stamps (".w4a8.cta_trace",
  // timed like any line, plus the stamps of three single launches on an idle GPU: where a launch's time
  // goes besides streaming, session 21).
  if (s.masked && s.groups == 128 && chosen.version == 2) {
    cuda::W4A8KernelChoice c = chosen;
    c.ablation = cuda::kW4A8TraceCtas;
    variants.push_back({".w4a8.cta_trace", c});
  }
  // The automatic choice on the weights with the sign-magnitude codes.
  {
    W4A8Variant sm{".w4a8.sm", {}};
    sm.options.codes = cuda::W4A8Codes::sign_magnitude;
    variants.push_back(sm);
    // Masked: the sign-magnitude line again with the static schedule (W4A8GemmOptions::dynamic_tiles;
    // the offset-binary codes always run it, session 29).
    if (s.masked) {
      W4A8Variant sm_fixed{".w4a8.sm.static", {}};
      sm_fixed.options.dynamic_tiles = false;
      sm_fixed.options.codes = cuda::W4A8Codes::sign_magnitude;
      variants.push_back(sm_fixed);
    }
  }
  for (const LinePlace& l : line_order(variants)) {
    W4A8Variant& v = variants[l.line];
    if (s.masked) v.options.workspace = w4_workspace.view();
    const bool sm = v.options.codes == cuda::W4A8Codes::sign_magnitude;
    cuda::w4a8_pin_kernel(v.suffix == ".w4a8" || sm ? cuda::W4A8KernelChoice{} : v.pin);
    const TensorView w_used = sm ? pw_sm.view() : pw.view(), s_used = sm ? ps_sm.view() : ps.view();
    const auto call = [&](cudaStream_t st) {
      if (s.masked) {
        cuda::w4a8_grouped_gemm_masked(a_view, 0.01f, {}, w_used, s_used, layout_ids, s.expected_m, d_view,
                                       st, v.options);
      } else {
        cuda::w4a8_grouped_gemm_contiguous(a_view, 0.01f, {}, w_used, s_used, layout_ids, d_view, st,
                                           v.options);
      }
    };
    const double us = time_us([&](int, cudaStream_t st) { call(st); }, 1, stream, gemm_timing(options));
    Params p = base;
    add_place(p, l);
    if ((v.pin.ablation & cuda::kW4A8TraceCtas) != 0)
      add_cta_stamps(
          p, [&] { call(stream); },
          [&] { return cuda::w4a8_take_cta_trace(cuda::kW4A8TraceMaxCtas, stream); }, stream);
    cuda::w4a8_pin_kernel({});
    const cuda::W4A8KernelChoice& ran = v.pin;
    p["quant"] = std::string("w4a8");
    p["kernel"] = static_cast<std::int64_t>(ran.version);
    p["offset_warp"] = static_cast<std::int64_t>(ran.offset_warp);
    p["stage_k_blocks"] = static_cast<std::int64_t>(std::max(ran.stage_k_blocks, 1));
    p["parts"] = static_cast<std::int64_t>(ran.parts);
    p["row_sums"] = static_cast<std::int64_t>(ran.row_sums);
    p["signed_codes"] = static_cast<std::int64_t>(ran.signed_codes);
    if (ran.half_tiles != 0) p["half_tiles"] = static_cast<std::int64_t>(ran.half_tiles);
    p["codes"] = std::string(sm ? "sign_magnitude" : "offset_binary");
    if (s.masked) p["dynamic_tiles_option"] = static_cast<std::int64_t>(v.options.dynamic_tiles ? 1 : 0);
    if (ran.version == 2 && ran.signed_codes == 1) {
      p["block_m"] = static_cast<std::int64_t>(ran.block_m);
      p["block_n"] = std::int64_t{128};
    } else if (ran.version == 3) {
      p["block_m"] = static_cast<std::int64_t>(ran.block_m);
      p["block_n"] = static_cast<std::int64_t>(ran.block_n);
      p["waves"] = static_cast<std::int64_t>(ran.waves);
    } else {
      const cuda::W4A8TileShape t = cuda::w4a8_gemm_tile(s.masked, s.expected_m);
      p["block_m"] = static_cast<std::int64_t>(t.block_m);
      p["block_n"] = static_cast<std::int64_t>(64 * t.consumers);
    }
    p["fp8_us"] = fp8_us;
    p["time_vs_fp8"] = fp8_us > 0 ? us / fp8_us : 0.0;
    Result r = finish(name + v.suffix, p, us, w4_bytes, flops, s);
    for (const char* fp8_only : {"vs_deepgemm", "deepgemm_us", "vs_deepgemm_tflops", "deepgemm_tflops"})
      r.params.erase(fp8_only);  // the anchors are DeepGEMM's FP8 kernel
    emit(options, results, std::move(r));
  }
}

// The shapes the experiments run on: a large and a small contiguous one, the decode point.
bool experiment_shape(const Anchor& s) {
  return (!s.masked && s.groups == 8 && s.n == 4096) ||
         (!s.masked && s.groups == 32 && s.m == 256 && s.n == 7168) ||
         (s.masked && s.groups == 128 && s.expected_m == 8 && s.n == 4096) ||
         (s.masked && s.groups == 32 && s.expected_m == 192);  // (session 41: the swapped kernel's)
}

std::vector<Result> run_gemm_suite(const SuiteOptions& options) {
  std::vector<Result> results;
  const bool experiments_on = experiments_enabled();
  std::uint64_t seed = 2026;
  // EPMOE_BENCH_GEMM_ONLY=decode: only the masked rows with 128 groups (the W4A8 decode bar).
  const char* only = std::getenv("EPMOE_BENCH_GEMM_ONLY");
  const std::string only_s = only != nullptr ? std::string(only) : std::string();
  const bool decode_only = only_s == "decode";
  // EPMOE_BENCH_GEMM_ROW=GxMxN (e.g. 8x4096x4096): only that row (groups x m per group x n).
  const char* row = std::getenv("EPMOE_BENCH_GEMM_ROW");
  // EPMOE_BENCH_GEMM_CUSTOM=[m|r]GxMxNxK: only a contiguous (masked) problem of G groups of exactly M rows
  // (no DeepGEMM anchor), e.g. to compare one tile per CTA against many at the same work.
  std::vector<Anchor> anchors(std::begin(kAnchors), std::end(kAnchors));
  // A leading 'm' (mGxMxNxK) makes it a masked problem: G groups of M_max = M rows, all valid; a leading 'r'
  // a masked problem as the anchors' masked rows draw it: G groups of M x U(0.7, 1.3) rows, M_max the
  // smallest multiple of 256 above 1.3 M (e.g. to place a tile rule's boundary between the anchors' sizes).
  if (const char* custom = std::getenv("EPMOE_BENCH_GEMM_CUSTOM"); custom != nullptr && *custom != '\0') {
    const bool random_sizes = custom[0] == 'r';
    const bool masked = custom[0] == 'm' || random_sizes;
    long long g = 0, m = 0, n = 0, k = 0;
    EPMOE_CHECK(std::sscanf(custom + (masked ? 1 : 0), "%lldx%lldx%lldx%lld", &g, &m, &n, &k) == 4 && g > 0 &&
                    m > 0 && n > 0 && k > 0,
                "EPMOE_BENCH_GEMM_CUSTOM: expected [m|r]GxMxNxK (positive), got '{}'", custom);
    anchors = {random_sizes ? Anchor{true, g, (13 * m / 10) / 256 * 256 + 256, m, n, k, 0.0, 0.0, false}
                            : Anchor{masked, g, m, masked ? m : 0, n, k, 0.0, 0.0, true}};
  }
  for (const Anchor& s : anchors) {
    seed += 101;
    if (decode_only && !(s.masked && s.groups == 128)) continue;
    if (only_s == "contiguous" && s.masked) continue;
    if (only_s == "masked" && !s.masked) continue;
    if (row != nullptr && *row != '\0' &&
        std::to_string(s.groups) + "x" + std::to_string(s.m) + "x" + std::to_string(s.n) != row)
      continue;
    const bool experiment = experiments_on && (experiment_shape(s) || s.exact);
    if (options.quant == "w4a8") {
      run_w4a8(s, seed, options, experiment, results);
    } else if (s.masked) {
      run_masked(s, seed, options, experiment, results);
    } else {
      run_contiguous(s, seed, options, experiment, results);
    }
  }
  return results;
}

const SuiteRegistration kGemm{
    "gemm", "FP8 block-scaled grouped GEMM vs DeepGEMM (anchors.md); --quant w4a8: W4A8 vs FP8", 70,
    run_gemm_suite};

}  // namespace
}  // namespace epmoe::bench

// Tensor-core instruction throughput probe (issue 5, W4A8 decode): how many SM cycles one
// instruction costs when a CTA per SM issues nothing else, for the shapes a tiny-M W4A8 kernel
// could use; with the argument "gemm", the FP8 GEMM's consumer loop. Built as bin/epmoe_tensor_probe
// (target epmoe_tensor_probe); scripts/w4a8-device.sh, gemm-clocks.sh and gpu-check.sh run it.
//
//   rs  N W P: wgmma m64nNk32 e4m3, A from registers, B (N x 32) in shared memory; W warpgroups per
//              CTA, each issuing groups of 4 wgmma (one 128-K block) into P partial accumulators
//              with wait_group P - 1 (P groups in flight per warpgroup);
//   ss  N W P: the same with A from shared memory (64 x 32);
//   mma W:     mma.sync m16n8k32 e4m3 (warp level), W warps per CTA, 4 independent accumulators
//              per warp (the A fragment is m64's per-warp 16-row slice: the same register layout).
//   ss n128 wW pP gG +promote (argument "gemm"; the FP8 GEMM's consumer loop without loads, barriers
//              or scales, session 9): W warpgroups each issuing groups of G wgmma m64n128k32 (4 = one
//              128-column wave of a K block, 8 = two waves chained) into P partials, wait_group P - 1,
//              and with "+promote" the 64-FFMA promotion of the completed partial into a second
//              accumulator after each wait, as the GEMM does. 64 cycles per instruction per SM is
//              the dense FP8 peak.
//   ring wW sS main|tensor_only (argument "gemm", session 10): that loop inside the GEMM's barrier
//              ring (a producer warp arming S stages; optionally the scale warp's arrives and the
//              scale loads, random operands), two 128-column waves per K block (ring_probe).
// Printed: SM cycles per instruction (clock64 span of the slowest warp / instructions per SM) and
// the equivalent int4 weight bytes per cycle per SM (rs/ss: 64 x 32 weights = 1024 bytes per
// instruction; mma: 16 x 32 = 256 bytes), to compare with the ~13 bytes per cycle per SM that
// 3.5 TB/s of int4 needs.
#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>
#include <utility>

#include "cuda/ptx_hopper.cuh"

namespace ptx = epmoe::ptx;

constexpr int kIters = 2048;

__device__ std::uint32_t g_sink;

template <int N, bool kRs, int kParts, int kThreads, int kGroup = 4, bool kPromote = false,
          bool kZeroInit = false>
__global__ void __launch_bounds__(kThreads, 1) wgmma_probe(long long* cycles, float scale, int iters) {
  __shared__ alignas(1024) std::uint8_t tile[(64 + 256) * 128];  // A (64 x 128) then B (<= 256 x 128)
  for (int i = static_cast<int>(threadIdx.x); i < (64 + 256) * 128 / 4; i += static_cast<int>(blockDim.x))
    reinterpret_cast<std::uint32_t*>(tile)[i] = 0x38383838u * ((i & 1) + 1);  // e4m3 1.0 / 2.0 bytes
  __syncthreads();
  const std::uint32_t a_smem = ptx::smem_addr(tile), b_smem = a_smem + 64 * 128;
  std::uint32_t a[4] = {threadIdx.x * 0x01010101u & 0x38383838u, 0x38383838u, 0x30303030u, threadIdx.x};
  float acc[kParts][N / 2];
  float fin[kPromote ? N / 2 : 1] = {};
#pragma unroll
  for (int p = 0; p < kParts; ++p)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) acc[p][i] = 0.0f;
  // One group of kGroup wgmma into acc[slot] (slot: a constant, register arrays stay registers).
  const auto issue = [&](auto slot_v) {
    constexpr int kSlot = decltype(slot_v)::value;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) ptx::fence_operand(acc[kSlot][i]);
    ptx::wgmma_fence();
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const int s = g % 4;  // K step inside the 128-byte row; groups of 8 chain two waves
      // kZeroInit: the group's first wgmma overwrites the partial (scale-d 0), as a GEMM's per-K-block
      // partial does; else every wgmma accumulates.
      const bool accumulate = !kZeroInit || g > 0;
      if constexpr (kRs) {
        ptx::wgmma_m64k32_rs_e4m3<N>(acc[kSlot], a, ptx::wgmma_desc_sw128(b_smem + 32 * s), accumulate);
      } else {
        ptx::wgmma_m64k32_ss_e4m3<N>(acc[kSlot], ptx::wgmma_desc_sw128(a_smem + 32 * s),
                                     ptx::wgmma_desc_sw128(b_smem + 32 * s), accumulate);
      }
    }
    ptx::wgmma_commit();
  };
  // With kPromote, acc[slot] (completed) into fin as the GEMM promotes; only that partial's registers
  // are touched.
  const auto promote = [&](auto slot_v) {
    constexpr int kSlot = decltype(slot_v)::value;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) ptx::fence_operand(acc[kSlot][i]);
    if constexpr (kPromote) {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) fin[i] = fmaf(scale, acc[kSlot][i], fin[i]);
#pragma unroll
      for (int i = 0; i < N / 2; ++i) ptx::fence_operand(acc[kSlot][i]);
    }
  };
  // Waits until kParts - 1 groups are in flight, so that acc[slot]'s (the oldest) has completed.
  const auto retire = [&](auto slot_v) {
    ptx::wgmma_wait<kParts - 1>();
    promote(slot_v);
  };
  const long long t0 = clock64();
  // kParts - 1 groups in flight ahead of the loop; each step then issues one and retires the oldest.
  // The loop is a for (;;) whose every exit drains its own in-flight partials (a constant set per
  // exit): with one drain after a counted loop ptxas cannot tell which partial is in flight where
  // the paths merge, and serializes the wgmma (C7514; session 10).
  [&]<int... P>(std::integer_sequence<int, P...>) {
    (issue(std::integral_constant<int, P>{}), ...);
  }
  (std::make_integer_sequence<int, kParts - 1>{});
  // After retiring slot kRetired on the last step: the other partials, oldest first, then every
  // result into `sum` (read inside the exit branch: a read of a partial after the loop is again a
  // merge point for ptxas).
  float sum = 0.0f;
  const auto drain = [&](auto retired_v) {
    constexpr int kRetired = decltype(retired_v)::value;
    ptx::wgmma_wait<0>();
    [&]<int... Q>(std::integer_sequence<int, Q...>) {
      (promote(std::integral_constant<int, (kRetired + 1 + Q) % kParts>{}), ...);
    }
    (std::make_integer_sequence<int, kParts - 1>{});
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) sum += acc[p][i];
    }
    if constexpr (kPromote) {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) sum += fin[i];
    }
  };
  // One step: issue into the newest slot, retire slot kP; true after the last step's drain. (Every
  // step tests for the end: with one test per kParts steps ptxas serializes the p2 +promote loop.)
  int it = 0;
  const auto step = [&](auto p_v) {
    constexpr int kP = decltype(p_v)::value;
    issue(std::integral_constant<int, (kP + kParts - 1) % kParts>{});
    retire(p_v);
    if (++it == iters) {
      drain(p_v);
      return true;
    }
    return false;
  };
  for (;;) {
    const bool done = [&]<int... P>(std::integer_sequence<int, P...>) {
      return (step(std::integral_constant<int, P>{}) || ...);
    }
    (std::make_integer_sequence<int, kParts>{});
    if (done) break;
  }
  const long long t1 = clock64();
  if (sum == 1234.5f) g_sink = 1;
  if (threadIdx.x % 32 == 0) atomicMax(cycles + blockIdx.x, t1 - t0);
}

// The FP8 GEMM's pipeline around that loop (argument "gemm", session 10): warpgroup 0 a producer
// warp that only arms the stages (waits "empty", arrives on "full", no loads: the GEMM's no-loads
// ablation), kW consumer warpgroups that per K block wait on "full", issue two 128-column waves of
// 4 wgmma m64n128k32 from the stage's A (their 64 rows) and B (256 rows), and free the stage (one
// arrive per warp). kMain: each wave into one partial, waited for and promoted (64 FFMA) into its
// accumulator (here both waves into one: the probe's registers are capped at 168, the GEMM's
// consumers have 232), as the GEMM's main loop; else both waves into one partial with one wait (the GEMM's
// tensor-only ablation). kRotate: the stages at their own addresses (the GEMM), else all at one.
template <int kW, int kStages, bool kMain, bool kRotate, bool kRandom = false, bool kScaleWarp = false,
          int kSpin = 0, int kWaveN = 128>
__global__ void __launch_bounds__(128 * (kW + 1), 1) ring_probe(long long* cycles, float scale, int iters) {
  static_assert(kSpin >= 0);
  extern __shared__ __align__(1024) std::uint8_t ring_smem[];
  constexpr std::uint32_t kABytes = 128 * 128, kStageBytes = kABytes + 256 * 128;
  const std::uint32_t base = (ptx::smem_addr(ring_smem) + 1023u) & ~1023u;
  const std::uint32_t bars = base + kStages * kStageBytes;  // full[kStages], empty[kStages]
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  // kRandom: pseudo-random bytes (every e4m3 value, NaN excepted: 0x7f / 0xff become 0x7e / 0xfe), as
  // the GEMM's real operands; else 1.0 / 2.0 everywhere.
  for (std::uint32_t i = threadIdx.x; i < kStages * kStageBytes / 4; i += blockDim.x) {
    std::uint32_t v = 0x38383838u * ((i & 1) + 1);
    if constexpr (kRandom) {
      v = (i + 0x9e3779b9u * blockIdx.x) * 0x85ebca6bu;
      v ^= v >> 13;
      v *= 0xc2b2ae35u;
      v ^= v >> 16;
      v &= ~((v & 0x7f7f7f7fu) + 0x01010101u & 0x80808080u) >> 7;  // clear bit 0 of 0x7f-low bytes
    }
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(base + 4 * i), "r"(v) : "memory");
  }
  if (threadIdx.x == 0) {
    for (int st = 0; st < kStages; ++st) {
      // kScaleWarp: the GEMM's scale warp too, 32 cp.async-completion arrives per stage (no copies),
      // and the consumers read 4 scales per K block from the stage.
      ptx::mbar_init(bars + 8 * st, kScaleWarp ? 33 : 1);
      ptx::mbar_init(bars + 8 * (kStages + st), 4 * kW);
    }
    ptx::fence_barrier_init();
  }
  ptx::fence_proxy_async_shared();
  __syncthreads();
  if (warp < 4) {
    ptx::setmaxnreg_dec<40>();  // the GEMM's register split
    if (warp == 0 && lane == 0) {
      for (int kb = 0; kb < iters; ++kb) {
        const int st = kb % kStages;
        const std::uint32_t phase = static_cast<std::uint32_t>(kb / kStages) & 1u;
        ptx::mbar_wait(bars + 8 * (kStages + st), phase ^ 1u);
        ptx::mbar_arrive(bars + 8 * st);
      }
    }
    if (kScaleWarp && warp == 1) {
      for (int kb = 0; kb < iters; ++kb) {
        const int st = kb % kStages;
        const std::uint32_t phase = static_cast<std::uint32_t>(kb / kStages) & 1u;
        ptx::mbar_wait(bars + 8 * (kStages + st), phase ^ 1u);
        ptx::cp_async_mbar_arrive_noinc(bars + 8 * st);
      }
    }
  } else {
    ptx::setmaxnreg_inc<232>();
    const int consumer = warp / 4 - 1;
    // kWaveN = 128: two 128-column waves per K block (the 128 x 256 GEMM); 192: one 192-column wave.
    constexpr int kWaves = kWaveN == 128 ? 2 : 1;
    constexpr int kR = kWaveN / 2;  // accumulator registers per wave
    float part[kR], acc[kWaves][kR];
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      part[i] = 0.0f;
#pragma unroll
      for (int w = 0; w < kWaves; ++w) acc[w][i] = 0.0f;
    }
    const long long t0 = clock64();
    for (int kb = 0; kb < iters; ++kb) {
      const int st = kb % kStages;
      const std::uint32_t phase = static_cast<std::uint32_t>(kb / kStages) & 1u;
      ptx::mbar_wait(bars + 8 * st, phase);
      const std::uint32_t stage = base + (kRotate ? st * kStageBytes : 0u);
      const std::uint32_t a = stage + consumer * 64 * 128, b = stage + kABytes;
      float s_k = scale;
      if constexpr (kScaleWarp) {
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = ptx::ld_shared_f32(stage + 4 * (lane + 32 * j));
        s_k = v[0] * v[1] + v[2] * v[3];
      }
#pragma unroll
      for (int w = 0; w < kWaves; ++w) {
        if (kMain || w == 0) {
#pragma unroll
          for (int i = 0; i < kR; ++i) ptx::fence_operand(part[i]);
          ptx::wgmma_fence();
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          ptx::wgmma_m64k32_ss_e4m3<kWaveN>(part, ptx::wgmma_desc_sw128(a + 32 * kk),
                                            ptx::wgmma_desc_sw128(b + w * kWaveN * 128 + 32 * kk),
                                            kk > 0 || (!kMain && w > 0));
        if (!kMain && w < kWaves - 1) continue;
        ptx::wgmma_commit();
        ptx::wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < kR; ++i) ptx::fence_operand(part[i]);
        if (w == kWaves - 1) {
          __syncwarp();
          if (lane == 0) ptx::mbar_arrive(bars + 8 * (kStages + st));
          // kSpin: this many cycles more per K block (is the loop's latency hidden by the other
          // warpgroup's wgmma?)
          if constexpr (kSpin > 0) {
            const long long spin0 = clock64();
            while (clock64() - spin0 < kSpin) {
            }
          }
        }
        if constexpr (kMain) {
          // Both waves into acc[0] (as the session-10 lines did): a second 64-register accumulator
          // does not fit beside the partial in this kernel's consumer registers (ptxas spills; the
          // GEMM itself holds it).
#pragma unroll
          for (int i = 0; i < kR; ++i) acc[0][i] = fmaf(s_k, part[i], acc[0][i]);
        } else {
          acc[w][0] = fmaf(s_k, part[0], acc[w][0]);
        }
#pragma unroll
        for (int i = 0; i < kR; ++i) ptx::fence_operand(part[i]);
      }
    }
    const long long t1 = clock64();
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < kR; ++i)
#pragma unroll
      for (int w = 0; w < kWaves; ++w) s += acc[w][i];
    if (s == 1234.5f) g_sink = 1;
    if (lane == 0) atomicMax(cycles + blockIdx.x, t1 - t0);
  }
}

__global__ void __launch_bounds__(1024, 1) mma_probe(long long* cycles) {
  std::uint32_t a[4] = {threadIdx.x * 0x01010101u & 0x38383838u, 0x38383838u, 0x30303030u, threadIdx.x};
  std::uint32_t b[2] = {0x38383838u, threadIdx.x & 0x30303030u};
  float acc[4][4] = {};
  const long long t0 = clock64();
#pragma unroll 1
  for (int it = 0; it < kIters * 4; ++it) {
#pragma unroll
    for (int p = 0; p < 4; ++p) ptx::mma_m16n8k32_e4m3(acc[p], a, b);
  }
  const long long t1 = clock64();
  float s = 0.0f;
  for (int p = 0; p < 4; ++p)
    for (int i = 0; i < 4; ++i) s += acc[p][i];
  if (s == 1234.5f) g_sink = 1;
  if (threadIdx.x % 32 == 0) atomicMax(cycles + blockIdx.x, t1 - t0);
}

template <class F>
void measure(const char* what, int threads, double instr_per_sm, double bytes_per_instr, F kernel, int sms) {
  long long* d = nullptr;
  cudaMalloc(&d, sms * sizeof(long long));
  cudaMemset(d, 0, sms * sizeof(long long));
  kernel(d, sms, threads);  // warm-up
  cudaMemset(d, 0, sms * sizeof(long long));
  kernel(d, sms, threads);
  const cudaError_t e = cudaDeviceSynchronize();
  long long h[1024] = {};
  cudaMemcpy(h, d, sms * sizeof(long long), cudaMemcpyDeviceToHost);
  long long mx = 0;
  for (int i = 0; i < sms; ++i) mx = h[i] > mx ? h[i] : mx;
  const double per = static_cast<double>(mx) / instr_per_sm;
  std::printf("%-12s threads %4d  %8.1f cycles/instr/SM  %6.1f int4 B/cycle/SM  %s\n", what, threads, per,
              bytes_per_instr / per, e == cudaSuccess ? "" : cudaGetErrorString(e));
  cudaFree(d);
}

template <int N, bool kRs, int kParts, int kW, int kGroup = 4, bool kPromote = false, bool kZeroInit = false>
void wg(int sms) {
  constexpr int w = kW;
  char name[96];
  std::snprintf(name, sizeof name, "%s n%d w%d p%d g%d%s%s", kRs ? "rs" : "ss", N, w, kParts, kGroup,
                kPromote ? " +promote" : "", kZeroInit ? " +zero" : "");
  measure(
      name, 128 * w, static_cast<double>(kIters) * kGroup * w, 1024.0,
      [](long long* c, int blocks, int threads) {
        wgmma_probe<N, kRs, kParts, 128 * kW, kGroup, kPromote, kZeroInit>
            <<<blocks, threads>>>(c, 0.5f, kIters);
      },
      sms);
}

template <int kW, int kStages, bool kMain, bool kRotate, bool kRandom = false, bool kScaleWarp = false,
          int kSpin = 0, int kWaveN = 128>
void ring(int sms) {
  constexpr int kSmem = 1024 + kStages * (128 * 128 + 256 * 128) + 16 * kStages;
  cudaFuncSetAttribute(ring_probe<kW, kStages, kMain, kRotate, kRandom, kScaleWarp, kSpin, kWaveN>,
                       cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  char name[96];
  std::snprintf(name, sizeof name, "ring w%d s%d %s%s%s%s spin%d", kW, kStages,
                kMain ? "main" : "tensor_only", kRotate ? "" : " one-stage-address",
                kRandom ? " random-data" : "", kScaleWarp ? " +scale-warp" : "", kSpin);
  measure(
      // In m64n128k32-equivalents (64 cycles = the dense peak for either wave width).
      name, 128 * (kW + 1), static_cast<double>(kIters) * 8 * kW * (kWaveN == 128 ? 1.0 : 192.0 / 256.0),
      1024.0,
      [](long long* c, int blocks, int threads) {
        ring_probe<kW, kStages, kMain, kRotate, kRandom, kScaleWarp, kSpin, kWaveN>
            <<<blocks, threads, kSmem>>>(c, 0.5f, kIters);
      },
      sms);
}

// The FP8 GEMM's consumer loop in isolation (argument "gemm"): how busy two (or three) warpgroups
// keep the tensor cores with one partial and wait_group 0 per 128-column wave, as the 128 x 256 kernel
// does, against two partials in flight, a third warpgroup, and two waves chained per wait.
// ptxas serializes the wgmma of `w2 p2 g4 +promote` (C7514: the promotion reads a partial while the
// other partial's group is in flight), so that line times serialized wgmma.
void gemm_loop(int sms) {
  wg<128, false, 1, 2, 4, false>(sms);
  wg<128, false, 1, 2, 4, true>(sms);
  // m64n192k32 (peak: 96 cycles per instruction): one 192-column wave per wait, with the promotion.
  wg<192, false, 1, 2, 4, false>(sms);
  wg<192, false, 1, 2, 4, true>(sms);
  wg<128, false, 1, 2, 8, false>(sms);
  wg<128, false, 1, 2, 8, true>(sms);
  wg<128, false, 2, 2, 4, false>(sms);
  wg<128, false, 2, 2, 4, true>(sms);
  wg<128, false, 1, 3, 4, false>(sms);
  wg<128, false, 1, 3, 4, true>(sms);
  wg<128, false, 1, 1, 4, true>(sms);
  // Session 10: the partial zero-initialised by the group's first wgmma (as the GEMM does), and
  // 64-column waves, whose two partials (2 x 32 registers) fit beside a 128 x 256 tile's accumulators.
  wg<128, false, 1, 2, 4, true, true>(sms);
  wg<128, false, 2, 2, 4, true, true>(sms);
  wg<64, false, 1, 2, 4, true, true>(sms);
  wg<64, false, 2, 2, 4, false, true>(sms);
  wg<64, false, 2, 2, 4, true, true>(sms);
  wg<64, false, 2, 2, 4, true, false>(sms);
  // The pipeline around it (no loads): is the barrier ring what the tensor-only GEMM loses?
  ring<2, 4, false, true>(sms);
  ring<2, 4, false, false>(sms);
  ring<2, 4, true, true>(sms);
  ring<2, 4, true, false>(sms);
  ring<2, 4, false, true, true>(sms);
  ring<2, 4, true, true, true>(sms);
  ring<2, 4, false, true, true, true>(sms);
  ring<2, 4, true, true, true, true>(sms);
  // Session 11: 200 / 400 cycles more per K block in each consumer warp (the GEMM's ablation 512).
  ring<2, 4, false, true, true, false, 200>(sms);
  ring<2, 4, false, true, true, false, 400>(sms);
  ring<2, 4, true, true, true, true, 200>(sms);
  // One 192-column wave per K block (a 128 x 192 tile), tensor only (its main loop spills here).
  ring<2, 4, false, true, true, true, 0, 192>(sms);
}

int main(int argc, char** argv) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  if (argc > 1 && std::string(argv[1]) == "gemm") {
    gemm_loop(sms);
    return 0;
  }
  const auto small = [&](auto w) {
    constexpr int W = decltype(w)::value;
    wg<8, true, 1, W>(sms);
    wg<8, true, 2, W>(sms);
    wg<8, true, 4, W>(sms);
    wg<16, true, 1, W>(sms);
    wg<16, true, 2, W>(sms);
    wg<16, true, 4, W>(sms);
    wg<32, true, 2, W>(sms);
  };
  small(std::integral_constant<int, 1>{});
  small(std::integral_constant<int, 2>{});
  small(std::integral_constant<int, 4>{});
  wg<128, true, 2, 1>(sms);
  wg<128, true, 2, 2>(sms);
  wg<128, false, 2, 1>(sms);
  wg<128, false, 2, 2>(sms);
  for (int w : {4, 8, 16, 32})
    measure((std::string("mma w") + std::to_string(w)).c_str(), 32 * w, static_cast<double>(kIters) * 16 * w,
            256.0, [](long long* c, int blocks, int threads) { mma_probe<<<blocks, threads>>>(c); }, sms);
  return 0;
}

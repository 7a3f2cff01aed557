// Device helpers shared by the kernels: vector memory access, memory-model flags, clocks, warp
// reductions and number-format conversions. The one place for inline PTX (Hopper's TMA, mbarrier
// and wgmma wrappers: ptx_hopper.cuh); include only from .cuh/.cu device code.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace epmoe::ptx {

// ---------------------------------------------------------------- memory
// 16-byte load of data that this kernel only reads (read-only path, no L1 allocation: streaming
// inputs are read once). p must be 16-byte aligned.
__device__ __forceinline__ uint4 ld_nc_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 8-byte store; p must be 8-byte aligned.
__device__ __forceinline__ void st_v2(void* p, uint2 v) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}

// ---------------------------------------------------------------- memory model (communication flags)
// 32-bit acquire load / release store at system scope: flags a peer GPU (or the host) writes or reads.
__device__ __forceinline__ std::uint32_t ld_acquire_sys(const std::uint32_t* p) {
  std::uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(std::uint32_t* p, std::uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// 64-bit strong relaxed load / store at system scope: naturally aligned, so single-copy atomic (a
// reader sees a whole word of one writer), without ordering the accesses around them.
__device__ __forceinline__ std::uint64_t ld_relaxed_sys_u64(const std::uint64_t* p) {
  std::uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed_sys_u64(std::uint64_t* p, std::uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// ---------------------------------------------------------------- programmatic dependent launch
// In a kernel launched as a programmatic dependent launch (cuda/pdl_launch.hpp): wait until the
// stream's preceding kernel has completed and its writes are visible (returns at once in a kernel
// launched without the attribute) ...
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
// ... and let the stream's next kernel's blocks be scheduled now (they wait in grid_dependency_wait).
__device__ __forceinline__ void launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Bring the line holding p into L2 (no register result, nothing waits for it): for a line that a
// later atomic or store of the kernel will touch, so that it does not miss then.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// ---------------------------------------------------------------- clocks and lanes
// The global nanosecond timer (timeouts, watchdogs).
__device__ __forceinline__ std::uint64_t global_timer_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// The same read as a compiler barrier for memory ("memory" clobber): a phase stamp stays between the
// memory operations before and after it in program order.
__device__ __forceinline__ std::uint64_t global_timer_ns_ordered() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
  return t;
}
// This SM's cycle counter, as a compiler barrier for memory like global_timer_ns_ordered (phase
// stamps inside one SM: the counters of different SMs are not aligned).
__device__ __forceinline__ std::uint64_t clock_ordered() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
  return t;
}
// The SM this thread runs on.
__device__ __forceinline__ std::uint32_t sm_id() {
  std::uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}
// Bits of the lanes below this one.
__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// An opaque copy: the compiler can no longer see where v came from, so it neither hoists nor
// rematerializes the computation behind it (a value that would otherwise hold registers across a loop).
template <typename T>
__device__ __forceinline__ void opaque(T& v) {
  static_assert(sizeof(T) == 4, "a 32-bit register");
  asm volatile("" : "+r"(v));
}

// ---------------------------------------------------------------- fast math (MUFU approximations)
// 2^x, about 2 ulp, subnormal inputs and results flushed to zero (ex2.approx.ftz.f32).
__device__ __forceinline__ float ex2_approx_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// 1 / x, about 1 ulp, subnormals flushed to zero (rcp.approx.ftz.f32).
__device__ __forceinline__ float rcp_approx_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------- carries
// count + the carry out of a + b (64-bit): three adds with carry, where a 64-bit compare and select
// takes four (with b = ~c the carry is 1 exactly when a > c).
__device__ __forceinline__ int add_carry_out(int count, std::uint64_t a, std::uint64_t b) {
  asm("{\n\t.reg .u32 t;\n\t"
      "add.cc.u32 t, %1, %2;\n\t"
      "addc.cc.u32 t, %3, %4;\n\t"
      "addc.u32 %0, %0, 0;\n\t}"
      : "+r"(count)
      : "r"(static_cast<std::uint32_t>(a)), "r"(static_cast<std::uint32_t>(b)),
        "r"(static_cast<std::uint32_t>(a >> 32)), "r"(static_cast<std::uint32_t>(b >> 32)));
  return count;
}
// count + the carry out of a + b (32-bit): two instructions.
__device__ __forceinline__ int add_carry_out(int count, std::uint32_t a, std::uint32_t b) {
  asm("{\n\t.reg .u32 t;\n\t"
      "add.cc.u32 t, %1, %2;\n\t"
      "addc.u32 %0, %0, 0;\n\t}"
      : "+r"(count)
      : "r"(a), "r"(b));
  return count;
}

// ---------------------------------------------------------------- warp reductions
// Reduce over aligned groups of kWidth consecutive lanes (kWidth a power of two <= 32); every
// lane of a group gets the result. All 32 lanes of the warp must execute the call.
template <int kWidth>
__device__ __forceinline__ float group_max(float v) {
  static_assert(kWidth >= 1 && kWidth <= 32 && (kWidth & (kWidth - 1)) == 0);
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Per-16-bit-half unsigned max over aligned groups of kWidth lanes.
template <int kWidth>
__device__ __forceinline__ std::uint32_t group_max_u16x2(std::uint32_t v) {
  static_assert(kWidth >= 1 && kWidth <= 32 && (kWidth & (kWidth - 1)) == 0);
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset /= 2)
    v = __vmaxu2(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// ---------------------------------------------------------------- number formats
// Per-half |x| of two packed bf16 values, as raw bits. Non-negative bf16 bit patterns order like
// unsigned integers, so __vmaxu2 over these is an exact max of magnitudes (NaN inputs excepted).
__device__ __forceinline__ std::uint32_t bf16x2_abs_bits(std::uint32_t v) {
  return v & 0x7fff7fffu;
}

// The larger 16-bit half of v, as the f32 value of that bf16 bit pattern.
__device__ __forceinline__ float bf16_bits_max_to_float(std::uint32_t v) {
  const std::uint32_t m = max(v & 0xffffu, v >> 16);
  return __uint_as_float(m << 16);
}

// The two bf16 values of a packed pair as f32 (element 0 is the low half), exactly.
__device__ __forceinline__ float2 bf16x2_to_float2(std::uint32_t v) {
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}

// The inverse: lo and hi rounded to bf16 (nearest-even) and packed, lo in the low half.
__device__ __forceinline__ std::uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const std::uint32_t*>(&v);
}

// Smallest power of two >= s, exactly, for finite positive normal s.
__device__ __forceinline__ float round_up_pow2(float s) {
  std::uint32_t u = __float_as_uint(s);
  if ((u & 0x007fffffu) != 0u) u = (u & 0xff800000u) + 0x00800000u;
  return __uint_as_float(u);
}

// Two f32 values -> two e4m3 bytes (a in the low byte): round to nearest-even, saturating to
// ±448 (cvt.rn.satfinite.e4m3x2.f32), as __nv_fp8_e4m3(float) does.
__device__ __forceinline__ std::uint16_t float2_to_e4m3x2(float a, float b) {
  return static_cast<std::uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
}

// ---------------------------------------------------------------- register fragments
// Transposes an 8 x 8 matrix of 16-bit values held by the warp as an mma fragment (lane l: row l / 4,
// columns 2 (l % 4) and + 1, one 32-bit register): afterwards lane l holds row l / 4 of the
// transpose. Warp-collective (movmatrix.sync.aligned, sm_75+).
__device__ __forceinline__ std::uint32_t movmatrix_trans_b16(std::uint32_t v) {
  std::uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(v));
  return r;
}

}  // namespace epmoe::ptx

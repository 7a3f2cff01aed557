// Multi-rank GPU tests (tests/comm_ranks): one process per GPU under `epmoe launch -n N`, every
// test collective over the world communicator. Each rank generates the inputs of all ranks from
// the same seeds, runs the CPU simulation ("cpu-sim") over all of them, and compares its own
// received data byte for byte (and its combine within 1e-2) with the simulation's.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "epmoe/comm.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/dispatch.hpp"

namespace epmoe::ranks {

Communicator& world();  // this rank's communicator (loopback: the calling thread's rank)
std::shared_ptr<Communicator> world_ptr();
// Runs a test's body as every rank: once (one process per rank), or on one thread per rank with
// that rank as world() (EPMOE_LOOPBACK_RANKS). Every TEST body of the multi-rank suite goes through it.
void on_ranks(const std::function<void()>& body);
// The randomized tests' seed, the same on every rank of a run (printed at start and in every failure
// message; EPMOE_TEST_SEED sets it).
std::uint64_t test_seed();
// An input's seed: `salt` (which input of a test) mixed with test_seed(), so that every rank draws the
// same inputs and every run fresh ones (design.md section 8), and one salt the same inputs twice.
std::uint64_t input_seed(std::uint64_t salt);
// A fresh NCCL unique id, drawn by rank 0 and broadcast over world() (collective; NCCL ranks only), for
// tests that make communicators of their own.
ncclUniqueId shared_nccl_id();

enum class Routing { random, same_experts, first_rank_only };

struct RankInput {
  HostTensor x, scales, ids, weights;
  float tensor_scale = 1.0f;
  DispatchInput view() const { return {x, scales, tensor_scale, ids, weights}; }
};

// Inputs of every rank, drawn from input_seed(salt): x random in ±3, quantized as `format` wants; ids
// distinct per token:
//   random           uniform over the physical experts;
//   same_experts     every token has the same K experts (all tokens to one expert set);
//   first_rank_only  only experts of rank 0 (the other ranks receive nothing).
std::vector<RankInput> make_inputs(const MoeConfig& c, ActivationFormat format,
                                   const std::vector<std::int64_t>& tokens, std::uint64_t salt,
                                   Routing routing);

// The same data on this rank's GPU (empty tensors stay empty views).
struct DeviceInput {
  cuda::DeviceTensor x, scales, ids, weights;
  float tensor_scale = 1.0f;
  DispatchInput view() const;
};
DeviceInput to_device(const RankInput& in, cudaStream_t stream);
// Copies into existing device tensors of the same shapes (for graph replays).
void copy_into(DeviceInput& dst, const RankInput& src, cudaStream_t stream);

// The received data of a GPU dispatch, on the host (after a bounded synchronize).
struct HostOutput {
  DispatchOutput view;  // host views into the tensors below
  HostTensor rows, scales, m_indices, masked_m, row_token, row_weight;
};
HostOutput download(const DispatchOutput& device, cudaStream_t stream);

// Byte-for-byte comparison of the received data (valid rows only for rows / scales / weights;
// m_indices, masked_m and row_token everywhere). num_recv_tokens is compared when `got` knows it.
void expect_same_dispatch(const DispatchOutput& got, const DispatchOutput& want, const std::string& what);

// A stand-in runner: out[row][h] = bf16(value(row, h) * (1 + e / 4)) for a row of local expert e
// (value: the dequantized activation); rows that hold no token are NaN (never read by a combine).
HostTensor fake_expert_out(const DispatchOutput& host_out, const MoeConfig& c);

// rel_l2 over the whole tensor hides one row gone wrong among many (a combine that drops one (token, k)
// pair of a small weight moves it by that token's error over about sqrt(T)): worst_row_rel_l2 is the
// largest relative L2 error of a row (a token of y, the leading dimension) whose reference is not all
// zero, and worst_row that row (-1: none).
struct Diff {
  double rel_l2 = 0, worst_row_rel_l2 = 0;
  std::int64_t worst_row = -1;
  std::int64_t non_finite = 0, bit_mismatches = 0;
};
Diff compare_bf16(const HostTensor& got, const HostTensor& want);

}  // namespace epmoe::ranks

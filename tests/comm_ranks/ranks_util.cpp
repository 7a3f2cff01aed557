#include "ranks_util.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "epmoe/quant.hpp"

namespace epmoe::ranks {

ncclUniqueId shared_nccl_id() {
  ncclUniqueId id{};
  if (world().rank() == 0) {
    const ncclResult_t drawn = ncclGetUniqueId(&id);
    EPMOE_CHECK(drawn == ncclSuccess, "ncclGetUniqueId: {}", ncclGetErrorString(drawn));
  }
  const cuda::DeviceBuffer shared(sizeof(id));
  const cudaStream_t stream = world().stream();
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(shared.data(), &id, sizeof(id), cudaMemcpyHostToDevice, stream));
  world().complete_nccl(
      ncclBroadcast(shared.data(), shared.data(), sizeof(id), ncclUint8, 0, world().nccl(), stream),
      "ncclBroadcast of a test's NCCL id");
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(&id, shared.data(), sizeof(id), cudaMemcpyDeviceToHost, stream));
  world().synchronize(CommPhase::none, "a test's NCCL id");
  return id;
}

std::vector<RankInput> make_inputs(const MoeConfig& c, ActivationFormat format,
                                   const std::vector<std::int64_t>& tokens, std::uint64_t salt,
                                   Routing routing) {
  std::mt19937_64 rng(input_seed(salt));
  std::uniform_real_distribution<float> val(-3.0f, 3.0f);
  const int P = c.num_physical_experts(), L = c.num_local_experts(), K = c.topk;
  // Rank 0 alone must hold K distinct experts per token; with fewer (the tiny dims at 8 ranks: 24
  // physical experts, 3 local, top-4) the draw below would never end.
  EPMOE_CHECK(routing != Routing::first_rank_only || K <= L,
              "Routing::first_rank_only needs top-k = {} distinct experts on rank 0, which holds only {} "
              "local experts ({} physical over {} ranks)",
              K, L, P, c.num_ranks);
  std::uniform_int_distribution<int> any(0, P - 1), first(0, L - 1);
  std::vector<int> shared;
  while (static_cast<int>(shared.size()) < K) {
    const int id = any(rng);
    if (std::find(shared.begin(), shared.end(), id) == shared.end()) shared.push_back(id);
  }
  std::vector<RankInput> out;
  for (const std::int64_t T : tokens) {
    RankInput b;
    HostTensor xf(DType::f32, {T, c.hidden});
    for (std::int64_t i = 0; i < xf.numel(); ++i) xf.data<float>()[i] = val(rng);
    if (format == ActivationFormat::bf16) {
      b.x = to_bf16(xf);
    } else if (format == ActivationFormat::fp8_group) {
      b.x = HostTensor(DType::fp8_e4m3, {T, c.hidden});
      b.scales = HostTensor(DType::f32, {T, c.hidden / 128});
      quantize_per_token_group_fp8(xf, b.x, b.scales);
    } else {
      b.x = HostTensor(DType::fp8_e4m3, {T, c.hidden});
      b.tensor_scale = 3.0f / 448.0f;
      quantize_per_tensor_fp8(xf, b.x, b.tensor_scale);
    }
    b.ids = HostTensor(DType::i32, {T, K});
    b.weights = HostTensor(DType::f32, {T, K});
    for (std::int64_t t = 0; t < T; ++t) {
      std::set<int> used;
      for (int k = 0; k < K; ++k) {
        int id = 0;
        if (routing == Routing::same_experts) {
          id = shared[static_cast<std::size_t>(k)];
        } else {
          do id = routing == Routing::random ? any(rng) : first(rng);
          while (used.count(id));
        }
        used.insert(id);
        b.ids.data<std::int32_t>()[t * K + k] = id;
        b.weights.data<float>()[t * K + k] = 0.05f + 0.9f * std::uniform_real_distribution<float>(0, 1)(rng);
      }
    }
    out.push_back(std::move(b));
  }
  return out;
}

namespace {
cuda::DeviceTensor upload(const HostTensor& h, cudaStream_t stream) {
  if (!h.defined()) return {};
  return cuda::to_device(h, stream);
}
}  // namespace

DispatchInput DeviceInput::view() const {
  return {x.view(), scales.defined() ? scales.view() : TensorView{}, tensor_scale, ids.view(),
          weights.view()};
}

DeviceInput to_device(const RankInput& in, cudaStream_t stream) {
  DeviceInput d;
  d.x = upload(in.x, stream);
  d.scales = upload(in.scales, stream);
  d.ids = upload(in.ids, stream);
  d.weights = upload(in.weights, stream);
  d.tensor_scale = in.tensor_scale;
  return d;
}

void copy_into(DeviceInput& dst, const RankInput& src, cudaStream_t stream) {
  cuda::copy(dst.x, src.x, stream);
  if (src.scales.defined()) cuda::copy(dst.scales, src.scales, stream);
  cuda::copy(dst.ids, src.ids, stream);
  cuda::copy(dst.weights, src.weights, stream);
  dst.tensor_scale = src.tensor_scale;
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

HostOutput download(const DispatchOutput& d, cudaStream_t stream) {
  world().synchronize(CommPhase::none, "the dispatch to finish");
  HostOutput h;
  auto get = [&](const TensorView& v) { return v.rank > 0 ? cuda::to_host(v, stream) : HostTensor(); };
  h.rows = get(d.rows);
  h.scales = get(d.scales);
  h.m_indices = get(d.m_indices);
  h.masked_m = get(d.masked_m);
  h.row_token = get(d.row_token);
  h.row_weight = get(d.row_weight);
  h.view = d;
  h.view.rows = h.rows;
  h.view.scales = h.scales.defined() ? h.scales.view() : TensorView{};
  h.view.m_indices = h.m_indices.defined() ? h.m_indices.view() : TensorView{};
  h.view.masked_m = h.masked_m.defined() ? h.masked_m.view() : TensorView{};
  h.view.row_token = h.row_token;
  h.view.row_weight = h.row_weight;
  return h;
}

void expect_same_dispatch(const DispatchOutput& got, const DispatchOutput& want, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(got.layout, want.layout);
  EXPECT_EQ(got.num_local_experts, want.num_local_experts);
  if (got.num_recv_tokens >= 0) {
    EXPECT_EQ(got.num_recv_tokens, want.num_recv_tokens);
  }
  const std::int64_t rows = want.num_output_rows();
  ASSERT_EQ(got.num_output_rows(), rows);
  const std::int64_t H = want.rows.size(want.rows.rank - 1);
  const std::size_t row_bytes = static_cast<std::size_t>(H) * dtype_size(want.rows.dtype);
  const std::int64_t G = want.scales.rank > 0 ? want.scales.size(want.scales.rank - 1) : 0;
  const auto* gt = got.row_token.as<std::int32_t>();
  const auto* wt = want.row_token.as<std::int32_t>();
  std::int64_t token_mismatch = 0, data_mismatch = 0, first_bad = -1;
  if (want.layout == Layout::contiguous) {
    EXPECT_EQ(got.expert_offsets, want.expert_offsets);
    std::int64_t m_mismatch = 0;
    for (std::int64_t r = 0; r < rows; ++r)
      m_mismatch += got.m_indices.as<std::int32_t>()[r] != want.m_indices.as<std::int32_t>()[r];
    EXPECT_EQ(m_mismatch, 0) << "m_indices differ";
  } else {
    const std::int64_t L = want.masked_m.size(0);
    for (std::int64_t e = 0; e < L; ++e)
      EXPECT_EQ(got.masked_m.as<std::int32_t>()[e], want.masked_m.as<std::int32_t>()[e])
          << "masked_m[" << e << "]";
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    if (gt[r] != wt[r]) {
      ++token_mismatch;
      if (first_bad < 0) first_bad = r;
      continue;
    }
    if (wt[r] < 0) continue;
    const char* gr = static_cast<const char*>(got.rows.data) + r * static_cast<std::int64_t>(row_bytes);
    const char* wr = static_cast<const char*>(want.rows.data) + r * static_cast<std::int64_t>(row_bytes);
    bool same = std::memcmp(gr, wr, row_bytes) == 0;
    same = same && std::memcmp(&got.row_weight.as<float>()[r], &want.row_weight.as<float>()[r], 4) == 0;
    if (G > 0)
      same = same && std::memcmp(got.scales.as<float>() + r * G, want.scales.as<float>() + r * G, 4 * G) == 0;
    if (!same) {
      ++data_mismatch;
      if (first_bad < 0) first_bad = r;
    }
  }
  EXPECT_EQ(token_mismatch, 0) << "row_token differs in " << token_mismatch << " of " << rows
                               << " rows (first " << first_bad << ": got "
                               << (first_bad >= 0 ? gt[first_bad] : 0) << ", want "
                               << (first_bad >= 0 ? wt[first_bad] : 0) << ")";
  EXPECT_EQ(data_mismatch, 0) << "row data / scales / weight differ in " << data_mismatch << " rows (first "
                              << first_bad << ")";
}

HostTensor fake_expert_out(const DispatchOutput& o, const MoeConfig& c) {
  const std::int64_t rows = o.num_output_rows(), H = c.hidden;
  HostTensor out(DType::bf16, {rows, H});
  const std::int64_t M = o.layout == Layout::masked ? o.rows.size(1) : 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    bf16* dst = out.data<bf16>() + r * H;
    const std::int32_t token = o.row_token.as<std::int32_t>()[r];
    if (token < 0) {
      for (std::int64_t h = 0; h < H; ++h) dst[h] = bf16{0x7fc0};
      continue;
    }
    const int e =
        o.layout == Layout::contiguous ? o.m_indices.as<std::int32_t>()[r] : static_cast<int>(r / M);
    const float gain = 1.0f + 0.25f * static_cast<float>(e);
    for (std::int64_t h = 0; h < H; ++h) {
      float v;
      if (o.rows.dtype == DType::bf16) {
        v = static_cast<const bf16*>(o.rows.data)[r * H + h].to_float();
      } else {
        v = static_cast<const fp8_e4m3*>(o.rows.data)[r * H + h].to_float();
        v *= o.scales.rank > 0 ? o.scales.as<float>()[r * (H / 128) + h / 128] : o.tensor_scale;
      }
      dst[h] = bf16::from_float(v * gain);
    }
  }
  return out;
}

Diff compare_bf16(const HostTensor& got, const HostTensor& want) {
  Diff d;
  const std::int64_t rows = want.numel() > 0 ? want.size(0) : 0;
  const std::int64_t per_row = rows > 0 ? want.numel() / rows : 0;
  double num = 0, den = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    double row_num = 0, row_den = 0;
    for (std::int64_t i = r * per_row; i < (r + 1) * per_row; ++i) {
      const float g = got.data<bf16>()[i].to_float(), w = want.data<bf16>()[i].to_float();
      if (!std::isfinite(g)) {
        ++d.non_finite;
        continue;
      }
      d.bit_mismatches += got.data<bf16>()[i].bits != want.data<bf16>()[i].bits;
      row_num += (static_cast<double>(g) - w) * (static_cast<double>(g) - w);
      row_den += static_cast<double>(w) * w;
    }
    num += row_num;
    den += row_den;
    if (row_den > 0) {
      const double row_rel_l2 = std::sqrt(row_num / row_den);
      if (d.worst_row < 0 || row_rel_l2 > d.worst_row_rel_l2) {
        d.worst_row_rel_l2 = row_rel_l2;
        d.worst_row = r;
      }
    }
  }
  d.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return d;
}

}  // namespace epmoe::ranks

// The communication runtime's host side, without GPUs: NCCL version check and its message, unique
// ids (hex, files), the launch environment, the NVLS policy, device-error messages, and the GPU
// dispatchers' registration.
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "epmoe/comm.hpp"
#include "epmoe/comm_dispatch.hpp"
#include "epmoe/dispatch.hpp"
#include "expect_error.hpp"
#include "scoped_env.hpp"

namespace epmoe {
namespace {

using testing::ScopedEnv;

using testing::message_of;

std::string temp_path(const std::string& stem) {
  const char* tmp = std::getenv("TMPDIR");
  return std::string(tmp != nullptr && *tmp ? tmp : "/tmp") + "/" + stem + "-" + std::to_string(getpid());
}

TEST(NcclVersion, DecodesBothEncodings) {
  const NcclVersion v = decode_nccl_version(22809);
  EXPECT_EQ(v.major, 2);
  EXPECT_EQ(v.minor, 28);
  EXPECT_EQ(v.patch, 9);
  EXPECT_EQ(v.str(), "2.28.9");
  EXPECT_EQ(decode_nccl_version(2708).str(), "2.7.8");  // before 2.9: X*1000 + Y*100 + Z
  EXPECT_EQ(decode_nccl_version(NCCL_VERSION_CODE).str(),
            fmt::format("{}.{}.{}", NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH));
}

TEST(NcclVersion, MismatchMessageNamesLibraryHeadersAndRemedy) {
  const std::string m = nccl_version_mismatch_message(22703, 22809, "/opt/other/libnccl.so.2");
  EXPECT_NE(m.find("/opt/other/libnccl.so.2"), std::string::npos) << m;
  EXPECT_NE(m.find("NCCL 2.27.3"), std::string::npos) << m;
  EXPECT_NE(m.find("NCCL 2.28.9"), std::string::npos) << m;
  EXPECT_NE(m.find("headers"), std::string::npos) << m;
  EXPECT_NE(m.find("LD_LIBRARY_PATH"), std::string::npos) << m;
}

TEST(NcclVersion, LoadedLibraryMatchesTheHeaders) {
  EXPECT_NO_THROW(check_nccl_version());
  EXPECT_EQ(loaded_nccl_version().code, NCCL_VERSION_CODE);
  EXPECT_NE(loaded_nccl_library_path().find("libnccl"), std::string::npos) << loaded_nccl_library_path();
}

TEST(CommIds, HexRoundTrip) {
  const ncclUniqueId id = new_nccl_id();
  const std::string hex = nccl_id_to_hex(id);
  EXPECT_EQ(hex.size(), kNcclIdHexChars);
  const ncclUniqueId back = nccl_id_from_hex("  " + hex + "\n");
  EXPECT_EQ(std::memcmp(id.internal, back.internal, NCCL_UNIQUE_ID_BYTES), 0);
  std::string upper = hex;
  for (char& ch : upper) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  const ncclUniqueId back_upper = nccl_id_from_hex(upper);
  EXPECT_EQ(std::memcmp(id.internal, back_upper.internal, NCCL_UNIQUE_ID_BYTES), 0);
}

TEST(CommIds, MalformedHexIsRefused) {
  EXPECT_NE(message_of([] { nccl_id_from_hex("abc"); }).find("256 hex digits"), std::string::npos);
  std::string bad(kNcclIdHexChars, '0');
  bad[17] = 'g';
  EXPECT_NE(message_of([&] { nccl_id_from_hex(bad); }).find("character 17"), std::string::npos);
}

TEST(CommIds, FileRoundTripAndMissingFile) {
  const std::string path = temp_path("epmoe-comm-test-id");
  const ncclUniqueId id = new_nccl_id();
  write_nccl_id_file(path, id);
  const ncclUniqueId back = read_nccl_id_file(path);
  EXPECT_EQ(std::memcmp(id.internal, back.internal, NCCL_UNIQUE_ID_BYTES), 0);
  std::remove(path.c_str());
  const std::string missing = message_of([&] { read_nccl_id_file(path, 0.1); });
  EXPECT_NE(missing.find(path), std::string::npos) << missing;
  EXPECT_NE(missing.find("does not exist"), std::string::npos) << missing;
  { std::ofstream(path) << "not an id\n"; }
  EXPECT_NE(message_of([&] { read_nccl_id_file(path); }).find("does not hold an id"), std::string::npos);
  // An empty file is one the launcher has not filled yet: waited for, then named as still empty.
  { std::ofstream(path) << ""; }
  const std::string empty = message_of([&] { read_nccl_id_file(path, 0.1); });
  EXPECT_NE(empty.find("is still empty"), std::string::npos) << empty;
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    write_nccl_id_file(path, id);
  });
  const ncclUniqueId later = read_nccl_id_file(path, 10.0);
  writer.join();
  EXPECT_EQ(std::memcmp(id.internal, later.internal, NCCL_UNIQUE_ID_BYTES), 0);
  std::remove(path.c_str());
}

TEST(CommEnv, LaunchEnvironmentIsReadAndChecked) {
  {
    ScopedEnv w("EPMOE_WORLD_SIZE", nullptr), r("EPMOE_RANK", nullptr), l("EPMOE_LOCAL_RANK", nullptr);
    EXPECT_FALSE(LaunchEnvironment::from_env().present);
  }
  const ncclUniqueId id = new_nccl_id();
  const std::string hex = nccl_id_to_hex(id);
  {
    ScopedEnv w("EPMOE_WORLD_SIZE", "4"), r("EPMOE_RANK", "3"), l("EPMOE_LOCAL_RANK", "1"),
        h("EPMOE_NCCL_ID", hex.c_str()), f("EPMOE_NCCL_ID_FILE", "/nonexistent/id");
    const LaunchEnvironment e = LaunchEnvironment::from_env();
    EXPECT_TRUE(e.present);
    EXPECT_EQ(e.world_size, 4);
    EXPECT_EQ(e.rank, 3);
    EXPECT_EQ(e.local_rank, 1);
    const ncclUniqueId got = e.unique_id(0);  // EPMOE_NCCL_ID wins over the file
    EXPECT_EQ(std::memcmp(id.internal, got.internal, NCCL_UNIQUE_ID_BYTES), 0);
  }
  {
    ScopedEnv w("EPMOE_WORLD_SIZE", "2"), r("EPMOE_RANK", "2"), l("EPMOE_LOCAL_RANK", nullptr);
    EXPECT_NE(message_of([] { LaunchEnvironment::from_env(); }).find("EPMOE_RANK=2"), std::string::npos);
  }
  {
    ScopedEnv w("EPMOE_WORLD_SIZE", "two"), r("EPMOE_RANK", "0");
    EXPECT_NE(message_of([] { LaunchEnvironment::from_env(); }).find("EPMOE_WORLD_SIZE='two'"),
              std::string::npos);
  }
  {
    ScopedEnv w("EPMOE_WORLD_SIZE", "2"), r("EPMOE_RANK", "1"), h("EPMOE_NCCL_ID", nullptr),
        f("EPMOE_NCCL_ID_FILE", nullptr);
    const LaunchEnvironment e = LaunchEnvironment::from_env();
    EXPECT_EQ(e.local_rank, 1);  // defaults to the rank
    EXPECT_NE(message_of([&] { e.unique_id(0); }).find("EPMOE_NCCL_ID_FILE"), std::string::npos);
  }
}

TEST(CommEnv, NvlinkMulticastStaysOff) {
  {
    ScopedEnv v("NCCL_NVLS_ENABLE", nullptr);
    EXPECT_NO_THROW(require_nvls_disabled(/*may_set=*/true));
    ASSERT_NE(std::getenv("NCCL_NVLS_ENABLE"), nullptr);
    EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
  }
  {
    ScopedEnv v("NCCL_NVLS_ENABLE", nullptr);
    EXPECT_NE(message_of([] { require_nvls_disabled(false); }).find("NCCL_NVLS_ENABLE is not set"),
              std::string::npos);
  }
  {
    ScopedEnv v("NCCL_NVLS_ENABLE", "1");
    const std::string m = message_of([] { require_nvls_disabled(true); });
    EXPECT_NE(m.find("NCCL_NVLS_ENABLE=1"), std::string::npos) << m;
    EXPECT_NE(m.find("NCCL_NVLS_ENABLE=0"), std::string::npos) << m;
  }
  {
    ScopedEnv v("NCCL_NVLS_ENABLE", "0");
    EXPECT_NO_THROW(require_nvls_disabled(false));
  }
}

TEST(CommEnv, TimeoutFromTheEnvironment) {
  {
    ScopedEnv t("EPMOE_COMM_TIMEOUT_S", nullptr);
    EXPECT_EQ(default_comm_timeout_s(), 60.0);
  }
  {
    ScopedEnv t("EPMOE_COMM_TIMEOUT_S", "2.5");
    EXPECT_EQ(default_comm_timeout_s(), 2.5);
  }
  {
    ScopedEnv t("EPMOE_COMM_TIMEOUT_S", "-1");
    EXPECT_NE(message_of([] { default_comm_timeout_s(); }).find("EPMOE_COMM_TIMEOUT_S"), std::string::npos);
  }
}

TEST(CommEnv, NonblockingFromTheEnvironment) {
  {
    ScopedEnv t("EPMOE_COMM_NONBLOCKING", nullptr);
    EXPECT_FALSE(default_comm_nonblocking());
    EXPECT_FALSE(CommOptions{}.nonblocking);
  }
  {
    ScopedEnv t("EPMOE_COMM_NONBLOCKING", "1");
    EXPECT_TRUE(default_comm_nonblocking());
    EXPECT_TRUE(CommOptions{}.nonblocking);
  }
  {
    ScopedEnv t("EPMOE_COMM_NONBLOCKING", "0");
    EXPECT_FALSE(default_comm_nonblocking());
  }
  {
    ScopedEnv t("EPMOE_COMM_NONBLOCKING", "yes");
    const std::string e = message_of([] { default_comm_nonblocking(); });
    EXPECT_NE(e.find("EPMOE_COMM_NONBLOCKING='yes' must be 0 or 1"), std::string::npos) << e;
  }
}

TEST(CommErrors, DeviceErrorsNameThePhaseAndThePeer) {
  DeviceErrorRecord r{};
  r.code = kDeviceErrorTimeout;
  r.phase = static_cast<std::int32_t>(CommPhase::dispatch_recv);
  r.peer = 1;
  r.rank = 0;
  r.detail = 7;
  r.waited_ns = 30'000'000'000ull;
  const std::string m = describe_device_error(r);
  EXPECT_NE(m.find("rank 0"), std::string::npos) << m;
  EXPECT_NE(m.find("timed out after 30.0 s"), std::string::npos) << m;
  EXPECT_NE(m.find("dispatch-recv"), std::string::npos) << m;
  EXPECT_NE(m.find("waiting for rank 1"), std::string::npos) << m;
  r.code = kDeviceErrorPeerInput;
  r.detail = kInputTooManyTokens | kInputIdOutOfRange;
  const std::string p = describe_device_error(r);
  EXPECT_NE(p.find("rank 1 refused its input"), std::string::npos) << p;
  EXPECT_NE(p.find("out of range"), std::string::npos) << p;
  EXPECT_NE(p.find("more tokens"), std::string::npos) << p;
  r.code = kDeviceErrorBadSlot;
  r.phase = static_cast<std::int32_t>(CommPhase::combine_send);
  r.detail = -1;
  r.seen = 5;
  const std::string b = describe_device_error(r);
  EXPECT_NE(b.find("rank 0: in phase combine-send, a store for rank 1 at slot -1 (for token / row 5)"),
            std::string::npos)
      << b;
  EXPECT_NE(b.find("it was skipped"), std::string::npos) << b;
  EXPECT_EQ(to_string(CommPhase::combine_send), "combine-send");
  EXPECT_EQ(to_string(CommPhase::count_exchange), "count-exchange");
}

TEST(CommDispatchers, RegisteredAndTheyNeedACommunicator) {
  EXPECT_TRUE(DispatcherRegistry::instance().contains("nccl-p2p"));
  EXPECT_TRUE(DispatcherRegistry::instance().contains("nvlink-ll"));
  ASSERT_EQ(Communicator::process_default(), nullptr);
  MoeConfig c = MoeConfig::preset("tiny");
  c.num_ranks = 2;
  for (const char* name : {"nccl-p2p", "nvlink-ll"}) {
    const std::string m = message_of([&] {
      make_dispatcher(name, {c, Mode::low_latency, ActivationFormat::fp8_group, 0, 1});
    });
    EXPECT_NE(m.find("needs a Communicator"), std::string::npos) << m;
    EXPECT_NE(m.find("set_process_default"), std::string::npos) << m;
  }
}

TEST(CommCommunicator, RefusesBadRanksAndMissingGpus) {
  const ncclUniqueId id = new_nccl_id();
  EXPECT_NE(message_of([&] { Communicator::create(id, 2, 2, 0); }).find("rank 2 must lie in [0, size=2)"),
            std::string::npos);
  const std::string m = message_of([&] { Communicator::create(id, 0, 1, 4096); });
  EXPECT_NE(m.find("wants GPU 4096"), std::string::npos) << m;
  ScopedEnv w("EPMOE_WORLD_SIZE", nullptr);
  EXPECT_NE(message_of([] { Communicator::from_environment(); }).find("epmoe launch"), std::string::npos);
  EXPECT_NE(message_of([] { Communicator::borrow(nullptr); }).find("null"), std::string::npos);
}

// Loopback ranks' host side (no GPU needed): the barrier lets no thread through before every rank
// arrived, an exchange gives every rank every rank's pointer, and a rank that gives up (timeout)
// leaves the group usable for the next barrier.
TEST(CommLoopback, BarrierAndExchangeAcrossThreads) {
  constexpr int kRanks = 3, kRounds = 50;
  const auto group = LoopbackGroup::make(kRanks, 0);
  std::atomic<int> arrived{0}, wrong{0};
  int values[kRanks] = {10, 20, 30};
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      for (int round = 0; round < kRounds; ++round) {
        arrived.fetch_add(1);
        group->barrier(r, 10.0);
        if (arrived.load() < kRanks * (round + 1)) wrong.fetch_add(1);  // left before every rank came
        const std::vector<void*> all =
            group->exchange(r, static_cast<std::uint64_t>(round), &values[r], 10.0);
        for (int q = 0; q < kRanks; ++q)
          if (all[static_cast<std::size_t>(q)] != &values[q]) wrong.fetch_add(1000);
        group->barrier(r, 10.0);  // every rank checked this round before the next one counts
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
}

TEST(CommLoopback, ATimedOutRankLeavesTheGroupUsable) {
  const auto group = LoopbackGroup::make(2, 0);
  const std::string m = message_of([&] { group->barrier(0, 0.05); });  // rank 1 never comes
  EXPECT_NE(m.find("loopback rank 0: timed out"), std::string::npos) << m;
  EXPECT_NE(message_of([&] { group->exchange(1, 7, nullptr, 0.05); }).find("in exchange 7"),
            std::string::npos);
  // Both ranks now meet: the abandoned arrival and post are gone, so neither passes alone.
  std::atomic<bool> passed{false};
  std::thread other([&] {
    group->barrier(1, 10.0);
    passed = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(passed.load()) << "rank 1 passed the barrier alone";
  group->barrier(0, 10.0);
  other.join();
  EXPECT_TRUE(passed.load());
  int a = 1, b = 2;
  std::vector<void*> got0, got1;
  std::thread t1([&] { got1 = group->exchange(1, 7, &b, 10.0); });
  got0 = group->exchange(0, 7, &a, 10.0);
  t1.join();
  EXPECT_EQ(got0, (std::vector<void*>{&a, &b}));
  EXPECT_EQ(got1, got0);
  EXPECT_NE(message_of([] { LoopbackGroup::make(0, 0); }).find("size must be at least 1"), std::string::npos);
}

TEST(CommLoopback, RanksAndAllocationListsOutsideTheGroupAreRefused) {
  const auto group = LoopbackGroup::make(2, 0);
  for (const int rank : {-1, 2}) {
    const std::string m = message_of([&] { group->barrier(rank, 0.05); });
    EXPECT_NE(m.find("LoopbackGroup::barrier: rank " + std::to_string(rank) + " outside [0, 2)"),
              std::string::npos)
        << m;
    EXPECT_NE(message_of([&] { group->exchange(rank, 3, nullptr, 0.05); }).find("outside [0, 2)"),
              std::string::npos);
  }
  // (No device memory is touched: the list is refused before it is kept.)
  const std::string m = message_of([&] { (void)group->share_allocations(5, {nullptr}); });
  EXPECT_NE(m.find("1 allocations for a group of 2 ranks"), std::string::npos) << m;
}

}  // namespace
}  // namespace epmoe

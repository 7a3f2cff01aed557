// `epmoe version [--json FILE]`: what this build is and what it would run on: the commit, the CUDA
// runtime and driver, the GPUs, and the NCCL headers epmoe was compiled against beside the libnccl the
// loader picked. NCCL's device API is inline in epmoe's code, so a different library version breaks
// every multi-GPU run (an illegal memory access, or the communicator's refusal): the command says so and
// exits 1, naming the library file, so a script can check a machine before it starts ranks.
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "bench/bench.hpp"
#include "epmoe/comm.hpp"
#include "epmoe/cuda/runtime.hpp"
#include "epmoe/error.hpp"
#include "tools/epmoe/commands.hpp"
#include "tools/epmoe/options.hpp"

namespace epmoe::tools {
namespace {

// CUDA's version encoding (1000 * major + 10 * minor) as "major.minor"; 0: none.
std::string cuda_version_string(int v) {
  return v == 0 ? std::string("none") : std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
}

nlohmann::json describe() {
  nlohmann::json j;
  j["commit"] = bench::git_commit();
  int runtime = 0, driver = 0;
  if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) runtime = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
  j["cuda_runtime"] = cuda_version_string(runtime);
  j["cuda_driver"] = cuda_version_string(driver);
  nlohmann::json gpus = nlohmann::json::array();
  for (int d = 0, count = cuda::device_count(); d < count; ++d) {  // (0 without a driver or a GPU)
    cudaDeviceProp props{};
    if (cudaGetDeviceProperties(&props, d) != cudaSuccess) continue;
    gpus.push_back({{"index", d},
                    {"description", cuda::device_description(d)},
                    {"name", props.name},
                    {"sm", std::to_string(props.major) + std::to_string(props.minor)},
                    {"sms", props.multiProcessorCount},
                    {"memory_gib", static_cast<double>(props.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0)}});
  }
  j["gpus"] = gpus;
  const NcclVersion compiled = decode_nccl_version(NCCL_VERSION_CODE);
  const NcclVersion loaded = loaded_nccl_version();
  const std::string library = loaded_nccl_library_path();
  const bool match = loaded.code == compiled.code;
  j["nccl"] = {{"compiled", compiled.str()}, {"compiled_code", compiled.code},
               {"loaded", loaded.str()},     {"loaded_code", loaded.code},
               {"library", library},         {"match", match}};
  if (!match) j["nccl"]["problem"] = nccl_version_mismatch_message(loaded.code, compiled.code, library);
  return j;
}

void run_version(const std::string& json_path) {
  reserve_stdout_for_json(json_path);
  const nlohmann::json j = describe();
  std::printf("epmoe %s\n", j["commit"].get<std::string>().c_str());
  std::printf("CUDA runtime %s, driver %s\n", j["cuda_runtime"].get<std::string>().c_str(),
              j["cuda_driver"].get<std::string>().c_str());
  if (j["gpus"].empty()) std::printf("GPUs: none (the CPU reference runs instead)\n");
  for (const auto& g : j["gpus"])
    std::printf("GPU %d: %s\n", g["index"].get<int>(), g["description"].get<std::string>().c_str());
  const auto& nccl = j["nccl"];
  std::printf("NCCL: compiled against %s, loaded %s from %s: %s\n",
              nccl["compiled"].get<std::string>().c_str(), nccl["loaded"].get<std::string>().c_str(),
              nccl["library"].get<std::string>().c_str(), nccl["match"].get<bool>() ? "match" : "MISMATCH");
  if (!nccl["match"].get<bool>()) {
    std::fflush(stdout);  // (the reason after the summary line, on a terminal too)
    std::fprintf(stderr, "%s\n", nccl["problem"].get<std::string>().c_str());
  }
  if (!json_path.empty()) write_text_file("--json", json_path, j.dump(1) + "\n");
  set_exit_code(nccl["match"].get<bool>() ? 0 : 1);
}

const CommandRegistration kRegistration{
    70, [](CLI::App& app) {
      auto json_path = std::make_shared<std::string>();
      CLI::App* cmd = app.add_subcommand("version",
                                         "This build and its machine: commit, CUDA, GPUs, and whether the "
                                         "loaded libnccl is the version epmoe "
                                         "was compiled against (exit 1 if not)");
      cmd->add_option("--json", *json_path, "Also write it as JSON to FILE ('-' = stdout)")
          ->check(writable_output(/*result_file=*/true));
      cmd->callback([json_path] { run_version(*json_path); });
    }};

}  // namespace
}  // namespace epmoe::tools

// epmoe bench: kernel micro-benchmarks on the GPU (src/bench). One line per shape on stdout
// (time, GB/s, time over the memory floor), and optionally every result as JSON.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench.hpp"
#include "epmoe/cuda/runtime.hpp"
#include "tools/epmoe/commands.hpp"
#include "tools/epmoe/options.hpp"

namespace epmoe::tools {
namespace {

struct BenchOptions {
  std::string what;
  std::string json;
  std::vector<std::int64_t> tokens;
  bool quick = false;
  std::string quant;
};

void run_bench(const BenchOptions& o) {
  reserve_stdout_for_json(o.json);
  EPMOE_CHECK(cuda::device_count() > 0, "epmoe bench needs a CUDA GPU, and none is visible here ({})",
              cuda::device_description());
  std::printf("device: %s\n", cuda::device_description().c_str());
  std::printf("floor = bytes moved / %.0f GB/s (%s)\n", bench::copy_ceiling_gbps(),
              bench::copy_ceiling_source().c_str());
  bench::SuiteOptions so;
  so.tokens = o.tokens;
  so.quick = o.quick;
  so.quant = o.quant;
  so.on_result = [](const bench::Result& r) {
    std::printf("%s\n", bench::describe(r).c_str());
    std::fflush(stdout);
  };
  std::vector<std::string> failures;
  so.on_failure = [&failures](const std::string& what) { failures.push_back(what); };
  std::vector<bench::Result> results;
  auto append = [&](std::vector<bench::Result> more) {
    results.insert(results.end(), more.begin(), more.end());
  };
  for (const bench::Suite& suite : bench::suites())
    if (o.what == suite.name || o.what == "all") append(suite.run(so));
  nlohmann::json report = bench::report_json(results);
  report["pass"] = failures.empty();  // every row's check (the rows that have one: check_pass)
  report["failures"] = failures;
  if (!o.json.empty()) write_text_file("--json", o.json, report.dump(2) + "\n");
  // A failed check is exit code 1, as for `epmoe run` and `epmoe check` (2: the command itself failed).
  if (!failures.empty()) {
    std::fflush(stdout);
    std::fprintf(stderr,
                 "epmoe bench: %zu result(s) failed their check (rows written; check_pass = 0); first: %s\n",
                 failures.size(), failures.front().c_str());
  }
  set_exit_code(failures.empty() ? 0 : 1);
}

const CommandRegistration kRegistration{
    50, [](CLI::App& app) {
      auto options = std::make_shared<BenchOptions>();
      CLI::App* cmd = app.add_subcommand(
          "bench", "GPU kernel micro-benchmarks: time, GB/s and distance to the memory floor");
      std::string help = "What to measure: all";
      std::vector<std::string> names{"all"};
      for (const bench::Suite& suite : bench::suites()) {
        help += ", " + suite.name + " (" + suite.help + ")";
        names.push_back(suite.name);
      }
      cmd->add_option("what", options->what, help)->required()->check(CLI::IsMember(names));
      cmd->add_option("--json", options->json, "Write all results as JSON to FILE ('-' = stdout)")
          ->check(writable_output(/*result_file=*/true));
      cmd->add_option("--tokens", options->tokens,
                      "Token counts to measure, e.g. 128,4096 (default: per suite)")
          ->delimiter(',')
          ->check(positive());
      cmd->add_flag("--quick", options->quick, "Fewer runs and shapes");
      cmd->add_option(
             "--quant", options->quant,
             "Quantization scheme of the suites that have several (gemm: fp8 (default) or w4a8, which "
             "also times the FP8 kernel on the same rows and prints the ratio; layer: the layer's scheme)")
          ->check(CLI::IsMember({"fp8", "w4a8"}));
      cmd->callback([options] { run_bench(*options); });
    }};

}  // namespace
}  // namespace epmoe::tools

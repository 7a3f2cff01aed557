#include "tools/epmoe/options.hpp"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <regex>
#include <string>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "epmoe/cuda/runtime.hpp"
#include "epmoe/error.hpp"
#include "epmoe/tensor.hpp"

namespace epmoe::tools {

void add_model_options(CLI::App* cmd, ModelOptions& o) {
  cmd->add_option("--preset", o.preset,
                  "Model preset: deepseek-v3 or tiny (default: deepseek-v3 on GPUs, tiny on the CPU)");
  // (-1, the "keep the preset" value of the fields, is not accepted on the command line: a negative
  // value is refused instead of quietly meaning the default.)
  cmd->add_option("--hidden", o.hidden, "Hidden size H (multiple of 128)")->check(positive());
  cmd->add_option("--intermediate", o.intermediate, "Expert intermediate size I (multiple of 128)")
      ->check(positive());
  cmd->add_option("--experts", o.experts, "Routed (logical) experts E")->check(positive());
  cmd->add_option("--topk", o.topk, "Experts per token K")->check(positive());
  cmd->add_option("--groups", o.groups, "Expert groups for grouped top-k")->check(positive());
  cmd->add_option("--topk-groups", o.topk_groups, "Groups kept per token")->check(positive());
  cmd->add_option(
      "--scoring", o.scoring,
      "Router scoring: sigmoid (noaux_tc) or softmax (Mixtral / Qwen style with --groups 1 "
      "--topk-groups 1 --routed-scaling-factor 1; --no-renormalize for Qwen's norm_topk_prob off)");
  cmd->add_option("--routed-scaling-factor", o.routed_scaling_factor,
                  "Factor s on the routing weights (default: the preset's, 2.5 for deepseek-v3)")
      ->check(positive());
  cmd->add_flag("--no-renormalize", o.no_renormalize,
                "Keep the top-k scores as they are instead of renormalising them to sum 1");
  cmd->add_option("--shared-experts", o.shared_experts, "Shared experts (fused into one MLP)")
      ->check(non_negative());
  cmd->add_option("--ranks", o.ranks,
                  "Expert-parallel ranks (default: the GPUs present for a GPU run, else 2)")
      ->check(positive());
  cmd->add_option("--redundant-experts", o.redundant_experts,
                  "Redundant expert slots R (EPLB; default: 32 on GPUs, as the seed's set-up, 0 on the CPU)")
      ->check(non_negative());
  cmd->add_option("--max-tokens-per-rank", o.max_tokens_per_rank,
                  "Low-latency buffer size in tokens per rank")
      ->check(positive());
  cmd->add_option("--quant", o.quant, "Quant scheme: fp8, w4a8 or none")->capture_default_str();
  cmd->add_option("--dispatch-algorithm", o.dispatch_algorithm, "EPLB replica choice: static or dynamic")
      ->capture_default_str();
  cmd->add_flag("--pow2-scales", o.pow2_scales, "Round FP8 activation scales to powers of two (UE8M0)");
  cmd->add_option("--seed", o.seed, "Seed of the synthetic model and inputs")
      ->check(non_negative_u64())
      ->capture_default_str();
  cmd->add_option("--device", o.device, "auto, cpu or gpu")->capture_default_str();
}

int resolve_ranks(const ModelOptions& o, Device device) {
  if (o.ranks >= 0) return o.ranks;
  return device == Device::cuda ? std::max(1, cuda::device_count_without_cuda_init()) : 2;
}

std::string with_option_names(const std::string& message, const std::regex& fields,
                              const std::function<std::string(const std::string&)>& option_of) {
  std::string out;
  bool quoted = false;
  std::size_t begin = 0;
  while (begin <= message.size()) {
    const std::size_t quote = std::min(message.find('\'', begin), message.size());
    const std::string piece = message.substr(begin, quote - begin);
    if (quoted) {
      out += piece;
    } else {
      auto last = piece.cbegin();
      for (auto it = std::sregex_iterator(piece.begin(), piece.end(), fields); it != std::sregex_iterator();
           ++it) {
        out.append(last, piece.cbegin() + it->position());
        out += option_of(it->str());
        last = piece.cbegin() + it->position() + it->length();
      }
      out.append(last, piece.cend());
    }
    if (quote == message.size()) break;
    out += '\'';
    quoted = !quoted;
    begin = quote + 1;
  }
  return out;
}

namespace {
// MoeConfig's errors name its fields (the library's API); on the command line they name the flags:
// "topk_groups must be in [1, groups=4]" -> "--topk-groups must be in [1, --groups=4]".
std::string with_flag_names(const std::string& message) {
  static const std::regex field(
      R"(\b(hidden|intermediate|experts(?! per group)|topk|groups|topk_groups|scoring|routed_scaling_factor|)"
      R"(shared_experts|ranks|)"
      R"(redundant_experts|max_tokens_per_rank|quant|preset|dispatch_algorithm)\b)");
  return with_option_names(message, field, [](const std::string& name) {
    std::string flag = "--" + name;
    std::replace(flag.begin(), flag.end(), '_', '-');
    return flag;
  });
}

MoeConfig build_config_fields(const ModelOptions& o, Device device) {
  const bool gpu = device == Device::cuda;
  MoeConfig c = MoeConfig::preset(o.preset.empty() ? (gpu ? "deepseek-v3" : "tiny") : o.preset);
  if (o.hidden >= 0) c.hidden = o.hidden;
  if (o.intermediate >= 0) c.intermediate = o.intermediate;
  if (o.experts >= 0) c.num_experts = o.experts;
  if (o.topk >= 0) c.topk = o.topk;
  if (o.groups >= 0) c.num_groups = o.groups;
  if (o.topk_groups >= 0) c.topk_groups = o.topk_groups;
  if (!o.scoring.empty()) c.scoring = parse_scoring(o.scoring);
  if (o.routed_scaling_factor > 0) c.routed_scaling_factor = static_cast<float>(o.routed_scaling_factor);
  if (o.no_renormalize) c.renormalize = false;
  if (o.shared_experts >= 0) c.num_shared_experts = o.shared_experts;
  if (o.max_tokens_per_rank >= 0) c.max_tokens_per_rank = o.max_tokens_per_rank;
  c.num_ranks = resolve_ranks(o, device);
  c.num_redundant_experts = o.redundant_experts >= 0 ? o.redundant_experts : (gpu ? 32 : 0);
  c.quant = parse_quant(o.quant);
  c.dispatch_algorithm = parse_dispatch_algorithm(o.dispatch_algorithm);
  c.power_of_two_scales = o.pow2_scales;
  c.validate();
  return c;
}
}  // namespace

MoeConfig build_config(const ModelOptions& o, Device device) {
  try {
    return build_config_fields(o, device);
  } catch (const Error& e) {
    throw Error(with_flag_names(e.what()));
  }
}

Device resolve_device(const std::string& device, bool gpu_path) {
  if (device == "cpu") return Device::cpu;
  // Counted without initialising CUDA: `epmoe run` on several GPUs only launches the ranks.
  if (device == "auto")
    return gpu_path && cuda::device_count_without_cuda_init() > 0 ? Device::cuda : Device::cpu;
  if (device == "gpu") {
    EPMOE_CHECK(gpu_path, "device 'gpu': this command runs on the CPU only; use --device cpu");
    EPMOE_CHECK(cuda::device_count_without_cuda_init() > 0,
                "device 'gpu': no CUDA device is present; use --device cpu or auto");
    return Device::cuda;
  }
  EPMOE_FAIL("--device must be 'auto', 'cpu' or 'gpu', got '{}'", device);
}

namespace {
std::FILE* g_json_out = nullptr;          // the original stdout once reserve_stdout_for_json moved the report
std::vector<std::string> g_result_files;  // writable_output(true)'s paths
std::vector<std::string> g_written;       // write_text_file's
}  // namespace

void reserve_stdout_for_json(const std::string& path) {
  if (path != "-" || g_json_out != nullptr) return;
  std::fflush(stdout);
  const int fd = ::dup(STDOUT_FILENO);
  EPMOE_CHECK(fd >= 0, "--json -: cannot duplicate stdout");
  g_json_out = ::fdopen(fd, "w");
  EPMOE_CHECK(g_json_out != nullptr, "--json -: cannot open the duplicated stdout");
  EPMOE_CHECK(::dup2(STDERR_FILENO, STDOUT_FILENO) >= 0, "--json -: cannot send the report to stderr");
}

void write_text_file(std::string_view option, const std::string& path, const std::string& text) {
  g_written.push_back(path);
  if (path == "-") {
    std::FILE* out = g_json_out != nullptr ? g_json_out : stdout;
    std::fwrite(text.data(), 1, text.size(), out);
    EPMOE_CHECK(std::fflush(out) == 0, "{} -: cannot write to stdout", option);
    return;
  }
  std::ofstream out(path);
  EPMOE_CHECK(out.good(), "{}: cannot open '{}' for writing", option, path);
  out << text;
  out.close();  // (a short text is only written here: a full disk shows at the close)
  if (out.fail()) {
    std::error_code ec;
    std::filesystem::remove(path, ec);  // no half-written file a script could take for the result
    EPMOE_FAIL("{}: cannot write '{}' (disk full or a file size limit?); removed it", option, path);
  }
}

namespace {
// CLI11 reads integers with strtoll / strtoull in base 0 and without their range check, so "010" would
// quietly be 8 and a number past the option's 64 bits the largest one: both are refused here. `largest`:
// the largest value the option holds (INT64_MAX for a signed option, UINT64_MAX for the seed).
std::string integer_text_problem(const std::string& text, std::uint64_t largest) {
  const std::size_t start = !text.empty() && (text[0] == '+' || text[0] == '-') ? 1 : 0;
  const std::string digits = text.substr(start);
  if (digits.empty() ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return {};  // not a plain integer: left to the conversion
  if (digits.size() > 1 && digits[0] == '0')
    return "must be written without leading zeros (an integer option would read it as octal), got " + text;
  std::uint64_t value = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  const bool negative = start == 1 && text[0] == '-';
  if (ec != std::errc() || end != digits.data() + digits.size() ||
      (negative && value > (std::uint64_t{1} << 63)) || (!negative && value > largest))
    return negative ? "is out of range (at least -9223372036854775808), got " + text
                    : fmt::format("is out of range (at most {}), got {}", largest, text);
  return {};
}

// The problem with `text` as a finite number (empty: none; *value: the number). Decimal only: the
// conversions would also read hexadecimal ("0x10", "0x1p-3") and CLI11 binary and octal prefixes ("0b11",
// "0o17") without a word, where the decimal reading was more likely meant.
std::string finite_number_problem(const std::string& text, double* value) {
  if (!CLI::detail::lexical_cast(text, *value)) return "must be a number, got '" + text + "'";
  if (!std::isfinite(*value)) return "must be a finite number, got " + text;
  if (!std::all_of(text.begin(), text.end(), [](char c) {
        return (c >= '0' && c <= '9') || c == '+' || c == '-' || c == '.' || c == 'e' || c == 'E';
      }))
    return "must be a decimal number, got " + text;
  return {};
}

CLI::Validator number_above(double bound, bool strict, const char* name,
                            std::uint64_t largest = std::numeric_limits<std::int64_t>::max()) {
  return CLI::Validator(
      [bound, strict, largest](std::string& text) -> std::string {
        if (std::string problem = integer_text_problem(text, largest); !problem.empty()) return problem;
        double value = 0;
        if (std::string problem = finite_number_problem(text, &value); !problem.empty()) return problem;
        if (strict ? value > bound : value >= bound) return {};
        return std::string("must be ") + (strict ? "> " : ">= ") + CLI::detail::to_string(bound) + ", got " +
               text;
      },
      strict ? "> 0" : ">= 0", name);
}
}  // namespace

CLI::Validator non_negative() {
  return number_above(0.0, false, "non_negative");
}
CLI::Validator positive() {
  return number_above(0.0, true, "positive");
}
CLI::Validator non_negative_u64() {
  return number_above(0.0, false, "non_negative_u64", std::numeric_limits<std::uint64_t>::max());
}
CLI::Validator at_most(double bound) {
  return CLI::Validator(
      [bound](std::string& text) -> std::string {
        double value = 0;
        if (std::string problem = finite_number_problem(text, &value); !problem.empty()) return problem;
        if (value <= bound) return {};
        return "must be <= " + CLI::detail::to_string(bound) + ", got " + text;
      },
      "<= " + CLI::detail::to_string(bound), "at_most");
}
CLI::Validator finite() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        double value = 0;
        return finite_number_problem(text, &value);
      },
      "FINITE", "finite");
}

void remove_unwritten_results() {
  for (const std::string& path : g_result_files) {
    if (std::find(g_written.begin(), g_written.end(), path) != g_written.end()) continue;
    std::error_code ec;
    if (std::filesystem::is_regular_file(path, ec) && std::filesystem::remove(path, ec))
      std::fprintf(stderr,
                   "epmoe: removed '%s', an earlier run's output: this run failed before writing its own\n",
                   path.c_str());
  }
}

namespace {
// What keeps `path` from being written as an output file (empty: nothing); see writable_output.
std::string output_problem(const std::string& path) {
  if (path == "-") return {};
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p(path);
  if (p.filename().empty()) return "'" + path + "' names a directory, not a file";
  if (fs::exists(p, ec)) {
    if (!fs::is_regular_file(p, ec)) return "'" + path + "' exists and is not a regular file";
    if (::access(path.c_str(), W_OK) != 0) return "'" + path + "' is not writable";
    const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND);  // (neither truncates nor writes)
    if (fd < 0) return "cannot open '" + path + "' for writing: " + std::strerror(errno);
    ::close(fd);
    return {};
  }
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (!fs::is_directory(dir, ec)) return "the directory of '" + path + "' does not exist";
  if (::access(dir.c_str(), W_OK | X_OK) != 0) return "the directory of '" + path + "' is not writable";
  // access() passes for root and knows nothing of file systems that take no new files (/proc, a
  // read-only mount): create a scratch file beside it, so such a path fails now, not after the run.
  std::string probe = (dir / ".epmoe-write-test-XXXXXX").string();
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) return "cannot create files in the directory of '" + path + "': " + std::strerror(errno);
  ::close(fd);
  ::unlink(probe.c_str());
  return {};
}
}  // namespace

void remove_results_of_refused_command_line(const CLI::App& app) {
  for (const CLI::App* sub : app.get_subcommands()) {
    for (const char* name : {"--json", "--trace"}) {  // every writable_output(true) option
      const CLI::Option* option = sub->get_option_no_throw(name);
      if (option == nullptr || option->count() == 0 || option->results().empty()) continue;
      const std::string& path = option->results().back();
      // (A path the output check refuses, e.g. a read-only file, is never removed.)
      if (path != "-" && output_problem(path).empty()) g_result_files.push_back(path);
    }
  }
  remove_unwritten_results();
}

CLI::Validator writable_output(bool result_file) {
  return CLI::Validator(
      [result_file](std::string& path) -> std::string {
        std::string problem = output_problem(path);
        // (Only a path this run could write is a result it may remove: never one the check refused.)
        if (problem.empty() && result_file && path != "-") g_result_files.push_back(path);
        return problem;
      },
      "FILE (writable)", "writable_output");
}

}  // namespace epmoe::tools

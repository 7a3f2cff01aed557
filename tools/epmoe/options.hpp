// Options every model-building subcommand shares (--preset and the dims, EP and quant choices).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <regex>
#include <string>
#include <string_view>

#include "epmoe/config.hpp"
#include "epmoe/tensor.hpp"

namespace epmoe::tools {

struct ModelOptions {
  std::string preset;  // empty: deepseek-v3 for a GPU run, tiny on the CPU
  // Overrides of the preset; -1 / empty = keep the preset's value.
  std::int64_t hidden = -1, intermediate = -1;
  int experts = -1, topk = -1, groups = -1, topk_groups = -1, shared_experts = -1;
  int ranks = -1, redundant_experts = -1, max_tokens_per_rank = -1;  // redundant -1: GPU run 32, CPU 0
  std::string scoring, quant = "fp8", dispatch_algorithm = "static";
  double routed_scaling_factor = -1;  // -1: the preset's
  bool no_renormalize = false;
  bool pow2_scales = false;
  std::uint64_t seed = 1;
  std::string device = "auto";
};

void add_model_options(CLI::App* cmd, ModelOptions& options);
// The validated config (throws epmoe::Error naming the bad option: MoeConfig's message, its fields
// written as the flags that set them).
MoeConfig build_config(const ModelOptions& options, Device device = Device::cpu);
// A library error message with its parameter names written as the options that set them: each match of
// `fields` is replaced by option_of(match). Text in single quotes (a user's own value quoted back, "got
// 'groups'") stays as it is.
std::string with_option_names(const std::string& message, const std::regex& fields,
                              const std::function<std::string(const std::string&)>& option_of);
// "cpu" or "gpu" for --device auto|cpu|gpu. auto picks the GPU when one is present and the command
// has a GPU path (gpu_path), else the CPU; "gpu" without a GPU (or a GPU path) is refused.
Device resolve_device(const std::string& device, bool gpu_path = false);
// --ranks when given, else the default: the GPUs present for a GPU run, 2 for the CPU simulation.
int resolve_ranks(const ModelOptions& options, Device device);

// Writes `text` to `path` ("-" = stdout), the value of the command-line option `option`, throwing
// epmoe::Error that names both when it cannot (and then removing the half-written file).
void write_text_file(std::string_view option, const std::string& path, const std::string& text);
// For `--json -`: keeps the process's stdout for the JSON (write_text_file("-")) and sends everything
// else printed to stdout from now on (the human-readable report) to stderr, so that stdout is one JSON
// document a script can read. Does nothing for any other path; call before the command prints.
void reserve_stdout_for_json(const std::string& path);

// CLI validators of numbers: >= 0 and > 0, with a message that names the bound ("must be >= 0, got -3").
// Both refuse what CLI11 would read quietly wrong: an integer with a leading 0 (octal), one past the
// option's range (strtoll saturates), and inf / nan. They are for signed fields (at most 2^63 - 1; an `int`
// field's narrower range CLI11 checks itself); non_negative_u64 is for an unsigned 64-bit field (the seed).
CLI::Validator non_negative();
CLI::Validator positive();
CLI::Validator non_negative_u64();
// A finite number at most `bound` (with the message "must be <= bound, got text").
CLI::Validator at_most(double bound);
// A finite number (for options with their own range check, which nan would pass: every comparison
// with nan is false).
CLI::Validator finite();

// CLI validator of an output file, checked when the command line is parsed rather than when a long run
// ends: "-", or a path whose directory exists and takes new files (a scratch file is created there and
// removed) and which, if it exists, is a regular file that opens for writing.
// result_file: a command's results (--json, --trace), which an earlier run may have left there: if this run
// fails with an error before writing its own, remove_unwritten_results() removes the old one, so that a
// script cannot take it for this run's (not for --output files, which may also be a command's input).
CLI::Validator writable_output(bool result_file = false);
// main's error path: see writable_output.
void remove_unwritten_results();
// main's path for a command line CLI11 refused: its options' validators ran in their declared order, so
// the --json / --trace after a bad option were never seen by writable_output; this finds them on the
// parsed subcommand and removes what an earlier run left there, as remove_unwritten_results does.
void remove_results_of_refused_command_line(const CLI::App& app);

}  // namespace epmoe::tools

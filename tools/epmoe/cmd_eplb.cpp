// `epmoe eplb`: DeepSeek's EPLB rebalance of per-expert load counts (design.md §5).
//   in:  {"load": [[...per expert...], ...per layer...]}
//   out: {"phy2log": [L][P], "log2phy": [L][E][max_replicas] (-1 padded), "logcnt": [L][E]}
#include <CLI/CLI.hpp>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

#include "epmoe/eplb.hpp"
#include "epmoe/error.hpp"
#include "tools/epmoe/commands.hpp"
#include "tools/epmoe/options.hpp"

namespace epmoe::tools {
namespace {

struct EplbOptions {
  std::string load_path;
  std::string output_path;
  int replicas = 0;
  int groups = 1;
  int nodes = 1;
  int gpus = 1;
};

std::vector<std::vector<double>> read_load(const std::string& path) {
  // (A directory opens as an ifstream, and reading it throws std::ios_failure.)
  std::error_code ec;
  EPMOE_CHECK(!std::filesystem::is_directory(path, ec),
              "eplb: cannot open --load file '{}': it is a directory, expected a JSON file", path);
  std::ifstream in(path);
  EPMOE_CHECK(in.is_open(), "eplb: cannot open --load file '{}'", path);
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    EPMOE_FAIL("eplb: --load file '{}' is not valid JSON: {}", path, e.what());
  }
  EPMOE_CHECK(doc.is_object() && doc.contains("load"),
              "eplb: --load file '{}' must be a JSON object with a \"load\" field ([layers][experts])", path);
  const nlohmann::json& layers = doc.at("load");
  EPMOE_CHECK(layers.is_array() && !layers.empty(),
              "eplb: \"load\" in '{}' must be a non-empty array of layers, each an array of per-expert loads",
              path);
  std::vector<std::vector<double>> load;
  load.reserve(layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const nlohmann::json& row = layers[l];
    EPMOE_CHECK(row.is_array(), "eplb: load[{}] in '{}' must be an array of per-expert loads, got {}", l,
                path, row.type_name());
    std::vector<double>& out = load.emplace_back();
    out.reserve(row.size());
    for (std::size_t e = 0; e < row.size(); ++e) {
      EPMOE_CHECK(row[e].is_number(), "eplb: load[{}][{}] in '{}' must be a number, got {}", l, e, path,
                  row[e].dump());
      out.push_back(row[e].get<double>());
    }
  }
  return load;
}

// rebalance_experts' messages name its parameters; the command's user knows them as the options that set
// them ("num_physical (20) must be a multiple of num_gpus (3)": "--replicas (20) ... --gpus (3)").
std::string eplb_flag_names(const std::string& message) {
  static const std::regex fields(R"(\b(num_physical|num_gpus|num_nodes|num_groups|num_logical)\b)");
  static const std::map<std::string, std::string> options = {
      {"num_physical", "--replicas"},
      {"num_gpus", "--gpus"},
      {"num_nodes", "--nodes"},
      {"num_groups", "--groups"},
      {"num_logical", "the experts per layer in --load"}};
  return with_option_names(message, fields, [](const std::string& name) { return options.at(name); });
}

void run_eplb(const EplbOptions& opts) {
  const std::vector<std::vector<double>> load = read_load(opts.load_path);
  const RebalanceResult r = [&] {
    try {
      return rebalance_experts(load, opts.replicas, opts.groups, opts.nodes, opts.gpus);
    } catch (const Error& e) {
      throw Error(eplb_flag_names(e.what()));
    }
  }();

  const auto L = static_cast<std::size_t>(r.num_layers);
  const auto E = static_cast<std::size_t>(r.num_logical);
  const auto P = static_cast<std::size_t>(r.num_physical);
  const auto R = static_cast<std::size_t>(r.max_replicas);
  nlohmann::ordered_json phy2log = nlohmann::ordered_json::array();
  nlohmann::ordered_json log2phy = nlohmann::ordered_json::array();
  nlohmann::ordered_json logcnt = nlohmann::ordered_json::array();
  for (std::size_t l = 0; l < L; ++l) {
    phy2log.push_back(
        std::vector<std::int32_t>(r.phy2log.begin() + static_cast<std::ptrdiff_t>(l * P),
                                  r.phy2log.begin() + static_cast<std::ptrdiff_t>((l + 1) * P)));
    logcnt.push_back(std::vector<std::int32_t>(r.logcnt.begin() + static_cast<std::ptrdiff_t>(l * E),
                                               r.logcnt.begin() + static_cast<std::ptrdiff_t>((l + 1) * E)));
    nlohmann::ordered_json experts = nlohmann::ordered_json::array();
    for (std::size_t e = 0; e < E; ++e) {
      const auto begin = r.log2phy.begin() + static_cast<std::ptrdiff_t>((l * E + e) * R);
      experts.push_back(std::vector<std::int32_t>(begin, begin + static_cast<std::ptrdiff_t>(R)));
    }
    log2phy.push_back(std::move(experts));
  }
  nlohmann::ordered_json out;
  out["phy2log"] = std::move(phy2log);
  out["log2phy"] = std::move(log2phy);
  out["logcnt"] = std::move(logcnt);
  const std::string text = out.dump() + "\n";

  // ("-", which --output's check lets through, is stdout as for the other commands' --json.)
  write_text_file("--output", opts.output_path.empty() ? "-" : opts.output_path, text);
}

const CommandRegistration kRegisterEplb(40, [](CLI::App& app) {
  auto opts = std::make_shared<EplbOptions>();
  CLI::App* cmd = app.add_subcommand(
      "eplb",
      "Rebalance experts over GPUs from per-expert loads (DeepSeek EPLB); prints the placement as JSON");
  cmd->add_option("--load", opts->load_path, "JSON file {\"load\": [[per-expert load, ...], ...per layer]}")
      ->required();
  cmd->add_option("--replicas", opts->replicas, "physical expert slots P per layer (experts + redundant)")
      ->required()
      ->check(positive());
  cmd->add_option("--groups", opts->groups, "expert groups (hierarchical policy when groups % nodes == 0)")
      ->check(positive())
      ->capture_default_str();
  cmd->add_option("--nodes", opts->nodes, "nodes")->check(positive())->capture_default_str();
  cmd->add_option("--gpus", opts->gpus, "GPUs in all (ranks); P must be a multiple")
      ->check(positive())
      ->capture_default_str();
  cmd->add_option("--output", opts->output_path, "write the JSON here instead of stdout ('-' = stdout)")
      ->check(writable_output());
  cmd->callback([opts] { run_eplb(*opts); });
});

}  // namespace
}  // namespace epmoe::tools

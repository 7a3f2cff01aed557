// A name -> factory registry. Each backend or dispatcher registers itself from its own file with
// a static Registration object, so adding one is a new file, not edits across the tree.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "epmoe/error.hpp"

namespace epmoe {

template <class Interface, class Context>
class Registry {
 public:
  using Factory = std::function<std::unique_ptr<Interface>(const Context&)>;

  static Registry& instance() {
    static Registry registry;
    return registry;
  }
  void add(const std::string& key, Factory factory) {
    EPMOE_CHECK(!factories_.contains(key), "'{}' is registered twice", key);
    factories_.emplace(key, std::move(factory));
  }
  bool contains(const std::string& key) const { return factories_.contains(key); }
  std::unique_ptr<Interface> make(const std::string& key, const Context& context) const {
    auto it = factories_.find(key);
    if (it == factories_.end()) {
      std::string known;
      for (const auto& [k, f] : factories_) known += (known.empty() ? "" : ", ") + k;
      EPMOE_FAIL("no implementation registered for '{}' (known: {})", key, known);
    }
    return it->second(context);
  }
  std::vector<std::string> keys() const {
    std::vector<std::string> out;
    for (const auto& [k, f] : factories_) out.push_back(k);
    return out;
  }

  struct Registration {
    Registration(const std::string& key, Factory factory) { instance().add(key, std::move(factory)); }
  };

 private:
  std::map<std::string, Factory> factories_;
};

}  // namespace epmoe

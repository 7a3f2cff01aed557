#!/usr/bin/env bash
# The installed package from a program of plain C++: installs this build into a fresh prefix, builds
# examples/layer against it with find_package(epmoe) and with pkg-config (running the latter on the
# CPU), and checks the installed CLI starts (its RPATH).
#   install_example_test.sh BUILD_DIR SOURCE_DIR WORK_DIR
# Then install.example_{cpu,gpu}_{fp8,w4a8} run WORK_DIR/example/epmoe_example_layer.
set -euo pipefail
build=$1 source=$2 work=$3
rm -rf "$work"
mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" >"$work/install.log"
for f in lib/libepmoe.so include/epmoe/epmoe.hpp include/epmoe/cuda/layer.hpp lib/cmake/epmoe/epmoeConfig.cmake \
  lib/pkgconfig/epmoe.pc bin/epmoe; do
  [[ -e "$work/prefix/$f" ]] || { echo "FAIL: the install has no $f"; exit 1; }
done
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$source/examples/layer" -B "$work/example" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" >"$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/example" -j 2 >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
# The same program built without CMake, through the installed pkg-config file (where pkg-config is).
if command -v pkg-config >/dev/null; then
  flags=$(PKG_CONFIG_PATH="$work/prefix/lib/pkgconfig" pkg-config --cflags --libs epmoe nlohmann_json)
  # shellcheck disable=SC2086 # (the flags are words)
  g++ -std=c++20 -O1 -Wall -Wextra -Werror "$source/examples/layer/main.cpp" $flags -o "$work/example-pkgconfig" \
    >"$work/pkgconfig.log" 2>&1 || { echo "FAIL: the pkg-config build: $flags"; cat "$work/pkgconfig.log"; exit 1; }
  "$work/example-pkgconfig" --device cpu --tokens 5 >"$work/pkgconfig-run.json" ||
    { echo "FAIL: the pkg-config build's run"; cat "$work/pkgconfig-run.json"; exit 1; }
else
  echo "no pkg-config here: the pkg-config build left out"
fi
# The installed CLI finds the installed library by its RPATH alone.
env -u LD_LIBRARY_PATH "$work/prefix/bin/epmoe" --help >/dev/null
# The example's executable resolves libepmoe from the install, not from the build tree (by its own
# RUNPATH: a device run may put the build tree on LD_LIBRARY_PATH).
lib=$(env -u LD_LIBRARY_PATH ldd "$work/example/epmoe_example_layer" | awk '/libepmoe\.so/ {print $3}')
[[ "$lib" == "$work/prefix/"* ]] || { echo "FAIL: the example links '$lib', not the installed library"; exit 1; }
echo "installed into $work/prefix; example built against it"

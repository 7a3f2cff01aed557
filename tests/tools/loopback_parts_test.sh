#!/usr/bin/env bash
# The loopback comm suite's ctest entries (tests/CMakeLists.txt, CommGpu.loopback_two_ranks.*) partition
# the suite: every test the suite's filter selects runs in exactly one entry, and no entry is empty. A
# renamed parameter or suite would otherwise drop its tests from every entry without a failure.
# Usage: loopback_parts_test.sh COMM_TESTS_BIN SUITE_FILTER NAME=FILTER...
set -euo pipefail
bin=$1 suite_filter=$2
shift 2
# GoogleTest's listing: "Suite." lines, then "  Test" lines (a "  # GetParam() = ..." comment after a
# parameterised test's name); one full name per line out.
list() {
  "$bin" --gtest_list_tests "--gtest_filter=$1" |
    awk '/^[^ ]/ { suite = $1; next } /^  [^ ]/ { print suite $1 }' | sort
}
all=$(list "$suite_filter")
[[ -n $all ]] || { echo "the suite's filter '$suite_filter' selects no test" >&2; exit 1; }
union=""
status=0
for part in "$@"; do
  name=${part%%=*} filter=${part#*=}
  tests=$(list "$filter")
  count=$(grep -c . <<< "$tests" || true)
  echo "$name: $count tests"
  if [[ -z $tests ]]; then
    echo "entry $name (filter '$filter') selects no test" >&2
    status=1
  fi
  union+="$tests"$'\n'
done
union=$(grep . <<< "$union" | sort || true)
distinct=$(uniq <<< "$union")
if duplicated=$(uniq -d <<< "$union") && [[ -n $duplicated ]]; then
  echo "in more than one entry:" >&2
  echo "$duplicated" >&2
  status=1
fi
if missing=$(comm -23 <(echo "$all") <(echo "$distinct")) && [[ -n $missing ]]; then
  echo "in no entry:" >&2
  echo "$missing" >&2
  status=1
fi
if extra=$(comm -13 <(echo "$all") <(echo "$distinct")) && [[ -n $extra ]]; then
  echo "in an entry but not in the suite:" >&2
  echo "$extra" >&2
  status=1
fi
echo "suite: $(grep -c . <<< "$all") tests"
exit $status

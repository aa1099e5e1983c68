#!/usr/bin/env bash
# Runs one ctest entry of cmake/gtest_suites.cmake: a GoogleTest binary with a suite's filter. Its
# output streams through; the exit status is the binary's, except 77 (SKIP_RETURN_CODE: ctest shows
# Skipped) when it succeeded with every selected test skipped ("[  PASSED  ] 0 tests."). A regular
# expression on the output alone could not tell that from a suite whose tests all failed.
log=$(mktemp "${TMPDIR:-/tmp}/dtune_suite.XXXXXX") || exit 1
trap 'rm -f "$log"' EXIT
"$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 0 ] && grep -q '^\[  PASSED  \] 0 tests\.$' "$log"; then exit 77; fi
exit "$rc"

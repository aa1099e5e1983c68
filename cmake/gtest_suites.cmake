# One ctest entry per GoogleTest suite instead of one per test, for executables of many short tests.
#
# Each ctest entry is a process start, and a libtorch test binary takes about 0.2 s to start: with
# one entry per test, the 800 unit, parity and gpu tests spent more time starting than testing on
# CI's two cores. Here a suite runs in one process (`--gtest_filter=Suite.*`); `ctest -R <Suite>`
# still selects it, and a failure's output names the failing test.
#
# Like gtest_discover_tests(... DISCOVERY_MODE PRE_TEST), the tests are listed when ctest runs
# (the binary's `--gtest_list_tests`, redone whenever the binary, this script or the generated
# include file is newer than the list), so a configure step never runs a test binary. Entries:
#   <binary>:<Suite>        the suite's tests, minus the heavy ones and the /Cuda instances
#   <binary>:<Suite>/Cuda   the suite's device-parameterised CUDA instances (`ctest -R /Cuda`)
#   <Suite>.<Test>          each test matching the HEAVY gtest filter, alone, labelled heavy
# An entry whose tests all skip (no GPU) reports Skipped: cmake/gtest_suite_run.sh runs each entry
# and exits 77 then (an output regex could not tell "all skipped" from "none passed").
#
# This file is included twice: by tests/CMakeLists.txt for dtune_gtest_suites(), and by the
# generated ctest include file (DTUNE_SUITES_DISCOVER set) to list the tests and write the entries.

if(NOT DEFINED DTUNE_SUITES_DISCOVER)
  set(DTUNE_GTEST_SUITES_SCRIPT "${CMAKE_CURRENT_LIST_FILE}")
  set(DTUNE_GTEST_SUITES_RUNNER "${CMAKE_CURRENT_LIST_DIR}/gtest_suite_run.sh")

  # dtune_gtest_suites(<target> LABEL <label> [HEAVY <gtest filter>] [TIMEOUT <seconds>])
  function(dtune_gtest_suites target)
    cmake_parse_arguments(S "" "LABEL;HEAVY;TIMEOUT" "" ${ARGN})
    if(NOT S_TIMEOUT)
      set(S_TIMEOUT 120)
    endif()
    set(base "${CMAKE_CURRENT_BINARY_DIR}/${target}_suites")
    file(GENERATE OUTPUT "${base}_include.cmake" CONTENT
"set(DTUNE_SUITES_DISCOVER ON)
set(DTUNE_SUITES_BINARY [==[$<TARGET_FILE:${target}>]==])
set(DTUNE_SUITES_LIST [==[${base}_tests.cmake]==])
set(DTUNE_SUITES_WORKDIR [==[${CMAKE_CURRENT_BINARY_DIR}]==])
set(DTUNE_SUITES_LABEL [==[${S_LABEL}]==])
set(DTUNE_SUITES_HEAVY [==[${S_HEAVY}]==])
set(DTUNE_SUITES_TIMEOUT ${S_TIMEOUT})
set(DTUNE_SUITES_RUNNER [==[${DTUNE_GTEST_SUITES_RUNNER}]==])
if(EXISTS \"\${DTUNE_SUITES_BINARY}\")
  if(NOT EXISTS \"\${DTUNE_SUITES_LIST}\" OR \"\${DTUNE_SUITES_BINARY}\" IS_NEWER_THAN \"\${DTUNE_SUITES_LIST}\"
     OR [==[${DTUNE_GTEST_SUITES_SCRIPT}]==] IS_NEWER_THAN \"\${DTUNE_SUITES_LIST}\"
     OR [==[${base}_include.cmake]==] IS_NEWER_THAN \"\${DTUNE_SUITES_LIST}\")
    include([==[${DTUNE_GTEST_SUITES_SCRIPT}]==])
  endif()
  include(\"\${DTUNE_SUITES_LIST}\")
else()
  add_test(${target}_NOT_BUILT ${target}_NOT_BUILT)
endif()
")
    set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${base}_include.cmake")
  endfunction()
  return()
endif()

# ---- ctest time: list the binary's tests and write one entry per suite ----
execute_process(COMMAND "${DTUNE_SUITES_BINARY}" --gtest_list_tests
  WORKING_DIRECTORY "${DTUNE_SUITES_WORKDIR}"
  TIMEOUT ${DTUNE_SUITES_TIMEOUT}
  RESULT_VARIABLE rc OUTPUT_VARIABLE listing ERROR_VARIABLE listing_err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "listing the tests of ${DTUNE_SUITES_BINARY} failed (${rc}):\n${listing}\n${listing_err}")
endif()

# The heavy filter's patterns (gtest syntax: ':' between patterns, '*' and '?') as regexes.
set(heavy_regexes "")
if(DTUNE_SUITES_HEAVY)
  string(REPLACE ":" ";" patterns "${DTUNE_SUITES_HEAVY}")
  foreach(p IN LISTS patterns)
    string(REGEX REPLACE "([][.+^$()|\\\\])" "\\\\\\1" r "${p}")
    string(REPLACE "*" ".*" r "${r}")
    string(REPLACE "?" "." r "${r}")
    list(APPEND heavy_regexes "^${r}$")
  endforeach()
endif()

string(REPLACE ";" "" listing "${listing}")  # (a GetParam() comment may hold one)
string(REPLACE "\n" ";" lines "${listing}")
set(suites "")
set(suite "")
foreach(line IN LISTS lines)
  if(line MATCHES "^([A-Za-z0-9_/]+)\\.( |$)")
    set(suite "${CMAKE_MATCH_1}")
    list(APPEND suites "${suite}")
    set(normal_${suite} "")
    set(cuda_${suite} "")
    set(heavy_${suite} "")
  elseif(suite AND line MATCHES "^  ([A-Za-z0-9_/]+)")
    set(name "${suite}.${CMAKE_MATCH_1}")
    set(kind normal)
    foreach(r IN LISTS heavy_regexes)
      if(name MATCHES "${r}")
        set(kind heavy)
      endif()
    endforeach()
    if(kind STREQUAL "normal" AND name MATCHES "/Cuda$")
      set(kind cuda)
    endif()
    list(APPEND ${kind}_${suite} "${name}")
  endif()
endforeach()
if(NOT suites)
  message(FATAL_ERROR "${DTUNE_SUITES_BINARY} --gtest_list_tests listed no tests:\n${listing}")
endif()

get_filename_component(binary_name "${DTUNE_SUITES_BINARY}" NAME)
set(script "")
macro(dtune_suites_entry name filter label)
  string(APPEND script "add_test([==[${name}]==] bash [==[${DTUNE_SUITES_RUNNER}]==] [==[${DTUNE_SUITES_BINARY}]==] "
    "[==[--gtest_filter=${filter}]==])\n"
    "set_tests_properties([==[${name}]==] PROPERTIES LABELS [==[${label}]==] ENVIRONMENT OMP_NUM_THREADS=1 "
    "WORKING_DIRECTORY [==[${DTUNE_SUITES_WORKDIR}]==] SKIP_RETURN_CODE 77)\n")
endmacro()
foreach(suite IN LISTS suites)
  if(normal_${suite})
    # The suite minus what runs elsewhere: its heavy tests and its CUDA instances.
    set(excluded ${heavy_${suite}})
    if(cuda_${suite})
      list(APPEND excluded "${suite}.*/Cuda")
    endif()
    set(filter "${suite}.*")
    if(excluded)
      list(JOIN excluded ":" minus)
      set(filter "${filter}-${minus}")
    endif()
    dtune_suites_entry("${binary_name}:${suite}" "${filter}" "${DTUNE_SUITES_LABEL}")
  endif()
  if(cuda_${suite})
    list(JOIN cuda_${suite} ":" filter)
    dtune_suites_entry("${binary_name}:${suite}/Cuda" "${filter}" "${DTUNE_SUITES_LABEL}")
  endif()
  foreach(name IN LISTS heavy_${suite})
    dtune_suites_entry("${name}" "${name}" "heavy")
  endforeach()
endforeach()
file(WRITE "${DTUNE_SUITES_LIST}" "${script}")

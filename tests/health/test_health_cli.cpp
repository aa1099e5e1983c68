// `dtune health` as a user runs it (the real binary): DTUNE_INJECT_GPU_FAULT simulates a GPU where
// there is no NVML, as `dtune train` does, so the fault path ends in exit 75 on any machine; and
// without NVML and injection the check cannot run: its own message and exit code 69.
#include <gtest/gtest.h>

#include "support/shell.h"
#include "support/test_support.h"

namespace dtune {
namespace test_health_cli_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

using test::contains;
using test::run_shell;

TEST(HealthCli, InjectedFaultTripsTheBreakerWithOrWithoutNvml) {
    const auto ecc = run_shell("DTUNE_INJECT_GPU_FAULT=ecc " + std::string(DTUNE_BIN) + " health 2>&1");
    EXPECT_EQ(ecc.exit_code, 75) << ecc.output;
    EXPECT_TRUE(contains(ecc.output, "FAULT ")) << ecc.output;
    const auto thermal =
        run_shell("DTUNE_INJECT_GPU_FAULT=thermal " + std::string(DTUNE_BIN) + " health 2>&1");
    EXPECT_EQ(thermal.exit_code, 0) << thermal.output;  // thermal slowdown alone is a warning
    EXPECT_TRUE(contains(thermal.output, "warn ")) << thermal.output;
}

TEST(HealthCli, NoNvmlIsItsOwnExitCodeAndMessage) {
    const auto plain = run_shell(std::string(DTUNE_BIN) + " health 2>&1");
    if (plain.exit_code == 0 || plain.exit_code == 75) GTEST_SKIP() << "NVML is available here";
    EXPECT_EQ(plain.exit_code, 69) << plain.output;
    EXPECT_TRUE(contains(plain.output, "cannot check GPU health on this machine: NVML is not available"))
        << plain.output;
    EXPECT_TRUE(contains(plain.output, "DTUNE_INJECT_GPU_FAULT")) << plain.output;
}

}  // namespace
}  // namespace test_health_cli_local
}  // namespace dtune

// DTUNE_FUSED_KERNELS parsing (core/fused_env.h); the switches that follow it are tested with the
// models (test_group_norm_act_unit.cpp) and end to end (TrainCli.FusedKernelsCanBeTurnedOffForTriage).
#include "core/fused_env.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>

#include "core/error.h"

namespace dtune {
namespace test_fused_env_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

TEST(FusedEnv, ValuesOnOffAndUnknown) {
    for (const char* on : {"", "1", "on", "true"}) EXPECT_EQ(parse_fused_kernels_value(on), true) << on;
    for (const char* off : {"0", "off", "false"}) EXPECT_EQ(parse_fused_kernels_value(off), false) << off;
    for (const char* bad : {"2", "no", "OFF ", "yes please"})
        EXPECT_EQ(parse_fused_kernels_value(bad), std::nullopt);
}

TEST(FusedEnv, ReadsTheVariableEachTime) {
    ::unsetenv("DTUNE_FUSED_KERNELS");
    EXPECT_TRUE(fused_kernels_allowed());
    ::setenv("DTUNE_FUSED_KERNELS", "off", 1);
    EXPECT_FALSE(fused_kernels_allowed());
    ::setenv("DTUNE_FUSED_KERNELS", "sometimes", 1);
    try {
        fused_kernels_allowed();
        ADD_FAILURE() << "no error for an unknown value";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("DTUNE_FUSED_KERNELS='sometimes'"), std::string::npos)
            << e.what();
    }
    ::unsetenv("DTUNE_FUSED_KERNELS");
}

// A per-path switch (DTUNE_FUSED_QKV, DTUNE_FUSED_QK_NORM_ROPE, ...): unset or empty is on, the same
// words as above otherwise, and anything else a usage error naming the variable and both choices.
TEST(FusedEnv, PerPathSwitchesDefaultOnAndNameTheirChoices) {
    const char* name = "DTUNE_TEST_FUSED_SWITCH";
    ::unsetenv(name);
    EXPECT_TRUE(fused_switch_from_env(name, "one kernel", "the composite ops"));
    ::setenv(name, "", 1);
    EXPECT_TRUE(fused_switch_from_env(name, "one kernel", "the composite ops"));
    ::setenv(name, "off", 1);
    EXPECT_FALSE(fused_switch_from_env(name, "one kernel", "the composite ops"));
    ::setenv(name, "1", 1);
    EXPECT_TRUE(fused_switch_from_env(name, "one kernel", "the composite ops"));
    ::setenv(name, "maybe", 1);
    try {
        fused_switch_from_env(name, "one kernel", "the composite ops");
        ADD_FAILURE() << "no error for an unknown value";
    } catch (const UsageError& e) {
        EXPECT_EQ(std::string(e.what()),
                  "DTUNE_TEST_FUSED_SWITCH=maybe is not a choice: use 1 (one kernel, the default) or 0 (the "
                  "composite ops)");
    }
    ::unsetenv(name);
}

// The object the per-path switches are: read on first use (not at construction), a bad value an
// error on every read until fixed, set() overriding the environment, enabled() also asking
// DTUNE_FUSED_KERNELS.
TEST(FusedEnv, PathSwitchReadsOnFirstUseAndCanBeSet) {
    const char* name = "DTUNE_TEST_FUSED_PATH_SWITCH";
    ::setenv(name, "maybe", 1);
    FusedPathSwitch path{name, "one kernel", "the composite ops"};  // constructing reads nothing
    EXPECT_THROW(path.on(), UsageError);
    EXPECT_THROW(path.on(), UsageError);  // not cached as either value
    ::setenv(name, "0", 1);
    EXPECT_FALSE(path.on());
    ::setenv(name, "1", 1);
    EXPECT_FALSE(path.on());  // read once
    path.set(true);
    EXPECT_TRUE(path.on());
    EXPECT_TRUE(path.enabled());
    ::setenv("DTUNE_FUSED_KERNELS", "0", 1);
    EXPECT_TRUE(path.on());
    EXPECT_FALSE(path.enabled());
    ::unsetenv("DTUNE_FUSED_KERNELS");
    FusedPathSwitch preset{name, "one kernel", "the composite ops"};
    ::setenv(name, "maybe", 1);
    preset.set(false);  // set before any read: the environment is never consulted
    EXPECT_FALSE(preset.on());
    ::unsetenv(name);
}

}  // namespace
}  // namespace test_fused_env_local
}  // namespace dtune

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

}  // namespace
}  // namespace test_fused_env_local
}  // namespace dtune

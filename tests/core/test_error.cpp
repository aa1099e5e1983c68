#include <gtest/gtest.h>

#include "core/error.h"

namespace dtune {

TEST(Error, CheckThrowsWithConcatenatedMessage) {
    int rank = 3;
    try {
        DTUNE_CHECK(rank < 2, "lora_rank ", rank, " is too large; use 1");
        FAIL() << "DTUNE_CHECK did not throw";
    } catch (const Error& e) {
        EXPECT_STREQ(e.what(), "lora_rank 3 is too large; use 1");
        EXPECT_EQ(e.code(), ExitCode::kError);
    }
}

TEST(Error, CheckPassesSilently) {
    EXPECT_NO_THROW(DTUNE_CHECK(1 + 1 == 2, "never"));
}

TEST(Error, CheckEqNamesBothValues) {
    try {
        DTUNE_CHECK_EQ(2 + 2, 5, "sum mismatch");
        FAIL();
    } catch (const Error& e) {
        EXPECT_EQ(std::string(e.what()), "sum mismatch (got 2 + 2=4, expected 5=5)");
    }
}

TEST(Error, TypedChecksCarryExitCodes) {
    EXPECT_THROW(DTUNE_CHECK_AS(UsageError, false, "x"), UsageError);
    try {
        DTUNE_CHECK_AS(DataError, false, "corrupt");
    } catch (const Error& e) {
        EXPECT_EQ(e.code(), ExitCode::kData);
    }
    try {
        throw UsageError("bad key");
    } catch (const Error& e) {
        EXPECT_EQ(static_cast<int>(e.code()), 2);
    }
}

}  // namespace dtune

#include <gtest/gtest.h>

#include "core/dtype.h"
#include "core/error.h"

namespace dtune {

TEST(DType, MixedPrecisionSemantics) {
    EXPECT_EQ(parse_mixed_precision("bf16"), MixedPrecision::kBF16);
    EXPECT_EQ(parse_mixed_precision("FP16"), MixedPrecision::kFP16);
    EXPECT_EQ(parse_mixed_precision("no"), MixedPrecision::kNo);
    EXPECT_EQ(compute_dtype(MixedPrecision::kBF16), c10::kBFloat16);
    EXPECT_EQ(compute_dtype(MixedPrecision::kFP16), c10::kHalf);
    EXPECT_EQ(compute_dtype(MixedPrecision::kNo), c10::kFloat);
    EXPECT_EQ(master_dtype(MixedPrecision::kBF16, false), c10::kFloat);
    EXPECT_EQ(master_dtype(MixedPrecision::kBF16, true), c10::kBFloat16);
    EXPECT_EQ(master_dtype(MixedPrecision::kFP16, true), c10::kFloat);
    try {
        parse_mixed_precision("fp8");
        FAIL();
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("'fp8'"), std::string::npos);
    }
}

TEST(DType, NamesRoundTrip) {
    for (auto t : {c10::kFloat, c10::kBFloat16, c10::kHalf, c10::kDouble, c10::kLong, c10::kInt, c10::kByte,
                   c10::kBool})
        EXPECT_EQ(parse_dtype(dtype_name(t)), t) << dtype_name(t);
    EXPECT_EQ(parse_dtype("bfloat16"), c10::kBFloat16);
    EXPECT_THROW(parse_dtype("complex64"), UsageError);
}

TEST(DType, Devices) {
    EXPECT_TRUE(parse_device("cpu").is_cpu());
    EXPECT_THROW(parse_device("tpu:0"), UsageError);
    if (!cuda_available()) {
        EXPECT_TRUE(parse_device("auto").is_cpu());
        EXPECT_THROW(parse_device("cuda:0"), UsageError);
    } else {
        EXPECT_TRUE(parse_device("auto").is_cuda());
        EXPECT_THROW(parse_device("cuda:999"), UsageError);
        EXPECT_THROW(parse_device("cuda:x"), UsageError);
        EXPECT_TRUE(parse_device("cuda:0").is_cuda());
    }
    EXPECT_THROW(parse_device("cuda:1:2"), UsageError);
}

}  // namespace dtune

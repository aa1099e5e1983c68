// LR schedules against diffusers.optimization's curves (tests/data/ref/train_ref.json, made by
// tools/ref/gen_train_ref.py) and SimpleTuner's sine against hand-computed values.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "train/lr_schedule.h"

namespace dtune::train {
namespace test_lr_schedule_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

TEST(LRSchedule, MatchesDiffusersCurves) {
    const auto path = std::filesystem::path(DTUNE_TEST_DATA_DIR) / "ref" / "train_ref.json";
    const auto json = nlohmann::json::parse(fs::read_file(path));
    int cases = 0;
    for (const auto& [case_name, c] : json.at("schedules").items()) {
        SCOPED_TRACE(case_name);
        LRScheduleOptions o;
        o.type = parse_lr_schedule(c.at("name").get<std::string>(), 0);
        if (case_name == "constant_with_warmup") o.type = LRScheduleType::kConstantWithWarmup;
        o.base_lr = c.at("base_lr").get<double>();
        o.warmup_steps = c.value("num_warmup_steps", 0);
        o.training_steps = c.value("num_training_steps", 0);
        if (c.contains("num_cycles")) o.num_cycles = c.at("num_cycles").get<double>();
        if (c.contains("power")) o.power = c.at("power").get<double>();
        if (c.contains("lr_end")) o.lr_end = c.at("lr_end").get<double>();
        const LRSchedule s(o);
        const auto& lrs = c.at("lrs");
        for (size_t k = 0; k < lrs.size(); ++k) {
            const double expected = lrs[k].get<double>();
            EXPECT_NEAR(s.lr(static_cast<int64_t>(k)), expected, 1e-15 + 1e-12 * std::abs(expected))
                << "step " << k;
        }
        ++cases;
    }
    EXPECT_EQ(cases, 7);
}

TEST(LRSchedule, SineIsSimpleTunersWave) {
    LRScheduleOptions o;
    o.type = LRScheduleType::kSine;
    o.base_lr = 1e-3;
    o.lr_end = 1e-4;
    o.warmup_steps = 10;  // the half period
    const LRSchedule s(o);
    EXPECT_NEAR(s.lr(0), 5.5e-4, 1.1e-9);  // midpoint: no warmup ramp
    EXPECT_NEAR(s.lr(5), 1e-3, 1.1e-9);    // crest
    EXPECT_NEAR(s.lr(15), 1e-4, 1.1e-9);   // trough
    EXPECT_NEAR(s.lr(25), 1e-3, 1.1e-9);   // and again: continuous, no restarts
    // Truncated to 1e-9 like SimpleTuner writes it.
    for (int64_t k = 0; k < 40; ++k) EXPECT_NEAR(std::round(s.lr(k) * 1e9), s.lr(k) * 1e9, 1e-3);
}

TEST(LRSchedule, NamesAndValidation) {
    EXPECT_EQ(parse_lr_schedule("constant", 0), LRScheduleType::kConstant);
    EXPECT_EQ(parse_lr_schedule("constant", 100), LRScheduleType::kConstantWithWarmup);
    EXPECT_EQ(parse_lr_schedule("cosine_with_warmup", 0), LRScheduleType::kCosine);
    EXPECT_THROW(parse_lr_schedule("onecycle", 0), UsageError);
    LRScheduleOptions o;
    o.type = LRScheduleType::kPolynomial;
    o.training_steps = 100;
    o.base_lr = 1e-4;
    o.lr_end = 1e-3;
    EXPECT_THROW(LRSchedule{o}, UsageError);
    o.type = LRScheduleType::kCosine;
    o.training_steps = 0;
    EXPECT_THROW(LRSchedule{o}, UsageError);
    o.type = LRScheduleType::kSine;
    o.warmup_steps = 0;
    EXPECT_THROW(LRSchedule{o}, UsageError);
    // Defaults are SimpleTuner's: constant_with_warmup at 4e-7, no warmup.
    const LRSchedule d{LRScheduleOptions{}};
    EXPECT_DOUBLE_EQ(d.lr(0), 4e-7);
    EXPECT_DOUBLE_EQ(d.multiplier(1000), 1.0);
}

}  // namespace
}  // namespace test_lr_schedule_local
}  // namespace dtune::train

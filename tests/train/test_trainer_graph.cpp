// cuda_graph on the CPU (tiny SDXL fixture): the conditions cuda_graph_blocker reports, and a CPU
// run with cuda_graph true trains eagerly, warns why once, and gives bit-identical weights to the
// same run with cuda_graph false; left at auto (the default) a CPU run says nothing.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "core/log.h"
#include "train/trainer_graph.h"
#include "trainer_test_util.h"

namespace dtune::train {
namespace {

using testutil::tiny_config;

// A configuration every condition accepts (on a CUDA device, one process).
TrainConfig graph_friendly(const std::filesystem::path& out, const nlohmann::json& extra = {}) {
    nlohmann::json j{{"deterministic", false},    {"grad_clip_method", "norm"}, {"max_grad_norm", 1.0},
                     {"mixed_precision", "bf16"}, {"model_type", "lora"},       {"lora_dropout", 0.0},
                     {"cuda_graph", true}};
    if (!extra.is_null()) j.update(extra);
    return tiny_config(out, 2, j);
}

TEST(CudaGraphConditions, NamesTheFirstUnmetCondition) {
    test::TempDir dir;
    const c10::Device cuda(c10::kCUDA, 0);  // a Device value only: no CUDA needed
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path()), cuda, 1), "");
    EXPECT_EQ(
        cuda_graph_blocker(
            graph_friendly(dir.path(), {{"grad_clip_method", "value"}, {"max_grad_norm", 0.0}}), cuda, 1),
        "");  // no clipping at all: nothing to clip by value
    const std::vector<std::pair<nlohmann::json, std::string>> cases = {
        {{{"offload_optimizer_device", "cpu"}}, "offload_optimizer_device is cpu"},
        {{{"gradient_accumulation_steps", 2}}, "gradient_accumulation_steps is 2"},
        {{{"optimizer", "optimi-lion"}}, "optimizer is optimi-lion"},
        {{{"deterministic", true}}, "deterministic is true"},
        {{{"mixed_precision", "fp16"}}, "mixed_precision is fp16"},
        {{{"offset_noise", true}}, "offset_noise is true"},
        {{{"input_perturbation", 0.1}}, "input_perturbation is not 0"},
        {{{"snr_gamma", 5.0}}, "snr_gamma is set"},
        {{{"loss_type", "huber"}}, "loss_type is huber"},
        {{{"timestep_bias_strategy", "later"}}, "timestep_bias_strategy is later"},
        {{{"diff2flow_enabled", true}, {"diff2flow_loss", true}}, "diff2flow_loss is on"},
    };
    for (const auto& [extra, expected] : cases) {
        const std::string got = cuda_graph_blocker(graph_friendly(dir.path(), extra), cuda, 1);
        EXPECT_EQ(got.rfind(expected, 0), 0u) << extra.dump() << " gave: " << got;
    }
    // SimpleTuner's defaults (clip by value at 2, lora_dropout 0.1) are graphed: the clamp and the
    // dropout seed are device work inside the step.
    EXPECT_EQ(cuda_graph_blocker(
                  tiny_config(dir.path(), 2, {{"deterministic", false}, {"model_type", "lora"}}), cuda, 1),
              "");
    EXPECT_EQ(
        cuda_graph_blocker(graph_friendly(dir.path(), {{"grad_clip_method", "value"}, {"lora_dropout", 0.1}}),
                           cuda, 1),
        "");
    // optimi-adamw is the same fused AdamW.
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path(), {{"optimizer", "optimi-adamw"}}), cuda, 1), "");
    // adamw_bf16 keeps its LR and bias correction on the device and never reads back (#6).
    EXPECT_EQ(cuda_graph_blocker(
                  graph_friendly(dir.path(), {{"optimizer", "adamw_bf16"}, {"model_type", "full"}}), cuda, 1),
              "");
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path()), cuda, 2), "");  // the all-reduce is captured
    // ZeRO-1 graphs (the same all-reduce; broadcasts after the replay); ZeRO-2/3 do not.
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path()), cuda, 2, 1), "");
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path()), cuda, 2, 2).rfind("zero_stage is 2", 0), 0u);
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path()), cuda, 4, 3).rfind("zero_stage is 3", 0), 0u);
    EXPECT_EQ(cuda_graph_blocker(graph_friendly(dir.path()), cuda, 1, 1), "");  // one rank: no sharding
    EXPECT_EQ(
        cuda_graph_blocker(graph_friendly(dir.path()), c10::Device(c10::kCPU), 1).rfind("device is cpu", 0),
        0u);
}

std::string read_text(const std::filesystem::path& p) {
    std::ifstream in(p);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
}

// Trains 3 LoRA steps on the CPU; returns the trainable tensors and the run's log.
std::vector<at::Tensor> train_cpu(const nlohmann::json& cuda_graph, std::string& log_text) {
    test::TempDir dir;
    const auto log_file = dir.path() / "run.log";
    log::set_file(log_file);
    auto trainer = testutil::make_trainer(tiny_config(
        dir.path() / "out", 3,
        {{"model_type", "lora"}, {"lora_rank", 4}, {"lora_dropout", 0.0}, {"cuda_graph", cuda_graph}}));
    trainer->run();
    log::set_file({});
    log_text = read_text(log_file);
    EXPECT_EQ(trainer->graphed_step(), nullptr);
    std::vector<at::Tensor> out;
    bool trained = false;  // lora_B starts at zero: non-zero means the steps changed the weights
    for (const auto& p : trainer->trainable_parameters()) {
        out.push_back(p.tensor.detach().clone());
        if (p.name.find("lora_B") != std::string::npos) trained |= p.tensor.abs().max().item<double>() > 0;
    }
    EXPECT_TRUE(trained);
    return out;
}

TEST(CudaGraphTrainer, CpuRunTrainsEagerlyWithIdenticalWeights) {
    std::string log_off, log_on;
    std::string log_auto;
    const auto off = train_cpu(false, log_off);
    const auto on = train_cpu(true, log_on);
    const auto automatic = train_cpu("auto", log_auto);
    EXPECT_EQ(log_off.find("cuda_graph"), std::string::npos) << log_off;
    EXPECT_EQ(log_auto.find("cuda_graph"), std::string::npos) << log_auto;
    EXPECT_NE(log_on.find("cuda_graph: training eagerly because device is cpu"), std::string::npos) << log_on;
    EXPECT_NE(log_on.find(" warn: cuda_graph: training eagerly"), std::string::npos) << log_on;
    ASSERT_EQ(automatic.size(), on.size());
    for (size_t i = 0; i < on.size(); ++i) EXPECT_TRUE(at::equal(automatic[i], on[i])) << "tensor " << i;
    ASSERT_EQ(off.size(), on.size());
    ASSERT_FALSE(off.empty());
    for (size_t i = 0; i < off.size(); ++i) EXPECT_TRUE(at::equal(off[i], on[i])) << "tensor " << i;
}

}  // namespace
}  // namespace dtune::train

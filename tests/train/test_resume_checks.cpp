// A resume refuses a checkpoint whose files were altered after the save, naming the file and the
// tensor or field, instead of resuming a different run: a weight of another shape (it used to
// broadcast into the model's), another dtype, or holding NaN; an optimizer tensor gone; a field of
// training_state.json of the wrong type (it used to escape as the JSON library's bare error).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "core/error.h"
#include "core/fs.h"
#include "io/safetensors.h"
#include "support/test_support.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "trainer_test_util.h"

namespace dtune::train {
namespace test_resume_checks_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

using testutil::synthetic;
using testutil::tiny_config;
using testutil::tiny_schedule;
using testutil::tiny_unet;

constexpr const char* kWeights = "unet/diffusion_pytorch_model.safetensors";

void run_steps(const std::filesystem::path& out, int64_t steps) {
    Trainer trainer(tiny_config(out, steps), testutil::sdxl_model(tiny_unet()), tiny_schedule(), synthetic());
    trainer.run();
}

// A 2-step run with its checkpoint-2; `alter` edits the checkpoint; the 4-step resume must throw
// DataError whose message holds every one of `expected`. Returns the message.
std::string resume_error(const std::function<void(const std::filesystem::path& ckpt)>& alter,
                         const std::vector<std::string>& expected) {
    test::TempDir dir;
    run_steps(dir.path(), 2);
    const auto ckpt = dir / "checkpoint-2";
    EXPECT_TRUE(checkpoint_problem(ckpt).empty());
    alter(ckpt);
    try {
        run_steps(dir.path(), 4);
        ADD_FAILURE() << "the altered checkpoint was resumed";
        return "";
    } catch (const DataError& e) {
        const std::string msg = e.what();
        for (const auto& part : expected) EXPECT_NE(msg.find(part), std::string::npos) << part << "\n" << msg;
        return msg;
    }
}

// Rewrites one tensor file of the checkpoint with `edit` applied to its tensor list.
void edit_tensors(const std::filesystem::path& file, const std::function<void(io::TensorList&)>& edit) {
    io::TensorList list;
    for (auto& [k, v] : io::load_safetensors(file)) list.emplace_back(k, v.clone());
    edit(list);
    io::save_safetensors(file, list);
}

at::Tensor& tensor_named(io::TensorList& list, const std::string& name) {
    for (auto& [k, v] : list)
        if (k == name) return v;
    throw Error("no tensor " + name);
}

TEST(ResumeChecks, WeightOfAnotherShapeIsRefused) {
    // conv_in.weight [C, 4, 3, 3] replaced by its [C, 4, 1, 1] centre tap: copy_ broadcast it into
    // every kernel tap and the run resumed with exit code 0.
    resume_error(
        [](const auto& ckpt) {
            edit_tensors(ckpt / kWeights, [](io::TensorList& l) {
                at::Tensor& w = tensor_named(l, "conv_in.weight");
                ASSERT_EQ(w.dim(), 4);
                w = w.narrow(2, 1, 1).narrow(3, 1, 1).contiguous();
            });
        },
        {(std::filesystem::path("checkpoint-2") / kWeights).string(), "tensor 'conv_in.weight'", "[",
         "but the model's is"});
}

TEST(ResumeChecks, WeightOfAnotherDtypeIsRefused) {
    resume_error(
        [](const auto& ckpt) {
            edit_tensors(ckpt / kWeights, [](io::TensorList& l) {
                tensor_named(l, "conv_in.bias") = tensor_named(l, "conv_in.bias").to(at::kDouble);
            });
        },
        {"tensor 'conv_in.bias'", "fp64", "fp32"});
}

TEST(ResumeChecks, NonFiniteWeightIsRefused) {
    resume_error(
        [](const auto& ckpt) {
            edit_tensors(ckpt / kWeights,
                         [](io::TensorList& l) { tensor_named(l, "conv_in.bias")[0] = std::nan(""); });
        },
        {kWeights, "tensor 'conv_in.bias'", "NaN or infinite"});
}

TEST(ResumeChecks, MissingOptimizerTensorIsNamed) {
    // One AdamW moment gone from optimizer.safetensors: it used to resume with that state fresh.
    std::string removed;
    const std::string msg = resume_error(
        [&](const auto& ckpt) {
            edit_tensors(ckpt / "optimizer.safetensors", [&](io::TensorList& l) {
                ASSERT_GT(l.size(), 1u);
                removed = l[l.size() / 2].first;
                l.erase(l.begin() + static_cast<std::ptrdiff_t>(l.size() / 2));
            });
        },
        {"checkpoint-2", "optimizer.safetensors has no tensor '"});
    ASSERT_FALSE(removed.empty());
    EXPECT_NE(msg.find("has no tensor '" + removed + "'"), std::string::npos) << msg;
}

// Rewrites training_state.json with `edit` applied.
void edit_state(const std::filesystem::path& ckpt, const std::function<void(nlohmann::json&)>& edit) {
    auto j = nlohmann::json::parse(fs::read_file(ckpt / "training_state.json"));
    edit(j);
    fs::write_file_atomic(ckpt / "training_state.json", j.dump(2));
}

TEST(ResumeChecks, TrainingStateFieldOfTheWrongTypeIsNamed) {
    resume_error(
        [](const auto& ckpt) { edit_state(ckpt, [](nlohmann::json& j) { j["global_step"] = "2"; }); },
        {"training_state.json", "\"global_step\"", "not an integer"});
    resume_error(
        [](const auto& ckpt) { edit_state(ckpt, [](nlohmann::json& j) { j.erase("global_step"); }); },
        {"training_state.json has no field \"global_step\""});
    resume_error(
        [](const auto& ckpt) {
            edit_state(ckpt, [](nlohmann::json& j) { j["batch_source"]["served"] = "4"; });
        },
        {"training_state.json", "\"batch_source\"", "malformed"});
}

}  // namespace
}  // namespace test_resume_checks_local
}  // namespace dtune::train

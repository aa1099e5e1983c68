// Full fine-tune exports on the tiny fixture: output_dir/pipeline/ loads with our SDXLPipeline loader
// to exactly the trained UNet and the base model's other components; the single-file checkpoint loads
// back (SDXLPipeline::load_single_file with the base folder as config) to the same tensors; the
// checkpoint's unet/ is a loadable component; LoRA runs refuse export_single_file.
#include <gtest/gtest.h>

#include <map>

#include "core/error.h"
#include "family/export.h"
#include "io/safetensors.h"
#include "trainer_test_util.h"
#include "validate/sdxl_pipeline.h"

namespace dtune::train {
namespace test_export_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

using testutil::make_trainer;
using testutil::tiny_config;
using testutil::tiny_model;

std::map<std::string, at::Tensor> by_name(const io::TensorList& list) {
    return {list.begin(), list.end()};
}

// Every tensor of `module` equals the same-named tensor of `expected`, and the key sets agree.
void expect_same(const torch::nn::Module& module, const std::map<std::string, at::Tensor>& expected,
                 const std::string& what) {
    const auto got = models::state_dict(module);
    EXPECT_EQ(got.size(), expected.size()) << what;
    int64_t differing = 0;
    for (const auto& [k, v] : got) {
        auto it = expected.find(k);
        if (it == expected.end() || !at::equal(it->second, v)) ++differing;
    }
    EXPECT_EQ(differing, 0) << what;
}

TEST(TrainExport, PipelineFolderAndSingleFileLoadBackExactly) {
    test::TempDir dir;
    auto trainer = make_trainer(tiny_config(dir.path(), 1,
                                            {{"pretrained_model_name_or_path", tiny_model().string()},
                                             {"export_single_file", true},
                                             {"caption_dropout_probability", 0.0}}));
    trainer->run();
    const auto trained = by_name(models::state_dict(*testutil::unet_of(*trainer)));
    const auto base_unet = by_name(models::state_dict(*testutil::tiny_unet()));
    int64_t changed = 0;
    for (const auto& [k, v] : base_unet) changed += at::equal(trained.at(k), v) ? 0 : 1;
    EXPECT_GT(changed, 0) << "training changed nothing: the comparison would be vacuous";

    auto base = validate::SDXLPipeline::load(tiny_model());
    const auto base_vae = by_name(models::state_dict(*base.vae()));

    auto folder = validate::SDXLPipeline::load(dir / "pipeline");
    expect_same(*folder.unet(), trained, "pipeline/unet");
    expect_same(*folder.vae(), base_vae, "pipeline/vae");
    EXPECT_EQ(nlohmann::json::parse(fs::read_file(dir / "pipeline" / "model_index.json")),
              nlohmann::json::parse(fs::read_file(tiny_model() / "model_index.json")));
    for (const char* f : {"tokenizer/vocab.json", "tokenizer_2/merges.txt", "scheduler/scheduler_config.json",
                          "text_encoder_2/model.safetensors"})
        EXPECT_EQ(fs::read_file(dir / "pipeline" / f), fs::read_file(tiny_model() / f)) << f;

    auto single = validate::SDXLPipeline::load_single_file(dir / "sdxl_checkpoint.safetensors", tiny_model());
    expect_same(*single.unet(), trained, "single-file unet");
    expect_same(*single.vae(), base_vae, "single-file vae");

    // The checkpoint's unet/ is a diffusers component folder too.
    auto ckpt_unet = models::load_unet(dir / "checkpoint-1" / "unet");
    expect_same(*ckpt_unet, trained, "checkpoint-1/unet");
    EXPECT_FALSE(std::filesystem::exists(dir / "pipeline.tmp"));
}

TEST(TrainExport, LinkOrCopyTreeReproducesTheFiles) {
    test::TempDir dir;
    fs::write_file_atomic(dir / "src" / "a.txt", "alpha");
    fs::write_file_atomic(dir / "src" / "sub" / "b.txt", "beta");
    family::link_or_copy_tree(dir / "src", dir / "dst");
    EXPECT_EQ(fs::read_file(dir / "dst" / "a.txt"), "alpha");
    EXPECT_EQ(fs::read_file(dir / "dst" / "sub" / "b.txt"), "beta");
}

TEST(TrainExport, SingleFileNeedsAFullFineTune) {
    test::TempDir dir;
    EXPECT_THROW(
        make_trainer(tiny_config(dir.path(), 1, {{"model_type", "lora"}, {"export_single_file", true}})),
        UsageError);
}

}  // namespace
}  // namespace test_export_local
}  // namespace dtune::train

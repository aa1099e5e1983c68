// Flux.1 LoRA training against a reference loop written with diffusers + peft + torch.optim
// (tools/ref/gen_flux_train_ref.py -> tests/data/ref/flux_train_ref.*): ten steps of dtune's
// Trainer on the tiny Flux.1 [dev] transformer (tests/data/ref/tiny-flux-dev) with the same
// latents, text embeddings, noise, sigmas and guidance, and the same initial lora_A, give the same
// loss and gradient norm at every step and the same adapters after step 10.
//
// What it pins down: the flow-matching step (noisy latents, sigma as the model's timestep, the
// noise - x0 target, MSE), the 2x2 packing and image / text ids, the embedded guidance (1.0 when a
// batch carries none, the batch's own otherwise), the LoRA targets and scale, norm clipping and
// AdamW with dtune's default betas, epsilon and weight decay. The reference file also records how
// far each of those conventions, changed, moves the result; the test checks its tolerance is far
// below every one of them.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <set>

#include "core/fs.h"
#include "family/flux/flux_family.h"
#include "io/safetensors.h"
#include "support/test_support.h"
#include "train/adapters.h"
#include "train/trainer.h"

namespace dtune::train {
namespace test_flux_train_parity_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

namespace stdfs = std::filesystem;

const stdfs::path kRef = stdfs::path(DTUNE_TEST_DATA_DIR) / "ref";

// Relative tolerances (float32 on the CPU; the measured gaps are ~1e-7 for losses and ~1e-6 for
// the adapters' updates).
constexpr double kLossTol = 1e-5;
constexpr double kUpdateTol = 1e-4;  // |update - reference update| / |reference update| per tensor

struct Reference {
    std::map<std::string, at::Tensor> t;
    nlohmann::json settings;
    Reference() {
        for (auto& [name, tensor] : io::load_safetensors(kRef / "flux_train_ref.safetensors"))
            t[name] = tensor;
        settings = nlohmann::json::parse(fs::read_file(kRef / "flux_train_ref.json"));
    }
    const at::Tensor& at(const std::string& name) const {
        const auto it = t.find(name);
        if (it == t.end()) throw std::runtime_error("flux_train_ref.safetensors has no " + name);
        return it->second;
    }
};

// Step i's batch from the reference: latents and the Flux conditioning names; from step
// guidance_in_batch_from_step on, the batch carries its own guidance.
class ReferenceBatches final : public BatchSource {
  public:
    explicit ReferenceBatches(const Reference& ref)
        : ref_(ref), guided_from_(ref.settings.at("guidance_in_batch_from_step").get<int64_t>()) {}
    TrainBatch next(at::Generator&) override {
        const int64_t i = served_++;
        TrainBatch b;
        b.latents = ref_.at("latents")[i].clone();  // [B, 4, 12, 16]
        for (const char* name : {"prompt_embeds", "pooled_prompt_embeds", "attention_mask"})
            b.cond[name] = ref_.at(name)[i].clone();
        if (i >= guided_from_) b.cond["guidance"] = ref_.at("guidance")[i].clone();  // [B]
        b.captions.assign(static_cast<size_t>(b.latents.size(0)), "reference");
        return b;
    }
    int64_t batches_per_epoch() const override { return ref_.at("latents").size(0); }
    int64_t epoch() const override { return served_ / batches_per_epoch(); }
    PromptEmbedding empty_prompt() override {
        PromptEmbedding e;
        for (const char* name : {"prompt_embeds", "pooled_prompt_embeds", "attention_mask"})
            e[name] = at::zeros_like(ref_.at(name)[0][0]);
        return e;
    }
    nlohmann::json state() const override { return {{"served", served_}}; }
    void load_state(const nlohmann::json& state) override { served_ = state.at("served").get<int64_t>(); }

  private:
    const Reference& ref_;
    int64_t guided_from_;
    int64_t served_ = 0;
};

struct StepLog final : TrainCallback {
    std::vector<double> losses, grad_norms;
    void on_step_metrics(Trainer&, const StepReport& r) override {
        losses.push_back(r.loss);
        grad_norms.push_back(r.grad_norm);
    }
};

TrainConfig parity_config(const nlohmann::json& s, const stdfs::path& out) {
    TrainConfig c;
    // Betas, epsilon and weight decay stay at dtune's defaults (checked against the reference's below).
    c.merge_json(nlohmann::json{{"model_family", "flux"},
                                {"model_type", "lora"},
                                {"output_dir", out.string()},
                                {"lora_rank", s.at("lora_rank")},
                                {"lora_alpha", s.at("lora_alpha")},
                                {"lora_dropout", 0.0},
                                {"optimizer", s.at("optimizer")},
                                {"learning_rate", s.at("learning_rate")},
                                {"lr_scheduler", s.at("lr_scheduler")},
                                {"grad_clip_method", s.at("grad_clip_method")},
                                {"max_grad_norm", s.at("max_grad_norm")},
                                {"train_batch_size", s.at("batch")},
                                {"max_train_steps", s.at("steps")},
                                {"checkpoint_step_interval", 0},
                                {"caption_dropout_probability", 0.0},
                                {"mixed_precision", "no"},
                                {"gradient_checkpointing", false},
                                {"deterministic", true},
                                {"seed", 7},
                                {"metrics_interval", 1}},
                 "flux parity test");
    c.validate();
    return c;
}

double rel(double a, double b) {
    return std::abs(a - b) / std::max(std::abs(b), 1e-12);
}

TEST(FluxTrainParity, TenLoRAStepsMatchDiffusersPeftReference) {
    const Reference ref;
    const auto& s = ref.settings;
    test::TempDir dir;
    const TrainConfig config = parity_config(s, dir / "run");
    for (const char* key : {"adam_beta1", "adam_beta2", "adam_epsilon", "adam_weight_decay"})
        ASSERT_DOUBLE_EQ(config.real(key), s.at(key).get<double>())
            << key << ": dtune's default is not what the reference trained with; rerun "
            << "tools/ref/gen_flux_train_ref.py with the new default";

    const family::ModelFamily& flux = family::flux_family();
    auto model = flux.load_denoiser(kRef / "tiny-flux-dev", {at::kFloat, c10::Device(c10::kCPU)});
    Trainer trainer(config, std::move(model), flux.training_objective(kRef / "tiny-flux-dev"),
                    std::make_unique<ReferenceBatches>(ref));
    trainer.set_fixed_flow_draws([&ref](int64_t step, const at::Tensor& latents) {
        FlowDraws d{ref.at("noise")[step].clone(), ref.at("sigmas")[step].clone()};
        EXPECT_EQ(d.noise.sizes(), latents.sizes());
        return d;
    });
    auto log = std::make_shared<StepLog>();
    trainer.add_callback(log);

    // Start from the reference's lora_A (lora_B is zero in both libraries).
    ASSERT_NE(trainer.lora(), nullptr);
    const io::TensorList adapters = trainer.lora()->trainable();
    std::set<std::string> ours, theirs;
    for (const auto& [name, tensor] : adapters) ours.insert(name);
    for (const auto& [name, tensor] : ref.t)
        if (name.rfind("final.", 0) == 0) theirs.insert(name.substr(6));
    ASSERT_EQ(ours, theirs) << "dtune's Flux LoRA targets differ from peft's on the same target list";
    ASSERT_EQ(ours.size(), s.at("adapters").get<size_t>());
    std::map<std::string, at::Tensor> start;
    {
        at::NoGradGuard no_grad;
        for (const auto& [name, tensor] : adapters) {
            if (name.find("lora_A") != std::string::npos) {
                tensor.copy_(ref.at("init." + name));
            } else {
                ASSERT_EQ(tensor.abs().max().item<double>(), 0.0) << name << " does not start at zero";
            }
            start[name] = tensor.detach().clone();
        }
    }

    const TrainResult result = trainer.run();
    ASSERT_EQ(result.global_step, s.at("steps").get<int64_t>());

    const at::Tensor losses = ref.at("losses"), norms = ref.at("grad_norms");
    ASSERT_EQ(log->losses.size(), static_cast<size_t>(losses.size(0)));
    double worst_loss = 0, worst_norm = 0;
    for (int64_t i = 0; i < losses.size(0); ++i) {
        worst_loss = std::max(worst_loss, rel(log->losses[i], losses[i].item<double>()));
        worst_norm = std::max(worst_norm, rel(log->grad_norms[i], norms[i].item<double>()));
        EXPECT_LT(rel(log->losses[i], losses[i].item<double>()), kLossTol)
            << "step " << i + 1 << " loss " << log->losses[i] << " vs " << losses[i].item<double>();
        EXPECT_LT(rel(log->grad_norms[i], norms[i].item<double>()), kLossTol)
            << "step " << i + 1 << " grad norm " << log->grad_norms[i] << " vs " << norms[i].item<double>();
    }
    double worst = 0;
    std::string worst_name;
    for (const auto& [name, tensor] : adapters) {
        const at::Tensor ours_update = tensor.detach() - start[name];
        const at::Tensor ref_update = ref.at("final." + name) - start[name];
        const double norm = ref_update.norm().item<double>();
        ASSERT_GT(norm, 0.0) << name << " did not train in the reference";
        const double r = (ours_update - ref_update).norm().item<double>() / norm;
        if (r > worst) worst = r, worst_name = name;
        EXPECT_LT(r, kUpdateTol) << name << ": the update differs from the reference by " << r
                                 << " (relative)";
    }
    std::printf(
        "flux training parity: worst relative gap: loss %.3g, gradient norm %.3g, adapter update %.3g (%s)\n",
        worst_loss, worst_norm, worst, worst_name.c_str());

    // The tolerance separates the right step from each wrong one the reference tried.
    for (const auto& [variant, dev] : s.at("variant_deviation").items())
        EXPECT_TRUE(dev.at("weights").get<double>() > 10 * kUpdateTol ||
                    dev.at("losses").get<double>() > 10 * kLossTol)
            << "the reference's variant '" << variant << "' is within 10x of the tolerance";
}

}  // namespace
}  // namespace test_flux_train_parity_local
}  // namespace dtune::train

// ZeRO-3 with model_type lora in `dtune train` (label dist): the real `dtune launch` with 2 and 3
// CPU ranks over Gloo, the tiny SDXL and tiny Flux fixtures. The frozen base is sharded per block,
// the adapters are replicated. Judged against runs of the same binary that do not shard:
//  - N ranks with zero_stage 3 train the adapters one process trains with the global batch (SGD,
//    so float summation order is all the tolerance covers), with and without gradient
//    checkpointing, with lora_dropout's masks, with DoRA on attention and ResNet convs (and its
//    EMA), and equal plain data parallelism on 2 ranks bit for bit (the same all-reduce of the
//    same gradients);
//  - the base bytes resident on each rank between steps are ~1/N (read from the per-rank line the
//    trainer logs from the engine's measured storages), and no optimizer slice exists;
//  - a 2-rank ZeRO-3 LoRA checkpoint (the adapter file + optimizer files) resumes exactly on one
//    process and on 3 sharded ranks;
//  - validation images during a ZeRO-3 LoRA run equal plain data parallelism's;
//  - with the base's shards in host memory (offload_param_device cpu) and the adapters' AdamW
//    there too, plain data parallelism's adapters bit for bit, and no base bytes on the device;
//  - a quantised base is still refused.
// And the engine itself (in process, 2 Gloo ranks as threads, a stack of frozen Linear blocks of
// which some carry a trainable scale): the adapter gradients, averaged, equal the unsharded ones;
// no slices; every block is released as soon as its backward is over (measured from the storages
// when the gradient reaches the stack's input), with and without gradient checkpointing.
#include <gtest/gtest.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include <cstdio>
#include <future>
#include <sstream>

#include "core/fs.h"
#include "dist/group.h"
#include "dist/loopback_group.h"
#include "dist/train_launch_util.h"
#include "dist/zero3.h"
#include "dist/zero3_test_util.h"
#include "models/common/checkpoint.h"
#include "models/common/unit_hooks.h"
#include "support/tiny_flux_data.h"
#include "train/zero3_model.h"

namespace dtune {
namespace zero3_lora_multi_test_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

struct BaseLine {
    int rank = -1;
    long long resident = 0, full = 0, gathers = 0;
};

// "ZeRO-3 rank R: between steps X of Y frozen base bytes resident (G unit gathers ...)", one per rank.
std::vector<BaseLine> base_lines(const std::string& output) {
    std::vector<BaseLine> out;
    std::istringstream in(output);
    for (std::string line; std::getline(in, line);) {
        const auto at = line.find("ZeRO-3 rank ");
        if (at == std::string::npos || line.find("between steps") == std::string::npos) continue;
        BaseLine r;
        const int n = std::sscanf(
            line.c_str() + at, "ZeRO-3 rank %d: between steps %lld of %lld frozen base bytes resident (%lld",
            &r.rank, &r.resident, &r.full, &r.gathers);
        EXPECT_EQ(n, 4) << line;
        out.push_back(r);
    }
    return out;
}

// Each rank holds ~1/N of the base between steps (padding adds < N elements per block).
void expect_one_nth(const std::string& output, int ranks, long long slack) {
    const auto lines = base_lines(output);
    ASSERT_EQ(lines.size(), static_cast<std::size_t>(ranks)) << output;
    for (const auto& l : lines) {
        std::printf("  rank %d: %lld of %lld frozen base bytes resident, %lld gathers in step 1\n", l.rank,
                    l.resident, l.full, l.gathers);
        EXPECT_GT(l.gathers, 0);
        EXPECT_GE(l.resident * ranks, l.full);
        EXPECT_LE(l.resident, l.full / ranks + slack) << "rank " << l.rank;
    }
}

std::map<std::string, at::Tensor> adapters(const std::filesystem::path& file) {
    std::map<std::string, at::Tensor> m;
    for (auto& [k, v] : io::load_safetensors(file)) m[k] = v.clone();
    return m;
}

std::map<std::string, at::Tensor> final_adapters(const std::filesystem::path& out) {
    return adapters(out / "pytorch_lora_weights.safetensors");
}

const std::string kLoRA = "--model_type lora --lora_rank 4 ";

TEST(DistZero3LoRA, RanksEqualOneProcessWithTheGlobalBatchAndHoldOneNthOfTheBase) {
    Workspace w;
    keep_six_images(w);
    const std::string common = kLoRA + "--max_train_steps 3 ";
    const auto single = run_shell(w.train(0, "single", common + "--train_batch_size 6"));
    ASSERT_EQ(single.exit_code, 0) << single.output;
    const auto plain2 = run_shell(w.train(2, "plain2", common + "--train_batch_size 3"));
    ASSERT_EQ(plain2.exit_code, 0) << plain2.output;
    const auto a = final_adapters(w.out("single"));
    ASSERT_FALSE(a.empty());
    // The adapters trained: the up factors (SDXL's diffusers keys ".lora.up.weight") start at zero.
    double moved = 0;
    for (const auto& [k, v] : a)
        if (k.find(".lora.up.") != std::string::npos) moved = std::max(moved, v.abs().max().item<double>());
    std::printf("the adapters' up factors moved by up to %.3g from zero\n", moved);
    EXPECT_GT(moved, 1e-4);
    for (const int ranks : {2, 3}) {
        for (const bool checkpointing : {false, true}) {
            if (ranks == 3 && !checkpointing) continue;  // 3 ranks once is enough
            const std::string name = "zero3_" + std::to_string(ranks) + (checkpointing ? "_gc" : "");
            const auto run =
                run_shell("DTUNE_CHECK_RANK_WEIGHTS=1 " +
                          w.train(ranks, name,
                                  common + "--zero_stage 3 --train_batch_size " + std::to_string(6 / ranks) +
                                      " --gradient_checkpointing " + (checkpointing ? "true" : "false")));
            ASSERT_EQ(run.exit_code, 0) << run.output;
            EXPECT_TRUE(contains(run.output, "frozen base sharded")) << run.output;
            const double diff = max_difference(a, final_adapters(w.out(name)));
            std::printf("ZeRO-3 LoRA, %d ranks%s vs 1 process with the global batch: max |dw| = %.3g\n",
                        ranks, checkpointing ? ", gradient checkpointing" : "", diff);
            EXPECT_LE(diff, 1e-6);
            if (ranks == 2 && !checkpointing) {
                // The same all-reduce of the same adapter gradients as plain data parallelism.
                const double to_plain =
                    max_difference(final_adapters(w.out("plain2")), final_adapters(w.out(name)));
                std::printf("ZeRO-3 LoRA vs plain data parallel, 2 ranks: max |dw| = %.3g\n", to_plain);
                EXPECT_EQ(to_plain, 0.0);
            }
            expect_one_nth(run.output, ranks, 64 * 1024);
            // A LoRA checkpoint: the adapters, and no whole UNet.
            EXPECT_TRUE(
                std::filesystem::exists(w.out(name) / "checkpoint-2/pytorch_lora_weights.safetensors"));
            EXPECT_FALSE(std::filesystem::exists(w.out(name) / "checkpoint-2/unet"));
        }
    }
}

// DoRA's magnitude is taken from the whole base weight when the adapters are injected, before the
// base is sharded; its forward reads the gathered weight. Adapters on the ResNets' conv1 too (LoCon),
// so ResNet units carry adapters as well. With use_ema: the EMA of the replicated adapters.
TEST(DistZero3LoRA, DoRAOnAttentionAndConvsWithEMAEqualsOneProcess) {
    Workspace w;
    keep_six_images(w);
    const std::string dora = kLoRA +
                             "--use_dora true --use_ema true --peft_lora_target_modules "
                             "'[\"to_q\",\"to_k\",\"to_v\",\"to_out.0\",\"conv1\"]' --max_train_steps 2 ";
    const auto single = run_shell(w.train(0, "single", dora + "--train_batch_size 6"));
    ASSERT_EQ(single.exit_code, 0) << single.output;
    const auto run = run_shell(
        w.train(2, "zero3", dora + "--zero_stage 3 --train_batch_size 3 --gradient_checkpointing true"));
    ASSERT_EQ(run.exit_code, 0) << run.output;
    const auto a = final_adapters(w.out("single"));
    bool magnitude = false, conv = false;
    for (const auto& [k, v] : a) {
        magnitude |= k.find("lora_magnitude_vector") != std::string::npos;
        conv |= k.find("conv1") != std::string::npos;
    }
    EXPECT_TRUE(magnitude && conv);
    const double diff = max_difference(a, final_adapters(w.out("zero3")));
    std::printf("ZeRO-3 DoRA (attention + conv1), 2 ranks vs 1 process: max |dw| = %.3g\n", diff);
    EXPECT_LE(diff, 1e-6);
    const auto ema = adapters(w.out("single") / "ema/pytorch_lora_weights.safetensors");
    const double ema_diff =
        max_difference(ema, adapters(w.out("zero3") / "ema/pytorch_lora_weights.safetensors"));
    std::printf("  and its EMA: max |dw| = %.3g (EMA vs live weights: %.3g)\n", ema_diff,
                max_difference(a, ema));
    EXPECT_LE(ema_diff, 1e-6);
    expect_one_nth(run.output, 2, 64 * 1024);
}

// A 2-rank ZeRO-3 LoRA checkpoint continued by one process, and by 3 ZeRO-3 ranks, equals the
// same continuation of a plain 2-rank run's checkpoint (AdamW: its state must come back exactly).
TEST(DistZero3LoRA, CheckpointOfTwoRanksResumesExactlyOnOtherWorldSizes) {
    Workspace w;
    keep_six_images(w);
    const std::string adam = kLoRA + "--optimizer torch-adamw --learning_rate 1e-3 ";
    const std::string two = adam + "--train_batch_size 3 --max_train_steps 3 ";
    const auto plain = run_shell(w.train(2, "plain2", two));
    ASSERT_EQ(plain.exit_code, 0) << plain.output;
    const auto zero = run_shell(w.train(2, "zero3_2", two + "--zero_stage 3"));
    ASSERT_EQ(zero.exit_code, 0) << zero.output;
    const auto ckpt = w.out("zero3_2") / "checkpoint-2";
    EXPECT_EQ(max_difference(adapters(w.out("plain2") / "checkpoint-2/pytorch_lora_weights.safetensors"),
                             adapters(ckpt / "pytorch_lora_weights.safetensors")),
              0.0);
    // Both ranks hold the whole (identical) adapter state: no "@" slices.
    for (int r = 0; r < 2; ++r)
        for (auto& [k, v] :
             io::load_safetensors(ckpt / ("optimizer-shard-" + std::to_string(r) + "-of-2.safetensors")))
            EXPECT_EQ(k.find('@'), std::string::npos) << k;
    struct Continuation {
        int ranks;
        std::string args;
    };
    for (const Continuation& c :
         {Continuation{0, adam + "--train_batch_size 6 --max_train_steps 4"},
          Continuation{3, adam + "--train_batch_size 2 --max_train_steps 4 --zero_stage 3"}}) {
        for (const char* from : {"plain2", "zero3_2"}) {
            const std::string to = std::string(from) + "_then_" + std::to_string(c.ranks);
            resume_into(w.out(from), w.out(to));
            const auto r = run_shell(w.train(c.ranks, to, c.args));
            ASSERT_EQ(r.exit_code, 0) << r.output;
            EXPECT_TRUE(contains(r.output, "resumed from")) << r.output;
        }
        const std::string suffix = "_then_" + std::to_string(c.ranks);
        const auto resumed = final_adapters(w.out("zero3_2" + suffix));
        const double d = max_difference(final_adapters(w.out("plain2" + suffix)), resumed);
        std::printf(
            "ZeRO-3 LoRA checkpoint of 2 ranks resumed on %d: max |dw| vs the plain checkpoint = %.3g\n",
            c.ranks == 0 ? 1 : c.ranks, d);
        EXPECT_EQ(d, 0.0);
        // And it trained on from the step-2 adapters.
        EXPECT_GT(max_difference(adapters(ckpt / "pytorch_lora_weights.safetensors"), resumed), 1e-6);
    }
}

// Validation during training samples with the whole base (every rank gathers it at the same step)
// and the adapters: the images equal plain data parallelism's.
TEST(DistZero3LoRA, ValidationImagesEqualPlainDataParallel) {
    Workspace w;
    keep_six_images(w);
    const std::string args = kLoRA +
                             "--max_train_steps 2 --train_batch_size 3 --gradient_checkpointing true "
                             "--validation_prompt 'a cat' --validation_step_interval 1 "
                             "--validation_num_inference_steps 2 --validation_resolution 64x64";
    expect_zero3_validation_equals_plain(w, args);
}

// offload_param_device cpu: the base's shards live in host memory and are copied to the device
// right before their all-gathers (on CPU ranks the same code path runs, host to host); with
// offload_optimizer_device cpu the adapters' AdamW runs in host memory too. Judged against plain
// data parallelism on 2 ranks with neither (AdamW's normalised step turns float summation noise
// into ~lr-sized differences, so one process with the global batch is no tight reference here).
TEST(DistZero3LoRA, OffloadedBaseShardsAndOptimizerEqualPlainDataParallel) {
    Workspace w;
    keep_six_images(w);
    const std::string common = kLoRA +
                               "--max_train_steps 2 --gradient_checkpointing true --optimizer torch-adamw "
                               "--learning_rate 1e-3 --train_batch_size 3 ";
    const auto plain = run_shell(w.train(2, "plain", common));
    ASSERT_EQ(plain.exit_code, 0) << plain.output;
    const auto run = run_shell(w.train(
        2, "offload", common + "--zero_stage 3 --offload_param_device cpu --offload_optimizer_device cpu"));
    ASSERT_EQ(run.exit_code, 0) << run.output;
    EXPECT_TRUE(contains(run.output, "state and update in host memory")) << run.output;
    const auto a = final_adapters(w.out("plain"));
    double moved = 0;  // the up factors start at zero
    for (const auto& [k, v] : a)
        if (k.find(".lora.up.") != std::string::npos) moved = std::max(moved, v.abs().max().item<double>());
    const double diff = max_difference(a, final_adapters(w.out("offload")));
    std::printf(
        "ZeRO-3 LoRA, base shards and optimizer offloaded, vs plain data parallel (2 ranks, AdamW): "
        "max |dw| = %.3g (the up factors moved by %.3g)\n",
        diff, moved);
    EXPECT_EQ(diff, 0.0);
    EXPECT_GT(moved, 1e-4);
    // Between steps the device holds none of the base; host memory holds each rank's half.
    const auto lines = base_lines(run.output);
    ASSERT_EQ(lines.size(), 2u) << run.output;
    std::istringstream in(run.output);
    int host_lines = 0;
    for (std::string line; std::getline(in, line);) {
        const auto at = line.find("prefetched; ");
        if (line.find("between steps") == std::string::npos || at == std::string::npos) continue;
        const long long host = std::stoll(line.substr(at + 12));
        std::printf("  %s\n", line.c_str() + line.find("ZeRO-3 rank"));
        EXPECT_GE(host * 2, lines[0].full);
        EXPECT_LE(host, lines[0].full / 2 + 64 * 1024);
        ++host_lines;
    }
    EXPECT_EQ(host_lines, 2);
    for (const auto& l : lines) EXPECT_EQ(l.resident, 0) << "rank " << l.rank;
}

TEST(DistZero3LoRA, QuantisedBaseIsRefusedWithTheFix) {
    Workspace w;
    const auto r = run_shell(w.train(2, "quant",
                                     kLoRA + "--zero_stage 3 --base_model_precision int8-quanto "
                                             "--max_train_steps 1 --train_batch_size 1"));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, "cannot shard a quantised base model")) << r.output;
}

// The tiny Flux pipeline (FluxWorkspace): a LoRA on both streams' attention (flux_lora_target
// all, the default) of its double and single blocks, each block a unit of the sharded base.
TEST(DistZero3LoRA, FluxRanksEqualOneProcessWithTheGlobalBatch) {
    FluxWorkspace w(nlohmann::json{{"model_type", "lora"}, {"lora_rank", 4}});
    const auto single = run_shell(w.train(0, "single", "--train_batch_size 4 --max_train_steps 3"));
    ASSERT_EQ(single.exit_code, 0) << single.output;
    const auto a = final_adapters(w.out("single"));
    double moved = 0;  // lora_B starts at zero
    for (const auto& [k, v] : a)
        if (k.find("lora_B") != std::string::npos) moved = std::max(moved, v.abs().max().item<double>());
    EXPECT_GT(moved, 1e-4) << "the reference run must train the adapters";
    for (const bool checkpointing : {false, true}) {
        const std::string name = checkpointing ? "zero3_gc" : "zero3";
        const auto run = run_shell("DTUNE_CHECK_RANK_WEIGHTS=1 " +
                                   w.train(2, name,
                                           "--zero_stage 3 --max_train_steps 3 --train_batch_size 2 "
                                           "--gradient_checkpointing " +
                                               std::string(checkpointing ? "true" : "false")));
        ASSERT_EQ(run.exit_code, 0) << run.output;
        const double diff = max_difference(a, final_adapters(w.out(name)));
        std::printf("Flux LoRA, ZeRO-3 on 2 ranks%s vs 1 process with the global batch: max |dw| = %.3g\n",
                    checkpointing ? ", gradient checkpointing" : "", diff);
        EXPECT_LE(diff, 1e-6);
        expect_one_nth(run.output, 2, 1024);
    }
}

// --- The engine with a frozen base, in process -------------------------------------------------

constexpr int64_t kDim = 8;
constexpr int kBlocks = 4;

// Frozen a, b; odd blocks carry a trainable per-channel scale (the "adapter", not sharded).
struct FrozenBlockImpl : torch::nn::Module, models::HookableUnit {
    explicit FrozenBlockImpl(bool adapted) {
        a = register_module("a", torch::nn::Linear(kDim, 2 * kDim));
        b = register_module("b", torch::nn::Linear(2 * kDim, kDim));
        if (adapted) scale = register_parameter("scale", at::full({kDim}, 0.5));
    }
    at::Tensor forward(const at::Tensor& x) {  // [B, D]
        at::Tensor y = b(at::gelu(a(x)));
        return x + (scale.defined() ? y * scale : y);
    }
    torch::nn::Linear a{nullptr}, b{nullptr};
    at::Tensor scale;
};
TORCH_MODULE(FrozenBlock);

struct FrozenStackImpl : torch::nn::Module {
    FrozenStackImpl() {
        proj_in = register_module("proj_in", torch::nn::Linear(kDim, kDim));
        in_scale = register_parameter("in_scale", at::full({kDim}, 1.5));
        auto list = register_module("blocks", torch::nn::ModuleList());
        for (int i = 0; i < kBlocks; ++i) {
            blocks.push_back(FrozenBlock(i % 2 == 1));
            list->push_back(blocks.back());
        }
        proj_out = register_module("proj_out", torch::nn::Linear(kDim, 1));
        at::NoGradGuard no_grad;
        int64_t k = 0;
        for (auto& p : parameters())
            p.copy_(
                at::sin(at::arange(p.numel(), at::kFloat) * 0.37 + static_cast<double>(++k)).view(p.sizes()) *
                    0.3 +
                (p.dim() == 1 && p.numel() == kDim ? 1.0 : 0.0));
        for (auto& item : named_parameters())
            item.value().set_requires_grad(item.key().find("scale") != std::string::npos);
    }
    // `on_input_grad`: called when the gradient reaches the blocks' input.
    at::Tensor forward(const at::Tensor& x, bool checkpointing, const std::function<void()>& on_input_grad) {
        at::Tensor h = proj_in(x) * in_scale;  // requires grad through in_scale
        if (on_input_grad) h.register_hook([on_input_grad](const at::Tensor&) { on_input_grad(); });
        for (auto& block : blocks) {
            if (checkpointing) {
                auto fn = [impl = block.ptr()](const std::vector<at::Tensor>& in) {
                    return models::run_unit(*impl, [&] { return impl->forward(in[0]); });
                };
                std::vector<at::Tensor> trainable;
                for (auto& p : block->parameters())
                    if (p.requires_grad()) trainable.push_back(p);
                h = models::checkpointed(fn, {h}, trainable);
            } else {
                h = models::run_unit(*block, [&] { return block->forward(h); });
            }
        }
        return proj_out(h);  // [B, 1]
    }
    torch::nn::Linear proj_in{nullptr}, proj_out{nullptr};
    at::Tensor in_scale;
    std::vector<FrozenBlock> blocks;
};
TORCH_MODULE(FrozenStack);

at::Tensor frozen_batch(int rank) {
    return at::cos(at::arange(2 * kDim, at::kFloat) * (0.13 + 0.07 * rank)).view({2, kDim});
}

struct FrozenRankResult {
    std::map<std::string, at::Tensor> grads;  // averaged over the ranks
    std::size_t slices = 0;
    // The shards plus the gathered root (measured after begin_forward(), before any block ran).
    int64_t shard = 0, resident_root_only = 0, resident_at_input = -1, resident_after = 0, gathers = 0;
    std::size_t units = 0;
};

FrozenRankResult run_frozen_rank(int rank, int world, int port, bool checkpointing) {
    auto group = test::loopback_group(rank, world, port);
    FrozenStack model;
    std::vector<std::string> names;
    std::vector<at::Tensor> base, trainable;
    std::vector<std::string> trainable_names;
    for (const auto& item : model->named_parameters()) {
        if (item.value().requires_grad()) {
            trainable_names.push_back(item.key());
            trainable.push_back(item.value());
            continue;
        }
        names.push_back(item.key());
        base.push_back(item.value());
    }
    dist::Zero3Options zo;
    zo.prefetch = 0;  // gathered where used: the release points alone decide what is resident
    train::ShardedModel sharded(*group, *model, names, base, zo, /*frozen=*/true);
    dist::Zero3Engine& engine = sharded.engine();
    FrozenRankResult r;
    r.units = engine.unit_count();
    r.slices = engine.slices().size();
    r.shard = engine.shard_bytes();
    const int64_t gathers_before = engine.gathers();
    engine.begin_forward();
    r.resident_root_only = engine.resident_parameter_bytes();
    const at::Tensor loss = model
                                ->forward(frozen_batch(rank), checkpointing,
                                          [&] { r.resident_at_input = engine.resident_parameter_bytes(); })
                                .square()
                                .mean();
    loss.backward();
    engine.finish_backward();
    r.gathers = engine.gathers() - gathers_before;
    r.resident_after = engine.resident_parameter_bytes();
    for (std::size_t i = 0; i < trainable.size(); ++i) {
        at::Tensor g = trainable[i].grad().clone();
        group->all_reduce_sum_(g);
        r.grads[trainable_names[i]] = g / world;
    }
    for (const auto& p : base) EXPECT_FALSE(p.grad().defined());
    group->barrier();
    group->shutdown();
    return r;
}

TEST(DistZero3LoRA, EngineReleasesFrozenBlocksAfterTheirBackwardAndAveragesAdapters) {
    constexpr int kWorld = 2;
    for (const bool checkpointing : {false, true}) {
        SCOPED_TRACE(testing::Message() << "checkpointing " << checkpointing);
        FrozenStack reference;
        std::vector<at::Tensor> xs;
        for (int r = 0; r < kWorld; ++r) xs.push_back(frozen_batch(r));
        reference->forward(at::cat(xs), false, {}).square().mean().backward();
        const int port = test::free_port();
        std::vector<std::future<FrozenRankResult>> futures;
        for (int r = 0; r < kWorld; ++r)
            futures.push_back(std::async(std::launch::async, [r, port, checkpointing] {
                return run_frozen_rank(r, kWorld, port, checkpointing);
            }));
        for (auto& f : futures) {
            const FrozenRankResult r = f.get();
            EXPECT_EQ(r.units, static_cast<std::size_t>(kBlocks + 1));
            EXPECT_EQ(r.slices, 0u) << "a frozen base gives the optimizer nothing";
            for (const auto& item : reference->named_parameters()) {
                if (!item.value().requires_grad()) continue;
                ASSERT_TRUE(r.grads.count(item.key())) << item.key();
                // float rounding, relative to the gradient's size (the per-rank means are summed)
                const double size = std::max(1.0, item.value().grad().abs().max().item<double>());
                EXPECT_LE((r.grads.at(item.key()) - item.value().grad()).abs().max().item<double>(),
                          1e-6 * size)
                    << item.key() << " (largest element " << size << ")";
            }
            // When the gradient reaches the blocks' input, every block's backward is over: only the
            // shards and the (whole-step) root are resident, no block is left gathered.
            std::printf(
                "frozen base%s: %lld bytes resident at the input's gradient (shards + root: %lld), "
                "%lld after the step (shards %lld), %lld gathers\n",
                checkpointing ? ", checkpointing" : "", static_cast<long long>(r.resident_at_input),
                static_cast<long long>(r.resident_root_only), static_cast<long long>(r.resident_after),
                static_cast<long long>(r.shard), static_cast<long long>(r.gathers));
            EXPECT_GT(r.resident_root_only, r.shard);
            EXPECT_EQ(r.resident_at_input, r.resident_root_only) << "blocks still gathered";
            EXPECT_EQ(r.resident_after, r.shard);
            // Forward gathers every unit once, backward each block once more (its own gather, or
            // the recomputation's).
            EXPECT_EQ(r.gathers, 1 + 2 * kBlocks);
        }
    }
}

}  // namespace
}  // namespace zero3_lora_multi_test_local
}  // namespace dtune

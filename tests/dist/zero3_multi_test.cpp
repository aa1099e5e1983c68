// ZeRO-3 in `dtune train` (label dist): the real `dtune launch` with 2 and 3 CPU ranks over Gloo,
// the tiny SDXL fixture, a full fine-tune. Judged against runs of the same binary that do not
// shard parameters:
//  - N ranks with zero_stage 3 train the weights one process trains with the global batch (SGD,
//    so float summation order is all the tolerance covers), with and without gradient
//    checkpointing, and equal plain data parallelism on 2 ranks exactly;
//  - the parameter bytes resident on each rank between steps are ~1/N of the model (read from the
//    per-rank line the trainer logs from the engine's measured storages);
//  - the all-gather prefetch (on by default) trains bit-identical weights to gathering each block
//    when it is needed (DTUNE_ZERO3_PREFETCH=0), and the logged counter shows prefetched gathers;
//  - offload with ZeRO-3: the optimizer (offload_optimizer_device cpu), and the parameter shards
//    too (offload_param_device cpu, nothing resident on the device between steps), train the
//    weights and optimizer state of the run without offload, and their checkpoints resume exactly;
//  - a ZeRO-3 checkpoint resumes exactly on another world size (2 -> 3 sharded, 3 -> 1 process):
//    its optimizer shards hold exactly the whole state, and a resumed run equals the run resumed
//    from the plain whole-state checkpoint;
//  - the same on the tiny Flux pipeline (a second family whose double/single stream blocks carry
//    the unit hooks): 2 ranks equal one process, with and without gradient checkpointing, hold
//    half the parameter bytes, and a 2-rank checkpoint resumes exactly on one process.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "core/fs.h"
#include "dist/train_launch_util.h"
#include "dist/zero3_test_util.h"
#include "support/tiny_flux_data.h"

namespace dtune {
namespace zero3_multi_test_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

struct ResidentLine {
    int rank = -1;
    long long resident = 0, full = 0, gathers = 0, prefetched = 0, host = 0;
};

// The "ZeRO-3 rank R: between steps X of Y parameter bytes resident (G unit gathers in the first
// step, P prefetched; H shard bytes in host memory)" lines the trainer logs after the first step,
// one per rank.
std::vector<ResidentLine> resident_lines(const std::string& output) {
    std::vector<ResidentLine> out;
    std::istringstream in(output);
    for (std::string line; std::getline(in, line);) {
        const auto at = line.find("ZeRO-3 rank ");
        if (at == std::string::npos || line.find("between steps") == std::string::npos) continue;
        ResidentLine r;
        const int n =
            std::sscanf(line.c_str() + at,
                        "ZeRO-3 rank %d: between steps %lld of %lld parameter bytes resident (%lld unit "
                        "gathers in the first step, %lld prefetched; %lld shard bytes in host memory",
                        &r.rank, &r.resident, &r.full, &r.gathers, &r.prefetched, &r.host);
        EXPECT_EQ(n, 6) << line;
        out.push_back(r);
    }
    return out;
}

// Whole per-parameter optimizer state from a ZeRO-3 checkpoint's shard files, assembled by the
// test itself from the "<name>@<begin>.<state>" slices.
std::map<std::string, at::Tensor> merged_shards(const std::filesystem::path& dir, int world) {
    std::map<std::string, std::map<int64_t, at::Tensor>> pieces;
    for (int r = 0; r < world; ++r)
        for (auto& [k, v] : io::load_safetensors(dir / ("optimizer-shard-" + std::to_string(r) + "-of-" +
                                                        std::to_string(world) + ".safetensors"))) {
            const auto at = k.rfind('@');
            EXPECT_NE(at, std::string::npos) << k;
            const auto dot = k.find('.', at);
            pieces[k.substr(0, at) + k.substr(dot)][std::stoll(k.substr(at + 1, dot - at - 1))] = v.clone();
        }
    std::map<std::string, at::Tensor> out;
    for (auto& [k, by_begin] : pieces) {
        std::vector<at::Tensor> parts;
        for (auto& [b, t] : by_begin) parts.push_back(t.reshape({-1}));
        if (by_begin.begin()->second.dim() == 0) {  // a per-parameter scalar (AdamW's step): one per slice
            for (const auto& p : parts) EXPECT_TRUE(at::equal(p, parts[0])) << k;
            out[k] = by_begin.begin()->second;
            continue;
        }
        out[k] = at::cat(parts);
    }
    return out;
}

void resume_into(const Workspace& w, const std::string& from, const std::string& to) {
    dtune::resume_into(w.out(from), w.out(to));
}

TEST(DistZero3, RanksEqualOneProcessWithTheGlobalBatchAndHoldOneNthOfTheParameters) {
    Workspace w;
    keep_six_images(w);
    const auto single = run_shell(w.train(0, "single", "--train_batch_size 6 --max_train_steps 3"));
    ASSERT_EQ(single.exit_code, 0) << single.output;
    const auto plain2 = run_shell(w.train(2, "plain2", "--train_batch_size 3 --max_train_steps 3"));
    ASSERT_EQ(plain2.exit_code, 0) << plain2.output;
    const auto a = final_weights(w.out("single"));
    for (const int ranks : {2, 3}) {
        for (const bool checkpointing : {false, true}) {
            if (ranks == 3 && !checkpointing) continue;  // 3 uneven shards: the checkpointed run suffices
            const std::string name = "zero3_" + std::to_string(ranks) + (checkpointing ? "_gc" : "");
            const auto run = run_shell("DTUNE_CHECK_RANK_WEIGHTS=1 " +
                                       w.train(ranks, name,
                                               "--zero_stage 3 --max_train_steps 3 --train_batch_size " +
                                                   std::to_string(6 / ranks) + " --gradient_checkpointing " +
                                                   (checkpointing ? "true" : "false")));
            ASSERT_EQ(run.exit_code, 0) << run.output;
            EXPECT_TRUE(contains(run.output, "ZeRO stage 3")) << run.output;
            const double diff = max_difference(a, final_weights(w.out(name)));
            std::printf("ZeRO-3, %d ranks%s vs 1 process with the global batch: max |dw| = %.3g\n", ranks,
                        checkpointing ? ", gradient checkpointing" : "", diff);
            EXPECT_LE(diff, 1e-6);
            if (ranks == 2 && checkpointing) {
                // The prefetch changes when gathers run, not what is computed: bit-identical, with the
                // recomputation's gathers too (Zero3Engine.PrefetchEqualsGatheringOnDemand covers both
                // cases in-process).
                const auto sync = run_shell("DTUNE_ZERO3_PREFETCH=0 " +
                                            w.train(ranks, name + "_sync",
                                                    "--zero_stage 3 --max_train_steps 3 --train_batch_size 3 "
                                                    "--gradient_checkpointing " +
                                                        std::string(checkpointing ? "true" : "false")));
                ASSERT_EQ(sync.exit_code, 0) << sync.output;
                const double to_sync =
                    max_difference(final_weights(w.out(name + "_sync")), final_weights(w.out(name)));
                std::printf("ZeRO-3, 2 ranks%s: prefetch vs gathering on demand: max |dw| = %.3g\n",
                            checkpointing ? ", gradient checkpointing" : "", to_sync);
                EXPECT_EQ(to_sync, 0.0);
                for (const auto& l : resident_lines(sync.output)) {
                    EXPECT_EQ(l.prefetched, 0) << "rank " << l.rank;
                }
            }
            if (ranks == 2 && !checkpointing) {
                // Reduce-scatter and all-reduce both compute a + b on 2 ranks: bit-identical.
                const double to_plain =
                    max_difference(final_weights(w.out("plain2")), final_weights(w.out(name)));
                std::printf("ZeRO-3 vs plain data parallel, 2 ranks: max |dw| = %.3g\n", to_plain);
                EXPECT_EQ(to_plain, 0.0);
            }
            // Between steps each rank holds its shards only: ~1/N of the parameter bytes (padding
            // adds < N elements per block).
            const auto lines = resident_lines(run.output);
            ASSERT_EQ(lines.size(), static_cast<std::size_t>(ranks)) << run.output;
            long long sum = 0;
            for (const auto& l : lines) {
                std::printf(
                    "  rank %d: %lld of %lld parameter bytes resident, %lld gathers in step 1 (%lld "
                    "prefetched)\n",
                    l.rank, l.resident, l.full, l.gathers, l.prefetched);
                EXPECT_GT(l.gathers, 0);
                // Every block of the backward but its first is prefetched in step 1 (the forward
                // has no recorded order yet).
                EXPECT_GT(l.prefetched, 0);
                EXPECT_LT(l.prefetched, l.gathers);
                EXPECT_EQ(l.host, 0);
                EXPECT_GE(l.resident * ranks, l.full);
                EXPECT_LE(l.resident, l.full / ranks + 64 * 1024) << "rank " << l.rank;
                sum += l.resident;
            }
            EXPECT_LT(sum, lines[0].full + 64 * 1024LL * ranks);
        }
    }
}

TEST(DistZero3, CheckpointResumesExactlyOnOtherWorldSizes) {
    Workspace w;
    keep_six_images(w);
    const std::string adam = "--optimizer torch-adamw --learning_rate 1e-3 ";
    // 2 ranks x batch 3 = 6 images per step, checkpoint at step 2 (the workspace's interval).
    const std::string two = adam + "--train_batch_size 3 --max_train_steps 3 ";
    ASSERT_EQ(run_shell(w.train(2, "plain2", two)).exit_code, 0);
    const auto zero2 = run_shell(w.train(2, "zero3_2", two + "--zero_stage 3"));
    ASSERT_EQ(zero2.exit_code, 0) << zero2.output;
    const auto ckpt = w.out("zero3_2") / "checkpoint-2";
    EXPECT_FALSE(std::filesystem::exists(ckpt / "optimizer.safetensors"));
    // The checkpoint's weights are whole (a diffusers UNet) and equal the plain run's; the shards
    // hold exactly the plain run's whole optimizer state.
    std::map<std::string, at::Tensor> w_plain, w_zero;
    for (auto& [k, v] :
         io::load_safetensors(w.out("plain2") / "checkpoint-2/unet/diffusion_pytorch_model.safetensors"))
        w_plain[k] = v.clone();
    for (auto& [k, v] : io::load_safetensors(ckpt / "unet/diffusion_pytorch_model.safetensors"))
        w_zero[k] = v.clone();
    EXPECT_EQ(max_difference(w_plain, w_zero), 0.0);
    const auto shards = merged_shards(ckpt, 2);
    std::map<std::string, at::Tensor> whole;
    for (auto& [k, v] : io::load_safetensors(w.out("plain2") / "checkpoint-2/optimizer.safetensors"))
        whole[k] = v.reshape({-1}).clone();
    ASSERT_EQ(shards.size(), whole.size());
    for (const auto& [k, v] : whole) {
        ASSERT_TRUE(shards.count(k)) << k;
        EXPECT_TRUE(at::equal(shards.at(k).reshape({-1}), v)) << k;
    }

    // 2 -> 3 ranks, sharded, same global batch (3 x 2): from the ZeRO-3 shards and from the whole
    // state, the same run.
    const std::string three = adam + "--train_batch_size 2 --max_train_steps 3 --zero_stage 3";
    resume_into(w, "zero3_2", "zero3_then_3");
    resume_into(w, "plain2", "plain_then_3");
    for (const char* to : {"zero3_then_3", "plain_then_3"}) {
        const auto r = run_shell(w.train(3, to, three));
        ASSERT_EQ(r.exit_code, 0) << r.output;
        EXPECT_TRUE(contains(r.output, "resumed from")) << r.output;
    }
    const double d23 =
        max_difference(final_weights(w.out("zero3_then_3")), final_weights(w.out("plain_then_3")));
    std::printf("3 ZeRO-3 ranks resumed from 2-rank ZeRO-3 shards vs from the whole state: max |dw| = %.3g\n",
                d23);
    EXPECT_EQ(d23, 0.0);

    // 3 -> 1: a 3-rank ZeRO-3 checkpoint continued by one process (batch 6) must equal the same
    // checkpoint with its 3 shard files replaced by one whole optimizer.safetensors that the test
    // assembles from them (3-rank plain and ZeRO-3 runs differ in float summation order on Gloo,
    // so a plain 3-rank run is no bitwise reference here).
    const auto zero3 = run_shell(w.train(3, "zero3_3", three));
    ASSERT_EQ(zero3.exit_code, 0) << zero3.output;
    resume_into(w, "zero3_3", "whole_then_1");
    {
        const auto dir = w.out("whole_then_1") / "checkpoint-2";
        std::map<std::string, at::Tensor> shapes;
        for (auto& [k, v] : io::load_safetensors(dir / "unet/diffusion_pytorch_model.safetensors"))
            shapes[k] = v;
        io::TensorList state;
        for (auto& [k, v] : merged_shards(dir, 3)) {
            const auto& like = shapes.at(k.substr(0, k.rfind('.')));
            state.emplace_back(k, v.dim() == 0 ? v : v.view(like.sizes()));
        }
        io::save_safetensors(dir / "optimizer.safetensors", state);
        auto manifest = nlohmann::json::parse(fs::read_file(dir / "checkpoint_manifest.json"));
        nlohmann::json files = nlohmann::json::array({"optimizer.safetensors"});
        for (const auto& f : manifest["files"])
            if (f.get<std::string>().rfind("optimizer-shard-", 0) == 0) {
                std::filesystem::remove(dir / f.get<std::string>());
                manifest["tensors"].erase(f.get<std::string>());
            } else {
                files.push_back(f);
            }
        manifest["files"] = files;
        fs::write_file_atomic(dir / "checkpoint_manifest.json", manifest.dump());
    }
    const std::string one = adam + "--train_batch_size 6 --max_train_steps 3";
    resume_into(w, "zero3_3", "zero3_then_1");
    for (const char* to : {"zero3_then_1", "whole_then_1"}) {
        const auto r = run_shell(w.train(0, to, one));
        ASSERT_EQ(r.exit_code, 0) << r.output;
        EXPECT_TRUE(contains(r.output, "resumed from")) << r.output;
    }
    const double d31 =
        max_difference(final_weights(w.out("zero3_then_1")), final_weights(w.out("whole_then_1")));
    std::printf("1 process resumed from 3-rank ZeRO-3 shards vs from the whole state: max |dw| = %.3g\n",
                d31);
    EXPECT_EQ(d31, 0.0);
    // And it trained on from the step-2 weights.
    std::map<std::string, at::Tensor> at_step2;
    for (auto& [k, v] :
         io::load_safetensors(w.out("zero3_3") / "checkpoint-2/unet/diffusion_pytorch_model.safetensors"))
        at_step2[k] = v.clone();
    EXPECT_GT(max_difference(at_step2, final_weights(w.out("zero3_then_1"))), 1e-5);
    // The 3-rank shards cover every parameter's state exactly once.
    const auto shards3 = merged_shards(w.out("zero3_3") / "checkpoint-2", 3);
    EXPECT_EQ(shards3.size(), whole.size());
    for (const auto& [k, v] : whole) {
        ASSERT_TRUE(shards3.count(k)) << k;
        EXPECT_EQ(shards3.at(k).numel(), v.numel()) << k;
    }
}

// Offload with ZeRO-3 on 2 ranks, AdamW (state the checkpoint must carry), gradient checkpointing
// (the recomputation gathers too): the optimizer on the host (offload_optimizer_device cpu), and the
// parameter shards there as well (accelerate's offload_param_device as `dtune launch` passes it),
// train the weights and write the optimizer shards of the run without offload, bit for bit; each
// rank holds its shards in host memory and no parameter bytes on the device between steps; and a
// run continued from their step-2 checkpoints equals the run that did not stop.
TEST(DistZero3, OffloadTrainsTheSameWeightsAndResumesExactly) {
    Workspace w;
    keep_six_images(w);
    const std::string args =
        "--optimizer torch-adamw --learning_rate 1e-3 --train_batch_size 3 --max_train_steps 3 "
        "--zero_stage 3 --gradient_checkpointing true ";
    struct Run {
        std::string name, env, extra;
    };
    const std::vector<Run> runs = {
        {"device", "", ""},
        {"optimizer", "", "--offload_optimizer_device cpu"},
        {"params", "DTUNE_OFFLOAD_PARAM_DEVICE=cpu ", "--offload_optimizer_device cpu"}};
    for (const auto& r : runs) {
        const auto out = run_shell(r.env + w.train(2, r.name, args + r.extra));
        ASSERT_EQ(out.exit_code, 0) << out.output;
        const auto lines = resident_lines(out.output);
        ASSERT_EQ(lines.size(), 2u) << out.output;
        const bool params = !r.env.empty();
        for (const auto& l : lines) {
            std::printf(
                "%s offload, rank %d: between steps %lld parameter bytes on the device, %lld in host "
                "memory, of %lld\n",
                r.name.c_str(), l.rank, l.resident, l.host, l.full);
            EXPECT_EQ(l.resident == 0, params) << r.name << " rank " << l.rank;
            EXPECT_EQ(l.host > 0, params) << r.name << " rank " << l.rank;
            const long long kept = params ? l.host : l.resident;
            EXPECT_GE(kept * 2, l.full);
            EXPECT_LE(kept, l.full / 2 + 64 * 1024) << r.name << " rank " << l.rank;
        }
        if (r.name == "device") continue;
        const double d = max_difference(final_weights(w.out("device")), final_weights(w.out(r.name)));
        std::printf("ZeRO-3 with %s offload vs none: max |dw| = %.3g\n", r.name.c_str(), d);
        EXPECT_EQ(d, 0.0);
        const auto want = merged_shards(w.out("device") / "checkpoint-2", 2);
        const auto got = merged_shards(w.out(r.name) / "checkpoint-2", 2);
        ASSERT_EQ(got.size(), want.size()) << r.name;
        for (const auto& [k, v] : want) {
            ASSERT_TRUE(got.count(k)) << r.name << " " << k;
            EXPECT_TRUE(at::equal(got.at(k), v)) << r.name << " " << k;
        }
        const std::string resumed = r.name + "_resumed";
        resume_into(w, r.name, resumed);
        const auto again = run_shell(r.env + w.train(2, resumed, args + r.extra));
        ASSERT_EQ(again.exit_code, 0) << again.output;
        EXPECT_TRUE(contains(again.output, "resumed from")) << again.output;
        const double dr = max_difference(final_weights(w.out(r.name)), final_weights(w.out(resumed)));
        std::printf("ZeRO-3 with %s offload, resumed at step 2 vs not stopped: max |dw| = %.3g\n",
                    r.name.c_str(), dr);
        EXPECT_EQ(dr, 0.0);
    }
}

// Validation during training samples with the whole weights: every rank gathers them at the same
// step and rank 0 renders; the images equal plain data parallelism's (the weights are identical on
// 2 ranks).
TEST(DistZero3, ValidationImagesUseTheWholeWeights) {
    Workspace w;
    keep_six_images(w);
    const std::string args =
        "--max_train_steps 2 --train_batch_size 3 --gradient_checkpointing true --validation_prompt 'a cat' "
        "--validation_step_interval 1 --validation_num_inference_steps 2 --validation_resolution 64x64";
    expect_zero3_validation_equals_plain(w, args);
}

// A rank that fails, or is SIGKILLed, just before its 3rd all-gather of step 2 (mid-forward)
// leaves rank 0 inside that all-gather: the job ends within seconds (not at the 300 s collective
// timeout), naming the rank.
TEST(DistZero3, RankFailingAtTheAllGatherEndsTheJobNamingIt) {
    Workspace w;
    keep_six_images(w);
    for (const std::string kind : {"error", "kill"}) {
        const auto start = std::chrono::steady_clock::now();
        const auto r = run_shell(
            "DTUNE_COLLECTIVE_TIMEOUT_S=300 DTUNE_INJECT_POINT=zero3_gather "
            "DTUNE_INJECT_STEP_ERROR=" +
            kind + ":1:2 " +
            w.train(2, "fail_" + kind, "--zero_stage 3 --max_train_steps 4 --train_batch_size 3"));
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::printf("rank 1 %s at its all-gather: the job ended after %.1f s\n", kind.c_str(), seconds);
        EXPECT_EQ(r.exit_code, 1) << r.output;
        EXPECT_LT(seconds, 60.0) << r.output;
        EXPECT_TRUE(line_with(r.output, "[rank 0]", "rank 0 stops because rank 1 failed")) << r.output;
        if (kind == "error")
            EXPECT_TRUE(contains(r.output, "injected failure (DTUNE_INJECT_STEP_ERROR) on rank 1 at step 2"))
                << r.output;
        else
            EXPECT_TRUE(contains(r.output, "killed by signal 9")) << r.output;
        // Rank 1 stopped in step 2's forward: no checkpoint of step 2 exists.
        EXPECT_FALSE(std::filesystem::exists(w.out("fail_" + kind) / "checkpoint-2")) << r.output;
    }
}

TEST(DistZero3, UnsupportedCombinationsAreRefusedWithTheFix) {
    Workspace w;  // (model_type lora trains with ZeRO-3: zero3_lora_multi_test.cpp)
    const auto adafactor = run_shell(
        w.train(2, "adafactor",
                "--fsdp_enable true --optimizer torch-adafactor --max_train_steps 1 --train_batch_size 1"));
    EXPECT_EQ(adafactor.exit_code, 2) << adafactor.output;
    EXPECT_TRUE(contains(adafactor.output, "optimizer torch-adafactor with zero_stage 3"))
        << adafactor.output;
    const auto nvme =
        run_shell("DTUNE_OFFLOAD_PARAM_DEVICE=nvme " +
                  w.train(2, "nvme", "--zero_stage 3 --max_train_steps 1 --train_batch_size 1"));
    EXPECT_EQ(nvme.exit_code, 2) << nvme.output;
    EXPECT_TRUE(contains(nvme.output,
                         "DTUNE_OFFLOAD_PARAM_DEVICE (from deepspeed_config.offload_param_device) is "
                         "'nvme'"))
        << nvme.output;
    const auto params_only = run_shell(
        w.train(2, "params_only",
                "--zero_stage 3 --offload_param_device cpu --max_train_steps 1 --train_batch_size 1"));
    EXPECT_EQ(params_only.exit_code, 2) << params_only.output;
    EXPECT_TRUE(contains(params_only.output, "offload_param_device cpu needs offload_optimizer_device cpu"))
        << params_only.output;
    // offload_param_device with ZeRO-2, a bad DTUNE_ZERO3_PREFETCH and fsdp_enable against zero_stage
    // 2 are refused while the config is resolved: DataParallelConfig.FsdpKeysMapOntoZeroStage3.
}

// The tiny Flux pipeline (FluxWorkspace), full fine-tune: one batch of 4 per epoch, which 1 and 2
// ranks split.
std::map<std::string, at::Tensor> transformer_weights(const std::filesystem::path& file) {
    std::map<std::string, at::Tensor> m;
    for (auto& [k, v] : io::load_safetensors(file)) m[k] = v.clone();
    return m;
}

std::map<std::string, at::Tensor> flux_final(const std::filesystem::path& out) {
    return transformer_weights(out / "pipeline/transformer/diffusion_pytorch_model.safetensors");
}

TEST(DistZero3, FluxRanksEqualOneProcessWithTheGlobalBatch) {
    FluxWorkspace w(nlohmann::json{{"model_type", "full"}});
    const auto single = run_shell(w.train(0, "single", "--train_batch_size 4 --max_train_steps 3"));
    ASSERT_EQ(single.exit_code, 0) << single.output;
    const auto a = flux_final(w.out("single"));
    const double moved =
        max_difference(a, transformer_weights(w.model / "transformer/diffusion_pytorch_model.safetensors"));
    EXPECT_GT(moved, 1e-4) << "the reference run must train the transformer";
    for (const bool checkpointing : {false, true}) {
        const std::string name = checkpointing ? "zero3_gc" : "zero3";
        const auto run = run_shell("DTUNE_CHECK_RANK_WEIGHTS=1 " +
                                   w.train(2, name,
                                           "--zero_stage 3 --max_train_steps 3 --train_batch_size 2 "
                                           "--gradient_checkpointing " +
                                               std::string(checkpointing ? "true" : "false")));
        ASSERT_EQ(run.exit_code, 0) << run.output;
        EXPECT_TRUE(contains(run.output, "ZeRO stage 3")) << run.output;
        const double diff = max_difference(a, flux_final(w.out(name)));
        std::printf(
            "Flux, ZeRO-3 on 2 ranks%s vs 1 process with the global batch: max |dw| = %.3g (training "
            "moved the weights by %.3g)\n",
            checkpointing ? ", gradient checkpointing" : "", diff, moved);
        EXPECT_LE(diff, 1e-6);
        // The double- and single-stream blocks are units of their own: gathered in the step, and
        // each rank holds half the parameter bytes between steps (padding adds < 2 elements a unit).
        const auto lines = resident_lines(run.output);
        ASSERT_EQ(lines.size(), 2u) << run.output;
        for (const auto& l : lines) {
            std::printf("  rank %d: %lld of %lld parameter bytes resident, %lld gathers in step 1\n", l.rank,
                        l.resident, l.full, l.gathers);
            EXPECT_GE(l.gathers, 3) << "one root unit + one double + one single block";
            EXPECT_GE(l.resident * 2, l.full);
            EXPECT_LE(l.resident, l.full / 2 + 1024) << "rank " << l.rank;
        }
    }
}

// A 2-rank ZeRO-3 checkpoint (whole transformer + 2 AdamW state shards) continued by one process
// equals the same continuation of a plain 2-rank run's checkpoint (whole optimizer state), which
// 2-rank ZeRO-3 matches bit for bit (reduce-scatter and all-reduce both compute a + b).
TEST(DistZero3, FluxCheckpointOfTwoRanksResumesExactlyOnOneProcess) {
    FluxWorkspace w(nlohmann::json{{"model_type", "full"}});
    const std::string adam = "--optimizer torch-adamw --learning_rate 1e-3 --max_train_steps 2 ";
    const auto plain = run_shell(w.train(2, "plain2", adam + "--train_batch_size 2"));
    ASSERT_EQ(plain.exit_code, 0) << plain.output;
    const auto zero = run_shell(w.train(2, "zero3_2", adam + "--train_batch_size 2 --zero_stage 3"));
    ASSERT_EQ(zero.exit_code, 0) << zero.output;
    const auto ckpt = w.out("zero3_2") / "checkpoint-2";
    EXPECT_FALSE(std::filesystem::exists(ckpt / "optimizer.safetensors"));
    EXPECT_TRUE(std::filesystem::exists(ckpt / "optimizer-shard-1-of-2.safetensors"));
    const auto weights = "transformer/diffusion_pytorch_model.safetensors";
    EXPECT_EQ(max_difference(transformer_weights(w.out("plain2") / "checkpoint-2" / weights),
                             transformer_weights(ckpt / weights)),
              0.0);
    for (const char* from : {"plain2", "zero3_2"}) {
        const std::string to = std::string(from) + "_then_1";
        dtune::resume_into(w.out(from), w.out(to));
        const auto r = run_shell(w.train(0, to,
                                         "--optimizer torch-adamw --learning_rate 1e-3 "
                                         "--max_train_steps 3 --train_batch_size 4"));
        ASSERT_EQ(r.exit_code, 0) << r.output;
        EXPECT_TRUE(contains(r.output, "resumed from")) << r.output;
    }
    const auto resumed = flux_final(w.out("zero3_2_then_1"));
    const double d = max_difference(flux_final(w.out("plain2_then_1")), resumed);
    std::printf(
        "Flux, 1 process resumed from 2-rank ZeRO-3 shards vs from the plain whole state: max |dw| = "
        "%.3g\n",
        d);
    EXPECT_EQ(d, 0.0);
    // And it trained on from the step-2 weights.
    EXPECT_GT(max_difference(transformer_weights(ckpt / weights), resumed), 1e-5);
}

}  // namespace
}  // namespace zero3_multi_test_local
}  // namespace dtune

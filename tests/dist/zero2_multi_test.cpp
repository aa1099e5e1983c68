// ZeRO-2 in `dtune train` (label dist): the real `dtune launch` with 2 CPU ranks over Gloo, the tiny
// SDXL fixture, a full fine-tune with gradient accumulation 2 and clipping by global norm. Judged
// against plain data parallelism run by the same binary (not against numbers ZeRO-2 produced):
//  - the weights and the logged gradient norms must equal plain data parallelism's;
//  - each rank must end the reduction holding no gradient of another rank's parameters (read from
//    the per-rank line the trainer logs after counting the parameters' gradients);
//  - a 2-rank ZeRO-2 checkpoint must resume on 1 process exactly as the plain run's checkpoint does;
//  - on 3 ranks, ZeRO-1 must train bit-identically to plain data parallelism and ZeRO-2 up to
//    the order of the float sums, with every rank holding exactly rank 0's weights.
//
// Why exact equality is expected: with 2 ranks the reduce-to-owner and the all-reduce both compute
// a + b (float addition is commutative), then divide by 2; the global norm is taken over the same
// per-parameter norms in the same order (see DataParallel::clip_grad_norm_async), and each rank
// multiplies its own gradients by the same coefficient. So no float reordering exists between the
// two paths; a tolerance would only hide a real difference (a shard-local norm changes the SGD
// weights by ~1e-3, a missing gradient by more).
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "dist/train_launch_util.h"

namespace dtune {
namespace zero2_multi_test_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

// The flags both equivalence runs share: 2 ranks x batch 1 x accumulation 2 (4 images per step),
// clipping by global norm with a threshold below the tiny model's gradient norms (checked below).
const std::string kCommon =
    "--train_batch_size 1 --gradient_accumulation_steps 2 --grad_clip_method norm --max_grad_norm 0.02 ";

std::vector<double> logged_grad_norms(const std::filesystem::path& out) {
    std::vector<double> norms;
    std::ifstream in(out / "metrics.jsonl");
    for (std::string line; std::getline(in, line);)
        norms.push_back(nlohmann::json::parse(line).at("grad_norm").get<double>());
    return norms;
}

struct ShardLine {
    int rank = -1;
    long held = 0, owned = 0, foreign = 0;
    long long elements = 0, all_elements = 0;
};

// The "ZeRO-2 rank R: ..." lines of a run's output, one per rank.
std::vector<ShardLine> shard_lines(const std::string& output) {
    std::vector<ShardLine> out;
    std::istringstream in(output);
    for (std::string line; std::getline(in, line);) {
        const auto at = line.find("ZeRO-2 rank ");
        if (at == std::string::npos) continue;
        ShardLine s;
        double mib = 0;
        const int n =
            std::sscanf(line.c_str() + at,
                        "ZeRO-2 rank %d: after the gradient reduction this rank holds %ld gradients "
                        "of its %ld parameters (%lld of %lld elements, %lf MiB) and %ld",
                        &s.rank, &s.held, &s.owned, &s.elements, &s.all_elements, &mib, &s.foreign);
        EXPECT_EQ(n, 7) << line;
        out.push_back(s);
    }
    return out;
}

TEST(DistZero2, EqualsPlainDataParallelWithAccumulationAndGlobalNormClipping) {
    Workspace w;
    const auto plain = run_shell(w.train(2, "plain", kCommon + "--max_train_steps 4"));
    ASSERT_EQ(plain.exit_code, 0) << plain.output;
    const auto zero = run_shell(w.train(2, "zero2", kCommon + "--max_train_steps 4 --zero_stage 2"));
    ASSERT_EQ(zero.exit_code, 0) << zero.output;
    EXPECT_TRUE(contains(zero.output, "ZeRO stage 2")) << zero.output;

    const double diff = max_difference(final_weights(w.out("plain")), final_weights(w.out("zero2")));
    std::printf("ZeRO-2 vs plain data parallel (accumulation 2, clip by norm): max |dw| = %.3g\n", diff);
    EXPECT_EQ(diff, 0.0);
    // The norm every rank logged is the global one, and clipping was active on every step.
    const auto norms_plain = logged_grad_norms(w.out("plain"));
    const auto norms_zero = logged_grad_norms(w.out("zero2"));
    ASSERT_EQ(norms_plain.size(), 4u);
    EXPECT_EQ(norms_zero, norms_plain);
    for (double n : norms_plain) EXPECT_GT(n, 0.02);

    // Gradient memory: after the reduction a rank holds only its own parameters' gradients.
    const auto lines = shard_lines(zero.output);
    for (const auto& s : lines)
        std::printf("rank %d holds %ld gradients (%lld of %lld elements), %ld of other ranks\n", s.rank,
                    s.held, s.elements, s.all_elements, s.foreign);
    ASSERT_EQ(lines.size(), 2u) << zero.output;
    long owned_total = 0;
    for (const auto& s : lines) {
        EXPECT_EQ(s.foreign, 0) << "rank " << s.rank << " kept gradients of other ranks' parameters";
        EXPECT_EQ(s.held, s.owned) << "rank " << s.rank;  // a full fine-tune uses every parameter
        EXPECT_GT(s.elements, 0);
        EXPECT_LT(s.elements, s.all_elements * 3 / 4) << "rank " << s.rank << " holds most gradients";
        owned_total += s.owned;
    }
    EXPECT_EQ(lines[0].all_elements, lines[1].all_elements);
    EXPECT_EQ(lines[0].elements + lines[1].elements, lines[0].all_elements);
    EXPECT_GT(owned_total, 2);
    for (const char* f : {"checkpoint-2/optimizer-shard-0-of-2.safetensors",
                          "checkpoint-2/optimizer-shard-1-of-2.safetensors"})
        EXPECT_TRUE(std::filesystem::exists(w.out("zero2") / f)) << f;
}

TEST(DistZero2, CheckpointResumesOnOneProcessExactly) {
    Workspace w;
    const std::string adam = "--optimizer torch-adamw --learning_rate 1e-3 ";
    // Checkpoint at step 2 (the workspace's interval), end at 3.
    const std::string steps = "--max_train_steps 3 ";
    ASSERT_EQ(run_shell(w.train(2, "plain", adam + kCommon + steps)).exit_code, 0);
    const auto zero = run_shell(w.train(2, "zero2", adam + kCommon + steps + "--zero_stage 2"));
    ASSERT_EQ(zero.exit_code, 0) << zero.output;
    EXPECT_FALSE(std::filesystem::exists(w.out("zero2") / "checkpoint-2/optimizer.safetensors"));
    // Each rank's shard holds AdamW state of its own parameters only, and together all of them.
    std::set<std::string> seen;
    for (int r = 0; r < 2; ++r)
        for (const auto& [k, v] :
             io::load_safetensors(w.out("zero2") / ("checkpoint-2/optimizer-shard-" + std::to_string(r) +
                                                    "-of-2.safetensors")))
            EXPECT_TRUE(seen.insert(k).second) << k << " is in two shards";
    std::set<std::string> whole;
    for (const auto& [k, v] : io::load_safetensors(w.out("plain") / "checkpoint-2/optimizer.safetensors"))
        whole.insert(k);
    EXPECT_EQ(seen, whole);

    // Both step-2 checkpoints, continued by one process with the same global batch (2 x 2), must
    // end bit-identical: the shards restore exactly the state the whole file restores.
    auto resume_on_one = [&](const std::string& from, const std::string& to) {
        std::filesystem::create_directories(w.out(to));
        std::filesystem::copy(w.out(from) / "checkpoint-2", w.out(to) / "checkpoint-2",
                              std::filesystem::copy_options::recursive);
        const auto r =
            run_shell(w.train(0, to,
                              adam + "--train_batch_size 2 --gradient_accumulation_steps 2 "
                                     "--grad_clip_method norm --max_grad_norm 0.02 --max_train_steps 3"));
        EXPECT_EQ(r.exit_code, 0) << r.output;
        EXPECT_TRUE(contains(r.output, "resumed from")) << r.output;
    };
    resume_on_one("zero2", "zero2_then_one");
    resume_on_one("plain", "plain_then_one");
    const double diff =
        max_difference(final_weights(w.out("zero2_then_one")), final_weights(w.out("plain_then_one")));
    std::printf("1 process resumed from ZeRO-2 shards vs from the whole state: max |dw| = %.3g\n", diff);
    EXPECT_EQ(diff, 0.0);
    // And the resumed run really trained on: it moved away from the step-2 weights.
    std::map<std::string, at::Tensor> at_step2;
    for (auto& [k, v] :
         io::load_safetensors(w.out("zero2") / "checkpoint-2/unet/diffusion_pytorch_model.safetensors"))
        at_step2[k] = v.clone();
    EXPECT_GT(max_difference(at_step2, final_weights(w.out("zero2_then_one"))), 1e-5);
}

// Three ranks (the partition is uneven, and the ZeRO-2 reduce and the all-reduce may sum in
// different orders): ZeRO-1 must be bit-identical to plain data parallelism (same all-reduce, bit
// copies from the owners in the bucketed sync), ZeRO-2 equal up to that summation order, and every
// rank must end holding exactly rank 0's weights (DTUNE_CHECK_RANK_WEIGHTS, tolerance 0).
// Not compared with one process x batch 3 here: on this fixture 3 ranks x batch 1 already log a
// different loss at step 1 (1.2241 vs 1.2150, before any gradient is reduced), so the 3-rank
// batch differs from the single process's in the data or noise draws, not in the reduction; the
// reduction itself is checked bit for bit against one process on 2 and 3 ranks in
// tests/dist/reducer_test.cpp.
TEST(DistZero2, ThreeRanksZeroStagesEqualPlainDataParallel) {
    Workspace w;
    const std::string common =
        "--train_batch_size 1 --gradient_accumulation_steps 2 --max_train_steps 3 --zero_stage ";
    std::map<int, std::map<std::string, at::Tensor>> weights;
    for (int stage : {0, 1, 2}) {
        const std::string name = "zero" + std::to_string(stage);
        const auto r =
            run_shell("DTUNE_CHECK_RANK_WEIGHTS=1 " + w.train(3, name, common + std::to_string(stage)));
        ASSERT_EQ(r.exit_code, 0) << r.output;
        EXPECT_TRUE(contains(r.output, "3 ranks over gloo")) << r.output;
        weights[stage] = final_weights(w.out(name));
    }
    const double zero1 = max_difference(weights[0], weights[1]);
    const double zero2 = max_difference(weights[0], weights[2]);
    std::printf("3 ranks, vs plain data parallel: ZeRO-1 max |dw| = %.3g, ZeRO-2 max |dw| = %.3g\n", zero1,
                zero2);
    EXPECT_EQ(zero1, 0.0);
    EXPECT_LE(zero2, 1e-6);
    // The runs trained: the weights moved from the fixture's.
    std::map<std::string, at::Tensor> start;
    for (auto& [k, v] :
         io::load_safetensors(test::fixtures_dir() / "tiny-sdxl/unet/diffusion_pytorch_model.safetensors"))
        start[k] = v.clone();
    EXPECT_GT(max_difference(start, weights[0]), 1e-4);
}

}  // namespace
}  // namespace zero2_multi_test_local
}  // namespace dtune

// The graphed data-parallel step on two GPUs (label gpu; skipped with fewer than two CUDA
// devices): `dtune launch` with 2 NCCL ranks, the tiny SDXL fixture and CUDA graphs. The gradient
// all-reduce is captured in the graph, one grouped collective per bucket of gradients where backward
// left them (the default handoff), launched by the backward's hooks
// (DataParallel::graph_reduces_in_buckets). Judged against the same step run eagerly
// (DTUNE_CUDA_GRAPH_WARMUP above the step count: the graph's settings and random streams without
// a capture), against one process on one GPU with the global batch (the device draws are made for
// the global batch, each rank keeping its rows), and against the graph's former flat all-reduce
// after backward (DTUNE_GRAPH_REDUCER=0), and ZeRO-1's graphed step (the same all-reduce, each rank
// updating its share, the owners' broadcasts captured at the start of the next forward), ZeRO-2's (each
// bucket reduced to its owner, other ranks' buckets in staging slots), and the gradients copied into flat
// buckets (DTUNE_DDP_GRAD_COPY=1). The tolerance covers float summation order.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <fstream>
#include <string>

#include "dist/train_launch_util.h"
#include "support/shell.h"

namespace dtune {
namespace dp_graph_gpu_test_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

int cuda_devices() {
    return static_cast<int>(torch::cuda::device_count());
}

nlohmann::json last_metrics_row(const std::filesystem::path& out) {
    std::ifstream in(out / "metrics.jsonl");
    std::string line, last;
    while (std::getline(in, line))
        if (!line.empty()) last = line;
    return last.empty() ? nlohmann::json::object() : nlohmann::json::parse(last);
}

TEST(DataParallelGraphGpu, TwoRanksCaptureTheOverlappedAllReduceAndEqualOneGpu) {
    if (cuda_devices() < 2) GTEST_SKIP() << "needs two CUDA devices, found " << cuda_devices();
    Workspace w;
    // AdamW in float32 (deterministic off: its per-tensor path is not graph-safe); 10 steps, so
    // each of the 2-rank graphed runs replays 8 times after 2 warm-up steps. adam_epsilon 1 keeps
    // the update linear in small gradients: with the default 1e-8 an element whose gradient is
    // near zero moves by about +-lr whichever sign the GPU's summation order gives it (measured:
    // 2e-3 apart after 10 steps of lr 1e-3), which would hide a wrong step; now, as with SGD in the
    // CPU tests, summation order stays at float rounding while a wrong gradient moves whole tensors.
    const std::string common =
        "--device cuda --mixed_precision no --optimizer torch-adamw --learning_rate 1e-2 --adam_epsilon 1 "
        "--deterministic false --cuda_graph true --max_train_steps 10 --checkpointing_steps 100 "
        "--max_grad_norm 1 ";
    const std::string env = "NCCL_NVLS_ENABLE=0 ";
    const auto graphed = run_shell(env + "DTUNE_CUDA_GRAPH_WARMUP=2 " +
                                   w.train(2, "graphed", common + "--train_batch_size 1"));
    ASSERT_EQ(graphed.exit_code, 0) << graphed.output;
    EXPECT_TRUE(contains(graphed.output, "2 ranks over nccl")) << graphed.output;
    EXPECT_TRUE(contains(graphed.output, "cuda_graph: captured the step")) << graphed.output;
    EXPECT_FALSE(contains(graphed.output, "capture failed")) << graphed.output;
    EXPECT_TRUE(contains(graphed.output, "no gradient buckets")) << graphed.output;
    // The hooks launched buckets while backward ran (the log names how many of how many).
    EXPECT_TRUE(line_with(graphed.output, "data parallel: ", "started their reduction during the backward"))
        << graphed.output;
    EXPECT_FALSE(contains(graphed.output, "data parallel: 0 of")) << graphed.output;
    const nlohmann::json row = last_metrics_row(w.out("graphed"));
    EXPECT_EQ(row.value("graph_replays", -1), 8) << row.dump();

    const auto eager = run_shell(env + "DTUNE_CUDA_GRAPH_WARMUP=1000 " +
                                 w.train(2, "eager", common + "--train_batch_size 1"));
    ASSERT_EQ(eager.exit_code, 0) << eager.output;
    EXPECT_EQ(last_metrics_row(w.out("eager")).value("graph_replays", -1), 0);
    const auto flat = run_shell(env + "DTUNE_CUDA_GRAPH_WARMUP=2 DTUNE_GRAPH_REDUCER=0 " +
                                w.train(2, "flat", common + "--train_batch_size 1"));
    ASSERT_EQ(flat.exit_code, 0) << flat.output;
    const auto zero1 = run_shell(env + "DTUNE_CUDA_GRAPH_WARMUP=2 " +
                                 w.train(2, "zero1", common + "--train_batch_size 1 --zero_stage 1"));
    ASSERT_EQ(zero1.exit_code, 0) << zero1.output;
    EXPECT_TRUE(contains(zero1.output, "cuda_graph: captured the step")) << zero1.output;
    EXPECT_FALSE(contains(zero1.output, "capture failed")) << zero1.output;
    // The owners' updates are broadcast at the start of the next (captured) forward.
    EXPECT_TRUE(contains(zero1.output, "at the start of the next forward")) << zero1.output;
    EXPECT_EQ(last_metrics_row(w.out("zero1")).value("graph_replays", -1), 8);
    // ZeRO-2: each bucket reduced to its owner, other ranks' buckets in the reducer's staging
    // slots, the norm clip over every rank's shard; all captured.
    const auto zero2 = run_shell(env + "DTUNE_CUDA_GRAPH_WARMUP=2 " +
                                 w.train(2, "zero2", common + "--train_batch_size 1 --zero_stage 2"));
    ASSERT_EQ(zero2.exit_code, 0) << zero2.output;
    EXPECT_TRUE(contains(zero2.output, "cuda_graph: captured the step")) << zero2.output;
    EXPECT_FALSE(contains(zero2.output, "training eagerly")) << zero2.output;
    EXPECT_FALSE(contains(zero2.output, "capture failed")) << zero2.output;
    EXPECT_EQ(last_metrics_row(w.out("zero2")).value("graph_replays", -1), 8);
    // The gradients copied into flat buckets, whose all-reduce is captured likewise.
    const auto copy = run_shell(env + "DTUNE_CUDA_GRAPH_WARMUP=2 DTUNE_DDP_GRAD_COPY=1 " +
                                w.train(2, "copy", common + "--train_batch_size 1"));
    ASSERT_EQ(copy.exit_code, 0) << copy.output;
    EXPECT_FALSE(contains(copy.output, "no gradient buckets")) << copy.output;
    EXPECT_TRUE(contains(copy.output, "cuda_graph: captured the step")) << copy.output;
    EXPECT_EQ(last_metrics_row(w.out("copy")).value("graph_replays", -1), 8);
    const auto one = run_shell("CUDA_VISIBLE_DEVICES=0 DTUNE_CUDA_GRAPH_WARMUP=2 " +
                               w.train(0, "one", common + "--train_batch_size 2"));
    ASSERT_EQ(one.exit_code, 0) << one.output;

    const auto g = final_weights(w.out("graphed"));
    const double vs_eager = max_difference(g, final_weights(w.out("eager")));
    const double vs_flat = max_difference(g, final_weights(w.out("flat")));
    const double vs_one = max_difference(g, final_weights(w.out("one")));
    const double vs_zero1 = max_difference(g, final_weights(w.out("zero1")));
    const double vs_copy = max_difference(g, final_weights(w.out("copy")));
    const double vs_zero2 = max_difference(g, final_weights(w.out("zero2")));
    // The weights must have moved far beyond the tolerance (10 AdamW steps of 1e-3).
    std::map<std::string, at::Tensor> initial;
    for (auto& [k, v] : io::load_safetensors(test::fixtures_dir() / "tiny-sdxl" / "unet" /
                                             "diffusion_pytorch_model.safetensors"))
        initial[k] = v.to(at::kFloat);
    const double moved = max_difference(g, initial);
    std::printf(
        "graphed 2 GPUs vs eager %.3g, vs flat all-reduce %.3g, vs 1 GPU batch 2 %.3g, vs ZeRO-1 %.3g, "
        "vs ZeRO-2 %.3g, vs copied into buckets %.3g; moved %.3g\n",
        vs_eager, vs_flat, vs_one, vs_zero1, vs_zero2, vs_copy, moved);
    EXPECT_GT(moved, 1e-3);
    EXPECT_LE(vs_eager, 2e-5 + 2e-3 * moved);
    EXPECT_LE(vs_flat, 2e-5 + 2e-3 * moved);
    EXPECT_LE(vs_one, 2e-5 + 2e-3 * moved);
    EXPECT_LE(vs_zero1, 2e-5 + 2e-3 * moved);
    EXPECT_LE(vs_zero2, 2e-5 + 2e-3 * moved);
    EXPECT_LE(vs_copy, 2e-5 + 2e-3 * moved);
}

}  // namespace
}  // namespace dp_graph_gpu_test_local
}  // namespace dtune

// A rank SIGKILLed in the middle of a sharded checkpoint save (label dist): the real `dtune launch`
// with 2 CPU ranks over Gloo, the tiny SDXL fixture, a full fine-tune with AdamW (state that the
// optimizer shards must carry), ZeRO-3 and ZeRO-1, checkpoints every 2 steps.
// DTUNE_INJECT_SAVE_ERROR=kill:1:4 kills rank 1 right after it wrote its optimizer shard and RNG
// states into checkpoint-4-tmp, while rank 0 waits for the shards to complete the checkpoint.
// Judged against an uninterrupted run of the same command (same output_dir path, so that even the
// resolved config inside the checkpoint is the same bytes):
//  - the job ends within seconds of the kill (not at the 300 s collective timeout), exit 1,
//    naming rank 1 and its signal;
//  - checkpoint-2 holds exactly the files and bytes the uninterrupted run wrote at step 2, i.e.
//    what it held before the failed save; no checkpoint-4 exists, only the -tmp folder with the
//    killed rank's shard in it;
//  - a run of the same command resumes from checkpoint-2 ("latest") and ends with the weights of
//    the uninterrupted run, bit for bit, its checkpoint-4 equal to the uninterrupted one's, and
//    the leftover -tmp folder removed.
#include <gtest/gtest.h>

#include <cstdio>
#include <set>

#include "core/fs.h"
#include "dist/train_launch_util.h"

namespace dtune {
namespace sharded_save_kill_test_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

namespace stdfs = std::filesystem;

// Relative path -> bytes of every file under `dir`.
std::map<std::string, std::string> file_bytes(const stdfs::path& dir) {
    std::map<std::string, std::string> out;
    for (const auto& e : stdfs::recursive_directory_iterator(dir))
        if (e.is_regular_file()) out[stdfs::relative(e.path(), dir).string()] = fs::read_file(e.path());
    return out;
}

std::map<std::string, at::Tensor> tensors(const stdfs::path& file) {
    std::map<std::string, at::Tensor> m;
    for (auto& [k, v] : io::load_safetensors(file)) m[k] = v.clone();
    return m;
}

void kill_during_the_save_keeps_the_previous_checkpoint(int zero_stage) {
    SCOPED_TRACE("zero_stage " + std::to_string(zero_stage));
    Workspace w;
    // 6 images: one global batch of 2 x 3 per epoch.
    for (const char* f : {"sample 6.png", "sample 7.png"}) stdfs::remove(w.dir / "images" / f);
    const std::string args =
        "--optimizer torch-adamw --learning_rate 1e-3 --train_batch_size 3 "
        "--max_train_steps 5 --zero_stage " +
        std::to_string(zero_stage);
    const std::string name = "zero" + std::to_string(zero_stage);
    const stdfs::path run = w.out(name), reference = w.out(name + "_reference");

    // The uninterrupted run, then moved aside: the next run writes to the same path.
    const auto whole = run_shell(w.train(2, name, args));
    ASSERT_EQ(whole.exit_code, 0) << whole.output;
    EXPECT_TRUE(contains(whole.output, "ZeRO stage " + std::to_string(zero_stage))) << whole.output;
    stdfs::rename(run, reference);

    const std::string mark = "injected SIGKILL (DTUNE_INJECT_SAVE_ERROR) on rank 1";
    const auto killed = run_shell(
        "DTUNE_COLLECTIVE_TIMEOUT_S=300 DTUNE_INJECT_SAVE_ERROR=kill:1:4 " + w.train(2, name, args), mark);
    std::printf(
        "ZeRO-%d: rank 1 killed while saving step 4; the job ended %.2f s after the kill (%.1f s in "
        "all)\n",
        zero_stage, killed.seconds_after_mark, killed.seconds);
    EXPECT_EQ(killed.exit_code, 1) << killed.output;
    EXPECT_TRUE(contains(killed.output, mark + " while saving the checkpoint of step 4")) << killed.output;
    EXPECT_TRUE(line_with(killed.output, "rank 1 (local rank 1", "killed by signal 9")) << killed.output;
    EXPECT_TRUE(line_with(killed.output, "[rank 0]", "rank 0 stops because rank 1 failed")) << killed.output;
    EXPECT_GE(killed.seconds_after_mark, 0) << killed.output;
    EXPECT_LT(killed.seconds_after_mark, 20.0) << killed.output;

    // The kill came mid-save: rank 1's shard was written, the checkpoint never completed.
    EXPECT_TRUE(stdfs::exists(run / "checkpoint-4-tmp" / "optimizer-shard-1-of-2.safetensors"))
        << killed.output;
    EXPECT_FALSE(stdfs::exists(run / "checkpoint-4")) << killed.output;
    // checkpoint-2 is what it was before the failed save: the uninterrupted run's, file for file.
    const auto before = file_bytes(reference / "checkpoint-2");
    const auto after = file_bytes(run / "checkpoint-2");
    std::set<std::string> names_before, names_after;
    for (const auto& [f, _] : before) names_before.insert(f);
    for (const auto& [f, _] : after) names_after.insert(f);
    EXPECT_EQ(names_after, names_before);
    EXPECT_TRUE(names_after.count("optimizer-shard-1-of-2.safetensors"));
    EXPECT_TRUE(names_after.count(".guard"));
    for (const auto& [f, bytes] : before) {
        if (after.count(f)) {
            EXPECT_TRUE(after.at(f) == bytes) << f << " differs from the uninterrupted run's";
        }
    }

    // The same command again resumes from checkpoint-2 and ends where the uninterrupted run ended.
    const auto resumed = run_shell(w.train(2, name, args));
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    EXPECT_TRUE(contains(resumed.output, "resumed from " + (run / "checkpoint-2").string() + " at step 2"))
        << resumed.output;
    const double d = max_difference(final_weights(reference), final_weights(run));
    std::printf("ZeRO-%d: resumed from checkpoint-2 vs the run that was not killed: max |dw| = %.3g\n",
                zero_stage, d);
    EXPECT_EQ(d, 0.0);
    const auto unet = "checkpoint-4/unet/diffusion_pytorch_model.safetensors";
    EXPECT_EQ(max_difference(tensors(reference / unet), tensors(run / unet)), 0.0);
    for (const char* shard : {"checkpoint-4/optimizer-shard-0-of-2.safetensors",
                              "checkpoint-4/optimizer-shard-1-of-2.safetensors"})
        EXPECT_EQ(max_difference(tensors(reference / shard), tensors(run / shard)), 0.0) << shard;
    EXPECT_FALSE(stdfs::exists(run / "checkpoint-4-tmp"));
    // And the resumed run trained: its weights moved from checkpoint-2's.
    EXPECT_GT(max_difference(tensors(run / "checkpoint-2/unet/diffusion_pytorch_model.safetensors"),
                             final_weights(run)),
              1e-5);
}

TEST(DistShardedSave, RankKilledWhileSavingZero3KeepsThePreviousCheckpointAndResumesExactly) {
    kill_during_the_save_keeps_the_previous_checkpoint(3);
}

TEST(DistShardedSave, RankKilledWhileSavingZero1KeepsThePreviousCheckpointAndResumesExactly) {
    kill_during_the_save_keeps_the_previous_checkpoint(1);
}

}  // namespace
}  // namespace sharded_save_kill_test_local
}  // namespace dtune

// What the trainer leaves in output_dir when the disk fills up or a checkpoint rotation is killed,
// on real file systems (a small tmpfs; root only, skipped otherwise) and with a real SIGKILL:
// metrics.jsonl keeps every step once, in order, in whole lines; a killed rotation leaves no
// checkpoint whose guard says complete while its files are gone, and the next rotation removes it.
#include <gtest/gtest.h>

#include <csignal>
#include <fstream>

#include <sys/inotify.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/fs.h"
#include "core/log.h"
#include "support/test_support.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "trainer_test_util.h"

namespace dtune::train {
namespace test_run_files_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

namespace stdfs = std::filesystem;

// At step `from`: pads metrics.jsonl with a line of its own (no "step") so that only `room` bytes of
// its last page are left, then fills the disk: the next row (about 150 bytes) is written in part
// and then fails, as on a real disk that fills up between two rows. At step `to`: frees the disk.
class DiskFiller : public TrainCallback {
  public:
    DiskFiller(const test::SmallTmpfs& disk, int64_t from, int64_t to) : disk_(disk), from_(from), to_(to) {}
    void on_step_end(Trainer& t, const StepReport& r) override {
        if (r.step == from_) {
            const stdfs::path metrics = t.output_dir() / "metrics.jsonl";
            constexpr std::size_t kPage = 4096, kRoom = 40, kFrame = 11;  // {"pad":""} + newline
            const std::size_t used = stdfs::file_size(metrics) % kPage;
            const std::size_t pad = (kPage - used - kRoom - kFrame + kPage) % kPage;
            std::ofstream(metrics, std::ios::app) << "{\"pad\":\"" << std::string(pad, 'x') << "\"}\n";
            filled = disk_.fill(disk_ / "filler");
        }
        if (r.step == to_) stdfs::remove(disk_ / "filler");
    }
    std::size_t filled = 0;

  private:
    const test::SmallTmpfs& disk_;
    int64_t from_, to_;
};

// Finding 2: a full disk between checkpoints. Before: the rows written while it was full were lost,
// one was spliced into the next, and the run ended normally.
TEST(RunFiles, MetricsRowsSurviveAFullDiskWholeAndInOrder) {
    test::SmallTmpfs disk(64 << 20);
    if (!disk.mounted()) GTEST_SKIP() << disk.why();
    constexpr int64_t kSteps = 5, kFullFrom = 2, kFullTo = 3;
    // No checkpoint until the end (which comes after the disk has space again).
    const TrainConfig config = testutil::tiny_config(disk / "out", kSteps, {{"checkpoint_step_interval", 0}});
    auto trainer = testutil::make_trainer(config);
    auto filler = std::make_shared<DiskFiller>(disk, kFullFrom, kFullTo);
    trainer->add_callback(filler);
    const TrainResult result = trainer->run();
    EXPECT_EQ(result.global_step, kSteps);
    ASSERT_GT(filler->filled, 0u);
    std::ifstream in(disk / "out" / "metrics.jsonl");
    std::string line;
    std::vector<int64_t> steps;
    while (std::getline(in, line)) {
        const auto row = nlohmann::json::parse(line, nullptr, false);
        ASSERT_FALSE(row.is_discarded()) << "a spliced or partial line: " << line;
        if (!row.contains("pad")) steps.push_back(row.at("step").get<int64_t>());
    }
    EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5}));
}

// The sizes of every safetensors file under `dir` (what the checkpoint estimate counts); `listing`
// gets one "name bytes" line each.
int64_t safetensors_bytes(const stdfs::path& dir, std::string& listing) {
    int64_t bytes = 0;
    for (const auto& e : stdfs::recursive_directory_iterator(dir))
        if (e.is_regular_file() && e.path().extension() == ".safetensors") {
            bytes += static_cast<int64_t>(e.file_size());
            listing += stdfs::relative(e.path(), dir).string() + " " + std::to_string(e.file_size()) + "\n";
        }
    return bytes;
}

// The log lines of one run, through log::set_file.
std::string run_logged(Trainer& trainer, const stdfs::path& log_file) {
    log::set_file(log_file);
    trainer.run();
    log::set_file({});
    return fs::read_file(log_file);
}

// The estimate a run logs before its first step against the checkpoint it then writes (full
// fine-tunes with AdamW, with Lion plus EMA, and a LoRA), and the warning when output_dir cannot
// hold one checkpoint plus the final weights (a real tmpfs too small for the tiny UNet's; root only).
TEST(RunFiles, CheckpointSizeIsEstimatedAndAShortDiskIsWarnedOfBeforeTheFirstStep) {
    for (const auto& extra :
         {nlohmann::json{{"model_type", "full"}},
          nlohmann::json{{"model_type", "full"}, {"optimizer", "optimi-lion"}, {"use_ema", true}},
          nlohmann::json{{"model_type", "lora"}, {"lora_rank", 4}}}) {
        SCOPED_TRACE(extra.dump());
        test::TempDir dir;
        nlohmann::json keys = extra;
        keys["checkpoint_step_interval"] = 2;
        auto trainer = testutil::make_trainer(testutil::tiny_config(dir / "out", 2, keys));
        const int64_t estimate = trainer->estimated_checkpoint_bytes();
        const std::string log = run_logged(*trainer, dir / "log.txt");
        EXPECT_NE(log.find("checkpoints of this run: about"), std::string::npos) << log;
        EXPECT_EQ(log.find("less than one checkpoint"), std::string::npos) << log;
        // Written: the weights file(s), optimizer.safetensors, the EMA file (and the random states,
        // which the estimate leaves out): within 5% and 64 KiB of the estimate.
        std::string listing;
        const int64_t written = safetensors_bytes(dir / "out" / "checkpoint-2", listing);
        EXPECT_LE(std::abs(written - estimate), estimate / 20 + (64 << 10))
            << "estimate " << estimate << ", written " << written << "\n"
            << listing;
    }
    test::SmallTmpfs disk(1 << 20);
    if (!disk.mounted()) GTEST_SKIP() << disk.why();
    test::TempDir logs;
    auto trainer = testutil::make_trainer(
        testutil::tiny_config(disk / "out", 1, {{"model_type", "full"}, {"checkpoint_step_interval", 0}}));
    ASSERT_GT(trainer->estimated_checkpoint_bytes(), 1 << 20);
    std::string log;
    try {
        log = run_logged(*trainer, logs / "log.txt");
    } catch (const std::exception&) {  // the end-of-training checkpoint cannot fit: expected
        log::set_file({});
        log = fs::read_file(logs / "log.txt");
    }
    EXPECT_NE(log.find("less than one checkpoint of this run"), std::string::npos) << log;
    EXPECT_NE(log.find("point output_dir at a larger file system"), std::string::npos) << log;
}

// A checkpoint directory with many files, so that a removal takes long enough to be killed in the
// middle: `many/` holds 2000 small files (listed in the manifest as one entry).
CheckpointContents many_files(int64_t step) {
    CheckpointContents c;
    c.global_step = step;
    c.tensor_files["unet/diffusion_pytorch_model.safetensors"] = {{"w", at::ones({4})}};
    c.json_files["training_state.json"] = {{"global_step", step}};
    c.file_writers["many"] = [](const stdfs::path& dir) {
        stdfs::create_directories(dir);
        for (int i = 0; i < 2000; ++i) std::ofstream(dir / ("f" + std::to_string(i))) << i;
    };
    c.rng_states["cpu"] = at::zeros({8}, at::kByte);
    return c;
}

// Finding 6: a kill during rotation left a checkpoint whose .guard said complete while its weights
// were gone, and nothing ever removed it. The old checkpoint is restored from a copy (as `cp -r`
// or a backup tool would), so its .guard is not its newest entry.
TEST(RunFiles, KilledRotationLeavesNoCompleteLookingCheckpointAndIsCleanedUp) {
    test::SmallTmpfs disk(64 << 20);
    if (!disk.mounted()) GTEST_SKIP() << disk.why();
    const stdfs::path out = disk / "out";
    save_checkpoint(disk / "staging", many_files(1));
    stdfs::create_directories(out);
    stdfs::copy(disk / "staging" / "checkpoint-1", out / "checkpoint-1", stdfs::copy_options::recursive);
    save_checkpoint(out, many_files(2));
    const stdfs::path old = out / "checkpoint-1";
    ASSERT_EQ(checkpoint_problem(old), "");

    const int fd = inotify_init1(IN_CLOEXEC);
    ASSERT_GE(fd, 0);
    ASSERT_GE(inotify_add_watch(fd, old.c_str(), IN_DELETE), 0);
    ASSERT_GE(inotify_add_watch(fd, (old / "many").c_str(), IN_DELETE), 0);
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        rotate_checkpoints(out, 1);  // removes checkpoint-1
        _exit(0);
    }
    // Kill the rotation at its first deletion (the event names what went first).
    alignas(inotify_event) char buf[4096];
    const ssize_t n = read(fd, buf, sizeof buf);
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    close(fd);
    ASSERT_GT(n, 0);
    const auto* first = reinterpret_cast<const inotify_event*>(buf);
    EXPECT_STREQ(first->name, ".guard") << "the first file the rotation deleted";
    // Whatever the kill interrupted: a guard that says complete means every file is there.
    std::error_code ec;
    if (stdfs::exists(old / ".guard", ec) && fs::read_file(old / ".guard") == "complete") {
        EXPECT_EQ(checkpoint_problem(old), "") << "a complete-looking checkpoint with missing files";
    }
    ASSERT_EQ(resolve_resume_checkpoint(out, "latest"), out / "checkpoint-2");
    // The next rotation (the next save) removes what the killed one left.
    rotate_checkpoints(out, 1);
    EXPECT_FALSE(stdfs::exists(old));
    EXPECT_EQ(checkpoint_problem(out / "checkpoint-2"), "");
}

// Leftovers of older runs: an incomplete checkpoint older than the newest complete one and an
// assembly folder of an interrupted save are removed by the rotation even without a limit.
TEST(RunFiles, RotationRemovesIncompleteLeftovers) {
    test::TempDir dir;
    const stdfs::path out = dir / "out";
    save_checkpoint(out, many_files(1));
    save_checkpoint(out, many_files(2));
    save_checkpoint(out, many_files(3));
    stdfs::remove(out / "checkpoint-1" / "unet" /
                  "diffusion_pytorch_model.safetensors");  // guard still there
    stdfs::create_directories(checkpoint_tmp_dir(out, 4) / "unet");
    rotate_checkpoints(out, 0);
    EXPECT_FALSE(stdfs::exists(out / "checkpoint-1"));
    EXPECT_FALSE(stdfs::exists(checkpoint_tmp_dir(out, 4)));
    EXPECT_EQ(checkpoint_problem(out / "checkpoint-2"), "");
    EXPECT_EQ(checkpoint_problem(out / "checkpoint-3"), "");
}

}  // namespace
}  // namespace test_run_files_local
}  // namespace dtune::train

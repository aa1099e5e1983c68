// End to end on CPU (tiny SDXL fixture, generated PNGs): what `dtune train` does to output_dir when
// runs overlap, stop or fail. A second run on a busy output_dir exits 2 naming the holder, and a
// holder killed with SIGKILL does not block the next run; SIGTERM during the latent-cache build
// stops within seconds, keeps the entries written and saves no checkpoint-0; a resumed run leaves
// each step once in metrics.jsonl and eval.jsonl; a batch that cannot be read mid-run (a deleted
// image under vae_cache_disable, a damaged cache entry) exits 3 naming it, after saving a checkpoint.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <fstream>
#include <map>
#include <thread>

#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/fs.h"
#include "io/image.h"
#include "support/shell.h"
#include "support/test_support.h"
#include "train_cli_util.h"

namespace dtune {
namespace test_output_dir_cli_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

namespace stdfs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Workspace {
    test::TempDir dir;
    stdfs::path config;

    // `images` PNGs of 80x64 (one 64x64 bucket); `entry` is merged into the image dataset's entry.
    explicit Workspace(int images = 12, const nlohmann::json& entry = nlohmann::json::object()) {
        const auto folder = dir / "images";
        stdfs::create_directories(folder);
        for (int i = 0; i < images; ++i) {
            io::RgbImage img(80, 64);
            for (size_t p = 0; p < img.pixels.size(); ++p)
                img.pixels[p] = static_cast<uint8_t>((p * 7 + i * 31) % 256);
            io::write_image(folder / ("a photo number " + std::to_string(i) + ".png"), img);
        }
        nlohmann::json image = {{"id", "tiny"},
                                {"type", "local"},
                                {"instance_data_dir", folder.string()},
                                {"resolution", 64},
                                {"resolution_type", "pixel"},
                                {"caption_strategy", "filename"},
                                {"cache_dir_vae", (dir / "cache_vae").string()}};
        image.update(entry);
        write_backends(nlohmann::json::array({image}));
        const nlohmann::json cfg = testutil::tiny_cli_config(dir / "multidatabackend.json");
        config = dir / "config.json";
        fs::write_file_atomic(config, cfg.dump(2));
    }

    // `extra` entries (e.g. an eval dataset) go before the text_embeds entry.
    void write_backends(nlohmann::json entries) const {
        entries.push_back({{"id", "text"},
                           {"type", "local"},
                           {"dataset_type", "text_embeds"},
                           {"default", true},
                           {"cache_dir", (dir / "cache_text").string()}});
        fs::write_file_atomic(dir / "multidatabackend.json", entries.dump(2));
    }

    std::string command(const std::string& out, const std::string& extra,
                        const std::string& log = "log.txt") const {
        return std::string(DTUNE_BIN) + " train --config '" + config.string() + "' --output_dir '" +
               (dir / out).string() + "' " + extra + " 2>>'" + (dir / log).string() + "'";
    }
    std::string log(const std::string& name = "log.txt") const {
        std::error_code ec;
        return stdfs::exists(dir / name, ec) ? fs::read_file(dir / name) : std::string();
    }
};

// A `dtune train` in the background (exec'd, so its pid is the dtune process's).
struct Background {
    pid_t pid = -1;
    explicit Background(const std::string& command) {
        pid = fork();
        if (pid == 0) {
            const std::string cmd = "exec " + command;
            execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
            _exit(127);
        }
    }
    // The exit code, or 128 + signal.
    int wait() {
        int status = 0;
        waitpid(pid, &status, 0);
        pid = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    ~Background() {
        if (pid > 0) {
            kill(pid, SIGKILL);
            waitpid(pid, nullptr, 0);
        }
    }
};

// Waits (up to `seconds`) until `ready` holds; false on timeout.
template <typename F>
bool wait_for(F ready, double seconds = 300) {
    const auto end = Clock::now() + std::chrono::duration<double>(seconds);
    while (Clock::now() < end) {
        if (ready()) return true;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
}

std::vector<nlohmann::json> rows_of(const stdfs::path& file) {
    std::vector<nlohmann::json> rows;
    std::ifstream in(file);
    std::string line;
    while (std::getline(in, line)) rows.push_back(nlohmann::json::parse(line));  // throws on a spliced line
    return rows;
}

bool has_rows(const stdfs::path& file) {
    std::error_code ec;
    return stdfs::exists(file, ec) && stdfs::file_size(file, ec) > 0;
}

int64_t count_files(const stdfs::path& dir) {
    int64_t n = 0;
    std::error_code ec;
    for (auto it = stdfs::recursive_directory_iterator(dir, ec);
         !ec && it != stdfs::recursive_directory_iterator(); it.increment(ec))
        n += it->is_regular_file() && it->path().extension() == ".safetensors";
    return n;
}

// The complete checkpoints (with a guard) of an output_dir, by step.
std::vector<int64_t> complete_checkpoints(const stdfs::path& out) {
    std::vector<int64_t> steps;
    std::error_code ec;
    for (const auto& e : stdfs::directory_iterator(out, ec)) {
        const std::string name = e.path().filename().string();
        if (name.rfind("checkpoint-", 0) == 0 && name.find("-tmp") == std::string::npos &&
            stdfs::exists(e.path() / ".guard"))
            steps.push_back(std::stoll(name.substr(11)));
    }
    std::sort(steps.begin(), steps.end());
    return steps;
}

std::string host_name() {
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    return host;
}

// Finding 1: two runs on one output_dir. Before: the second trained on (rc 0) while the first ran.
TEST(OutputDirCli, SecondRunOnABusyOutputDirExits2NamingTheHolder) {
    Workspace w;
    Background first(w.command("out", "--max_train_steps 100000 --checkpointing_steps 100000", "first.txt"));
    ASSERT_TRUE(wait_for([&] { return has_rows(w.dir / "out" / "metrics.jsonl"); })) << w.log("first.txt");
    const test::ShellRun second = test::run_shell(
        std::string(DTUNE_BIN) + " train --config '" + w.config.string() + "' --output_dir '" +
        (w.dir / "out").string() + "' --max_train_steps 1 --learning_rate 0.01 2>&1");
    EXPECT_EQ(second.exit_code, 2) << second.output;
    EXPECT_TRUE(test::contains(second.output, "is in use by another dtune run (pid " +
                                                  std::to_string(first.pid) + " on host " + host_name() +
                                                  " since "))
        << second.output;
    EXPECT_TRUE(test::contains(second.output, (w.dir / "out" / "dtune.lock").string())) << second.output;
    // A holder killed outright leaves nothing that blocks the next run.
    kill(first.pid, SIGKILL);
    EXPECT_EQ(first.wait(), 128 + SIGKILL);
    const test::ShellRun third =
        test::run_shell(std::string(DTUNE_BIN) + " train --config '" + w.config.string() +
                        "' --output_dir '" + (w.dir / "out").string() + "' --max_train_steps 1 2>&1");
    EXPECT_EQ(third.exit_code, 0) << third.output;
}

// Finding 3: SIGTERM during the latent-cache build. Before: the build ran to the end, then
// checkpoint-0 was written.
TEST(OutputDirCli, SigtermDuringTheLatentCacheBuildStopsSoonWithoutACheckpoint) {
    constexpr int kImages = 600;
    Workspace w(
        kImages,
        {{"caption_strategy", "instanceprompt"}, {"instance_prompt", "a photo"}, {"vae_batch_size", 1}});
    Background run(w.command("out", "--max_train_steps 1"));
    ASSERT_TRUE(wait_for([&] { return count_files(w.dir / "cache_vae") >= 3; })) << w.log();
    kill(run.pid, SIGTERM);
    const auto signalled = Clock::now();
    const int rc = run.wait();
    const double seconds = std::chrono::duration<double>(Clock::now() - signalled).count();
    EXPECT_EQ(rc, 4) << w.log();
    const int64_t entries = count_files(w.dir / "cache_vae");
    EXPECT_LT(entries, kImages) << "the build ran to the end after SIGTERM (" << seconds << " s)\n"
                                << w.log();
    EXPECT_GT(entries, 0);
    EXPECT_TRUE(complete_checkpoints(w.dir / "out").empty()) << w.log();
    EXPECT_FALSE(stdfs::exists(w.dir / "out" / "checkpoint-0")) << w.log();
    EXPECT_TRUE(test::contains(w.log(), "entries are done and kept in ")) << w.log();
    // The next run reuses what the stopped build wrote.
    ASSERT_EQ(test::run_status(w.command("out", "--max_train_steps 1")), 0) << w.log();
    EXPECT_EQ(count_files(w.dir / "cache_vae"), kImages);
    EXPECT_TRUE(test::contains(w.log(), "reused " + std::to_string(entries)) ||
                test::contains(w.log(), std::to_string(entries) + " reused"))
        << w.log();
}

// Finding 4: a resumed run appended the steps after its checkpoint a second time.
TEST(OutputDirCli, ResumedRunLeavesEachStepOnceInMetricsAndEvalLoss) {
    Workspace w;
    auto entries = nlohmann::json::array({{{"id", "tiny"},
                                           {"type", "local"},
                                           {"instance_data_dir", (w.dir / "images").string()},
                                           {"resolution", 64},
                                           {"resolution_type", "pixel"},
                                           {"caption_strategy", "filename"}},
                                          {{"id", "ev"},
                                           {"dataset_type", "eval"},
                                           {"instance_data_dir", (w.dir / "images").string()},
                                           {"resolution", 64},
                                           {"resolution_type", "pixel"},
                                           {"caption_strategy", "filename"}}});
    w.write_backends(entries);
    const std::string eval = "--num_eval_images 1 --eval_timesteps 2 --eval_steps_interval 1 ";
    ASSERT_EQ(test::run_status(w.command("out", eval + "--max_train_steps 3 --checkpointing_steps 2")), 0)
        << w.log();
    ASSERT_EQ(test::run_status(w.command("out", eval + "--max_train_steps 4 --checkpointing_steps 2 "
                                                       "--resume_from_checkpoint checkpoint-2")),
              0)
        << w.log();
    EXPECT_TRUE(test::contains(w.log(), "resumed from")) << w.log();
    for (const char* file : {"metrics.jsonl", "eval.jsonl"}) {
        std::vector<int64_t> steps;
        for (const auto& row : rows_of(w.dir / "out" / file)) steps.push_back(row.at("step").get<int64_t>());
        EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4})) << file << "\n"
                                                             << fs::read_file(w.dir / "out" / file);
    }
}

// Finding 5: a batch that cannot be read mid-run. Before: exit 3 without a checkpoint.
void expect_saved_before_data_error(const Workspace& w, const std::string& damage_note, const auto& damage,
                                    const std::string& named) {
    Background run(w.command("out", "--max_train_steps 100000 --checkpointing_steps 100000"));
    ASSERT_TRUE(wait_for([&] { return has_rows(w.dir / "out" / "metrics.jsonl"); })) << w.log();
    damage();
    EXPECT_EQ(run.wait(), 3) << damage_note << "\n" << w.log();
    const std::string log = w.log();
    EXPECT_TRUE(test::contains(log, named)) << damage_note << "\n" << log;
    const auto saved = complete_checkpoints(w.dir / "out");
    ASSERT_EQ(saved.size(), 1u) << damage_note << "\n" << log;
    EXPECT_GE(saved[0], 1);
    EXPECT_TRUE(
        test::contains(log, "saved " + (w.dir / "out" / ("checkpoint-" + std::to_string(saved[0]))).string()))
        << log;
    // The checkpoint is the state after its step: metrics.jsonl holds exactly the steps up to it.
    EXPECT_EQ(rows_of(w.dir / "out" / "metrics.jsonl").back().at("step").get<int64_t>(), saved[0]);
}

TEST(OutputDirCli, DeletedImageMidRunSavesACheckpointAndNamesTheImage) {
    Workspace w(12, {{"vae_cache_disable", true}});
    const auto images = w.dir / "images";
    expect_saved_before_data_error(
        w, "images deleted under vae_cache_disable",
        [&] {
            for (const auto& e : stdfs::directory_iterator(images)) stdfs::remove(e.path());
        },
        (images / "a photo number ").string());
}

TEST(OutputDirCli, DamagedCacheEntryMidRunSavesACheckpointAndNamesTheEntry) {
    Workspace w;
    const auto cache = w.dir / "cache_vae";
    expect_saved_before_data_error(
        w, "latent cache entries damaged",
        [&] {
            for (const auto& e : stdfs::recursive_directory_iterator(cache))
                if (e.is_regular_file() && e.path().extension() == ".safetensors")
                    stdfs::resize_file(e.path(), stdfs::file_size(e.path()) / 2);
        },
        "latent cache entry " + cache.string());
}

}  // namespace
}  // namespace test_output_dir_cli_local
}  // namespace dtune

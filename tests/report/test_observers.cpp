// The observers on a real (tiny fixture) trainer: validation leaves the trained weights bit-identical
// and names files as SimpleTuner does; eval loss is deterministic and sees weight changes; metrics
// and TensorBoard rows carry samples seen; report.html is written at checkpoints.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <set>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "family/sdxl/sdxl_family.h"
#include "io/image.h"
#include "models/common/weights.h"
#include "models/unet/unet_2d_condition.h"
#include "notify/webhooks.h"
#include "observer_test_util.h"
#include "report/eval_loss.h"
#include "report/html_report.h"
#include "report/observers.h"
#include "report/step_profiler.h"
#include "report/tensorboard.h"
#include "report/validation.h"
#include "support/http_listener.h"
#include "support/test_support.h"
#include "train/trainer.h"

namespace dtune::report {
namespace test_observers_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

using testutil::config;
using testutil::make_trainer;
using testutil::tiny_model;
using testutil::tiny_schedule;

// RFC 4648 base64 (what a webhook consumer runs on the images it gets).
std::string base64_decode(const std::string& in) {
    static const std::string chars = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    uint32_t acc = 0;
    int bits = 0;
    for (char ch : in) {
        if (ch == '=') break;
        const auto pos = chars.find(ch);
        if (pos == std::string::npos) throw std::runtime_error("not base64");
        acc = (acc << 6) | static_cast<uint32_t>(pos);
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out.push_back(static_cast<char>((acc >> bits) & 0xff));
        }
    }
    return out;
}

TEST(Validation, ParsesResolutions) {
    using P = std::vector<std::pair<int, int>>;
    EXPECT_EQ(parse_validation_resolution("1024x1024, 1280x768"), (P{{1024, 1024}, {1280, 768}}));
    EXPECT_EQ(parse_validation_resolution("256"), (P{{256, 256}}));
    EXPECT_EQ(parse_validation_resolution("1"),
              (P{{1024, 1024}}));  // 1 MP -> sqrt(1e6)=1000 -> 1024 on the 64 grid
    EXPECT_THROW(parse_validation_resolution("100x7"), UsageError);
    EXPECT_THROW(parse_validation_resolution("big"), UsageError);
}

TEST(Validation, DoesNotChangeTrainingAndNamesFilesLikeSimpleTuner) {
    test::TempDir plain_dir, val_dir;
    auto plain = make_trainer(config(plain_dir.path()));
    plain->run();
    const auto a = models::state_dict(*testutil::unet_of(*plain));

    const auto c =
        config(val_dir.path(), {{"validation_prompt", "a red circle"}, {"report_to", "tensorboard"}});
    auto trainer = make_trainer(c);
    add_observers(*trainer);
    trainer->run();
    const auto b = models::state_dict(*testutil::unet_of(*trainer));
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;

    const auto dir = val_dir / "validation_images";
    for (int step : {0, 2, 4})
        EXPECT_TRUE(std::filesystem::exists(dir / str("step_", step, "_validation_0_64x64.png"))) << step;
    EXPECT_EQ(list_validation_images(dir).size(), 3u);  // the final step coincides with the interval
    // The live UNet is validated: the base model's image differs from the trained one's.
    const auto before = io::read_image(dir / "step_0_validation_0_64x64.png");
    const auto after = io::read_image(dir / "step_4_validation_0_64x64.png");
    EXPECT_NE(before.pixels, after.pixels);

    // metrics.jsonl has samples seen; TensorBoard got scalars and the three images.
    const auto rows = read_jsonl(val_dir / "metrics.jsonl");
    ASSERT_EQ(rows.size(), 4u);
    EXPECT_EQ(rows.back().at("samples_seen").get<int64_t>(), 8);
    std::filesystem::path events;
    for (const auto& e : std::filesystem::directory_iterator(val_dir / "logs" / "dtune")) events = e.path();
    int64_t losses = 0, images = 0;
    for (const auto& e : read_events(events))
        for (const auto& v : e.values) {
            losses += v.tag == "train/loss";
            images += v.image.has_value();
        }
    EXPECT_EQ(losses, 4);
    EXPECT_EQ(images, 3);
    EXPECT_TRUE(std::filesystem::exists(val_dir / "report.html"));
}

// validation_preview with a real HTTP listener: the tiny TAESD (tests/data/ref/tiny-taesd, made
// by tools/ref/gen_taesd_ref.py) decodes the sampler's latents after the first step and every
// validation_preview_steps-th; each frame reaches the raw webhook as SimpleTuner's validation.image
// payload with a base64 PNG of the validation size, and training is unchanged. Without a webhook,
// or with no usable decoder, previews are off with a warning and the run goes on.
TEST(Validation, PreviewsReachTheWebhookAsSimpleTunerSendsThem) {
    test::TempDir plain_dir, dir;
    auto plain = make_trainer(config(plain_dir.path()));
    plain->run();
    const auto a = models::state_dict(*testutil::unet_of(*plain));

    test::HttpListener listener;
    notify::WebhookTarget t;
    t.type = notify::WebhookType::kRaw;
    t.url = listener.url("/hook");
    auto notifier = std::make_shared<notify::Notifier>(std::vector<notify::WebhookTarget>{t}, "job", true);
    const auto c =
        config(dir.path(), {{"validation_prompt", "a red circle"},
                            {"validation_num_inference_steps", 4},
                            {"validation_preview", true},
                            {"validation_preview_steps", 2},
                            {"validation_preview_model",
                             (std::filesystem::path(DTUNE_TEST_DATA_DIR) / "ref" / "tiny-taesd").string()}});
    auto trainer = make_trainer(c);
    add_observers(*trainer, notifier);
    trainer->run();
    ASSERT_TRUE(notifier->flush(std::chrono::seconds(20)));
    const auto b = models::state_dict(*testutil::unet_of(*trainer));
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;

    std::vector<int64_t> steps;
    for (const auto& r : listener.requests()) {
        const auto body = nlohmann::json::parse(r.body);
        if (body.at("type") != "validation.image") continue;
        steps.push_back(body.at("data").at("step").get<int64_t>());
        EXPECT_EQ(body.at("data").at("resolution"), nlohmann::json::array({64, 64}));
        EXPECT_EQ(body.at("data").at("prompt"), "a red circle");
        EXPECT_EQ(body.at("body"), "a red circle");
        EXPECT_EQ(body.at("title"), str("Validation (step ", steps.back(), "/4): validation"));
        EXPECT_TRUE(body.at("data").at("timestep").is_number());
        const io::RgbImage img =
            io::decode_image(base64_decode(body.at("images").at(0).get<std::string>()), "preview.png");
        EXPECT_EQ(img.width, 64);
        EXPECT_EQ(img.height, 64);
    }
    // Validation at steps 0, 2 and 4; previews after sampler steps 1, 2 and 4 of each.
    EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 4, 1, 2, 4, 1, 2, 4}));
    notifier->close(std::chrono::seconds(5));

    // No webhook: a warning, no previews, the run completes; a folder that is no TAESD: the same.
    for (const nlohmann::json& extra :
         {nlohmann::json{{"validation_prompt", "a red circle"}, {"validation_preview", true}},
          nlohmann::json{{"validation_prompt", "a red circle"},
                         {"validation_preview", true},
                         {"validation_preview_model", dir.path().string()}}}) {
        test::TempDir other;
        const auto log_file = other.path() / "run.log";
        log::set_file(log_file);
        auto run = make_trainer(config(other.path() / "out", extra));
        test::HttpListener l2;
        notify::WebhookTarget t2 = t;
        t2.url = l2.url("/hook");
        auto n2 = std::make_shared<notify::Notifier>(std::vector<notify::WebhookTarget>{t2}, "job", true);
        add_observers(*run, extra.contains("validation_preview_model") ? n2 : nullptr);
        EXPECT_EQ(run->run().outcome, train::TrainOutcome::kCompleted);
        log::set_file({});
        const std::string text = fs::read_file(log_file);
        EXPECT_NE(text.find("validation_preview"), std::string::npos) << text;
        n2->close(std::chrono::seconds(5));
        for (const auto& r : l2.requests())
            EXPECT_NE(nlohmann::json::parse(r.body).at("type"), "validation.image");
    }
}

// A SimpleTuner config made for wandb trains; the metrics go to TensorBoard files, and the log says
// once that wandb is not available.
// DTUNE_PROFILE_STEPS's observer traces the steps asked for (CPU operators on a CPU run) into
// <output_dir>/profile/trace_rank0.json, and a malformed range is refused naming the variable.
TEST(Report, StepProfilerWritesATraceOfTheStepsAskedFor) {
    test::TempDir dir;
    const auto c = config(
        dir.path(), {{"max_train_steps", 3}, {"checkpoint_step_interval", 0}, {"validation_prompt", ""}});
    auto trainer = make_trainer(c);
    trainer->add_callback(make_step_profiler("2:3"));
    trainer->run();
    const auto trace = dir / "profile" / "trace_rank0.json";
    ASSERT_TRUE(std::filesystem::exists(trace));
    const auto j = nlohmann::json::parse(fs::read_file(trace));
    int64_t ops = 0;
    for (const auto& e : j.at("traceEvents"))
        if (e.value("name", "").rfind("aten::", 0) == 0) ++ops;
    EXPECT_GT(ops, 100) << "the trace holds the steps' operators";
    EXPECT_EQ(make_step_profiler(nullptr), nullptr);
    EXPECT_EQ(make_step_profiler(""), nullptr);
    for (const char* bad : {"x", "3:2", "0:1", "2-3"}) {
        try {
            make_step_profiler(bad);
            ADD_FAILURE() << bad << " was accepted";
        } catch (const UsageError& e) {
            EXPECT_NE(std::string(e.what()).find("DTUNE_PROFILE_STEPS"), std::string::npos) << e.what();
        }
    }
}

TEST(Report, ReportToWandbWritesTensorBoardAndSaysSoOnce) {
    test::TempDir dir;
    const auto c = config(dir.path(), {{"report_to", "wandb"},
                                       {"tracker_project_name", "my-project"},
                                       {"tracker_run_name", "run-1"},
                                       {"max_train_steps", 2},
                                       {"checkpoint_step_interval", 0}});
    const auto log_file = dir / "run.log";
    log::set_file(log_file);
    auto trainer = make_trainer(c);
    add_observers(*trainer);
    trainer->run();
    log::set_file({});
    const std::string log_text = fs::read_file(log_file);
    size_t said = 0;
    for (size_t at = log_text.find("wandb is not available"); at != std::string::npos;
         at = log_text.find("wandb is not available", at + 1))
        ++said;
    EXPECT_EQ(said, 1u) << log_text;
    int64_t losses = 0;
    ASSERT_TRUE(std::filesystem::is_directory(dir / "logs" / "dtune"));
    for (const auto& f : std::filesystem::directory_iterator(dir / "logs" / "dtune"))
        for (const auto& e : read_events(f.path()))
            for (const auto& v : e.values) losses += v.tag == "train/loss";
    EXPECT_EQ(losses, 2);
}

TEST(Validation, EpochIntervalValidatesAtEpochEnds) {
    // The synthetic source has 4 micro-batches per epoch: epochs end after steps 4 and 8.
    test::TempDir dir;
    const auto c = config(dir.path(), {{"validation_prompt", "a red circle"},
                                       {"validation_step_interval", 0},
                                       {"validation_epoch_interval", 1},
                                       {"disable_benchmark", true},
                                       {"max_train_steps", 9},
                                       {"checkpoint_step_interval", 0}});
    auto trainer = make_trainer(c);
    add_observers(*trainer);
    trainer->run();
    std::set<int64_t> steps;
    for (const auto& f : list_validation_images(dir / "validation_images")) steps.insert(f.step);
    EXPECT_EQ(steps, (std::set<int64_t>{4, 8, 9}));  // two epoch ends and the final step
}

TEST(Report, DatasetSummaryLeavesOutDisabledEntries) {
    test::TempDir dir;
    const nlohmann::json backends = nlohmann::json::array(
        {{{"id", "pics"}, {"instance_data_dir", (dir / "pics").string()}},
         {{"id", "old"}, {"instance_data_dir", (dir / "old").string()}, {"disabled", "true"}},
         {{"id", "older"}, {"instance_data_dir", (dir / "older").string()}, {"disable", true}},
         {{"id", "text"},
          {"dataset_type", "text_embeds"},
          {"default", true},
          {"cache_dir", (dir / "t").string()}}});
    fs::write_file_atomic(dir / "mdb.json", backends.dump());
    const auto summary =
        report::dataset_summary(config(dir / "out", {{"data_backend_config", (dir / "mdb.json").string()}}));
    EXPECT_TRUE(summary.contains("pics")) << summary.dump();
    EXPECT_TRUE(summary.contains("text")) << summary.dump();
    EXPECT_FALSE(summary.contains("old")) << summary.dump();
    EXPECT_FALSE(summary.contains("older")) << summary.dump();
}

// An instance_data_dir with a subfolder the user cannot list (lost+found, chmod 000): the report's
// image count leaves it out like discovery does. Before: the walk threw "Permission denied" and,
// from the first checkpoint's report, ended the run. Run as an unprivileged user (root lists
// anything).
TEST(Report, DatasetSummaryCountsAroundAnUnreadableFolder) {
    test::TempDir dir;
    std::filesystem::permissions(dir.path(), std::filesystem::perms(0755));
    const auto pics = dir / "pics", locked = dir / "pics" / "lost+found";
    std::filesystem::create_directories(locked);
    for (const char* name : {"a.png", "b.jpg"}) fs::write_file_atomic(pics / name, "x");
    fs::write_file_atomic(locked / "c.png", "x");
    std::filesystem::permissions(locked, std::filesystem::perms::none);
    const nlohmann::json backends =
        nlohmann::json::array({{{"id", "pics"}, {"instance_data_dir", pics.string()}},
                               {{"id", "text"},
                                {"dataset_type", "text_embeds"},
                                {"default", true},
                                {"cache_dir", (dir / "t").string()}}});
    fs::write_file_atomic(dir / "mdb.json", backends.dump());
    const auto c = config(dir / "out", {{"data_backend_config", (dir / "mdb.json").string()}});
    const test::ChildRun child = test::run_unprivileged([&] {
        if (::access(locked.c_str(), R_OK) == 0) return 3;  // the folder must really be unreadable here
        const auto summary = dataset_summary(c);
        std::fprintf(stderr, "summary: %s\n", summary.dump().c_str());
        const std::string line = summary.value("pics", "");
        return line.find(", 2 images") != std::string::npos ? 0 : 4;
    });
    std::filesystem::permissions(locked, std::filesystem::perms(0755));
    if (!child.skip_reason.empty()) GTEST_SKIP() << child.skip_reason;
    ASSERT_NE(child.exit_code, 3) << "the test could not make " << locked << " unreadable";
    // Before: 125, the child threw a filesystem_error (Permission denied).
    EXPECT_EQ(child.exit_code, 0) << "see the child's stderr above";
}

// Writing report.html only describes the run: when it fails (here report.html is a folder, which
// stops the atomic rename even for root) training goes on to the end, with a warning.
TEST(Report, AReportThatCannotBeWrittenDoesNotStopTraining) {
    test::TempDir dir;
    std::filesystem::create_directories(dir / "report.html" / "in the way");
    auto trainer = make_trainer(config(dir.path()));
    trainer->add_callback(std::make_shared<ReportCallback>());
    train::TrainResult result;
    // Before: the first checkpoint's report threw "cannot rename ... report.html" out of run().
    ASSERT_NO_THROW(result = trainer->run());
    EXPECT_EQ(result.outcome, train::TrainOutcome::kCompleted);
    EXPECT_EQ(result.global_step, trainer->total_steps());
    EXPECT_TRUE(std::filesystem::exists(dir / "checkpoint-2"));
}

// Likewise TensorBoard's event file: when it cannot be written (output_dir/logs is a file here)
// TensorBoard logging stops with a warning and the run completes.
TEST(Report, TensorBoardThatCannotBeWrittenDoesNotStopTraining) {
    test::TempDir dir;
    fs::write_file_atomic(dir / "logs", "a file where the logs folder goes");
    auto trainer = make_trainer(config(dir.path(), {{"report_to", "tensorboard"}}));
    trainer->add_callback(std::make_shared<TensorBoardCallback>());
    train::TrainResult result;
    // Before: "cannot create directories ... logs/dtune" out of run(), before the first step.
    ASSERT_NO_THROW(result = trainer->run());
    EXPECT_EQ(result.global_step, trainer->total_steps());
}

TEST(EvalLoss, TrailingTimestepsMatchDiffusers) {
    // numpy: np.round(np.arange(1000, 0, -1000/28)).astype(int) - 1 (DDPMScheduler, trailing).
    const std::vector<int64_t> expected{999, 963, 928, 892, 856, 820, 785, 749, 713, 678, 642, 606, 570, 535,
                                        499, 463, 428, 392, 356, 320, 285, 249, 213, 178, 142, 106, 70,  35};
    EXPECT_EQ(trailing_timesteps(1000, 28), expected);
    EXPECT_EQ(trailing_timesteps(1000, 3), (std::vector<int64_t>{999, 666, 332}));
}

TEST(EvalLoss, SameWeightsSameLossAndTrainingIsSeen) {
    auto unet = models::load_unet(tiny_model() / "unet");
    const auto schedule = tiny_schedule();
    auto gen = at::detail::createCPUGenerator(3);
    std::vector<EvalSample> samples(2);
    for (auto& s : samples) {
        s.latents = at::randn({1, 4, 8, 8}, gen);
        s.cond["prompt_embeds"] = at::randn({1, 77, 64}, gen);
        s.cond["pooled_prompt_embeds"] = at::randn({1, 32}, gen);
        s.cond["time_ids"] = at::tensor({64.f, 64.f, 0.f, 0.f, 64.f, 64.f}).unsqueeze(0);
    }
    const auto ts = trailing_timesteps(1000, 4);
    unet->train();
    const double first = eval_loss(*family::sdxl_family().wrap_denoiser(unet.ptr()), schedule,
                                   diffusion::PredictionType::kEpsilon, samples, ts);
    (void)at::randn({100});  // the global generator moves; eval uses its own
    const double second = eval_loss(*family::sdxl_family().wrap_denoiser(unet.ptr()), schedule,
                                    diffusion::PredictionType::kEpsilon, samples, ts);
    EXPECT_TRUE(std::isfinite(first));
    EXPECT_EQ(first, second);
    EXPECT_TRUE(unet->is_training());
    {
        at::NoGradGuard g;
        for (auto& p : unet->parameters()) p.mul_(0.5);
    }
    EXPECT_NE(eval_loss(*family::sdxl_family().wrap_denoiser(unet.ptr()), schedule,
                        diffusion::PredictionType::kEpsilon, samples, ts),
              first);
}

TEST(EvalLoss, CallbackScoresAnEvalDatasetDeterministically) {
    test::TempDir dir;
    std::filesystem::create_directories(dir / "eval");
    for (int i = 0; i < 2; ++i) {
        io::RgbImage im(64, 64);
        for (size_t k = 0; k < im.pixels.size(); ++k)
            im.pixels[k] = static_cast<uint8_t>((k * (i + 3)) % 251);
        io::write_image(dir / "eval" / str("img", i, ".png"), im);
        std::ofstream(dir / "eval" / str("img", i, ".txt")) << "a shape " << i;
    }
    const auto backend = dir / "multidatabackend.json";
    std::ofstream(backend) << nlohmann::json::array({{{"id", "train"},
                                                      {"type", "local"},
                                                      {"instance_data_dir", (dir / "eval").string()},
                                                      {"caption_strategy", "textfile"},
                                                      {"resolution", 64},
                                                      {"resolution_type", "pixel"}},
                                                     {{"id", "holdout"},
                                                      {"type", "local"},
                                                      {"dataset_type", "eval"},
                                                      {"instance_data_dir", (dir / "eval").string()},
                                                      {"caption_strategy", "textfile"},
                                                      {"resolution", 64},
                                                      {"resolution_type", "pixel"}},
                                                     {{"id", "te"},
                                                      {"type", "local"},
                                                      {"dataset_type", "text_embeds"},
                                                      {"default", true},
                                                      {"cache_dir", (dir / "te").string()}}})
                                  .dump();
    const auto c = config(dir / "out", {{"data_backend_config", backend.string()}, {"eval_timesteps", 3}});
    auto cb = make_eval_loss_callback(c);
    ASSERT_NE(cb, nullptr);
    auto trainer = make_trainer(c);
    const double a = cb->evaluate(*trainer, 0);
    const double b = cb->evaluate(*trainer, 0);
    EXPECT_TRUE(std::isfinite(a));
    EXPECT_EQ(a, b);
    const auto rows = read_jsonl(dir / "out" / "eval.jsonl");
    ASSERT_EQ(rows.size(), 2u);
    EXPECT_EQ(rows[0].at("images").get<int>(), 2);
    EXPECT_EQ(make_eval_loss_callback(config(dir / "out2")), nullptr);  // no eval dataset, no callback
}

}  // namespace
}  // namespace test_observers_local
}  // namespace dtune::report

// The step profiler observer (see step_profiler.h): starts Kineto after step A-1 ends (or at the
// start when A is 1), stops and saves after step B, or at the end of a run that stops earlier.
#include "report/step_profiler.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "train/trainer.h"

namespace dtune::report {
namespace {

namespace prof = torch::autograd::profiler;

class StepProfiler final : public train::TrainCallback {
  public:
    StepProfiler(int64_t first, int64_t last) : first_(first), last_(last) {}

    void on_train_start(train::Trainer& trainer) override {
        if (first_ <= trainer.global_step() + 1) start(trainer);
    }
    void on_step_end(train::Trainer& trainer, const train::StepReport& report) override {
        if (!running_ && report.step + 1 == first_) start(trainer);
        if (running_ && report.step >= last_) stop(trainer);
    }
    void on_train_end(train::Trainer& trainer, const train::TrainResult&) override {
        if (running_) stop(trainer);
    }

  private:
    void start(train::Trainer& trainer) {
        // DTUNE_PROFILE_CPU=1 adds the CPU side on CUDA too (ops with input shapes, linked to their
        // kernels): for attributing an eager step's kernels to ops (a graph replay has no ops).
        const char* cpu_env = std::getenv("DTUNE_PROFILE_CPU");
        const bool cpu = cpu_env != nullptr && std::string(cpu_env) == "1";
        std::set<torch::profiler::impl::ActivityType> activities{torch::profiler::impl::ActivityType::CPU};
        if (trainer.device().is_cuda()) {
            activities = {torch::profiler::impl::ActivityType::CUDA};
            if (cpu) activities.insert(torch::profiler::impl::ActivityType::CPU);
        }
        const prof::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO,
                                          /*report_input_shapes=*/cpu);
        prof::prepareProfiler(config, activities);
        prof::enableProfiler(config, activities);
        running_ = true;
        if (trainer.is_main_process())
            log::info() << "DTUNE_PROFILE_STEPS: tracing steps " << first_ << " to " << last_;
    }
    void stop(train::Trainer& trainer) {
        if (trainer.device().is_cuda()) at::accelerator::synchronizeDevice(trainer.device().index());
        auto result = prof::disableProfiler();
        running_ = false;
        const auto dir = trainer.output_dir() / "profile";
        std::filesystem::create_directories(dir);
        const auto path = dir / str("trace_rank", trainer.rank(), ".json");
        result->save(path.string());
        log::info() << "DTUNE_PROFILE_STEPS: wrote " << path.string();
    }

    int64_t first_, last_;
    bool running_ = false;
};

}  // namespace

std::shared_ptr<train::TrainCallback> make_step_profiler(const char* v) {
    if (v == nullptr || *v == '\0') return nullptr;
    const std::string s = v;
    const auto number = [](const std::string& t) -> int64_t {  // the whole text, digits only; else 0
        if (t.empty() || t.size() > 12 || t.find_first_not_of("0123456789") != std::string::npos) return 0;
        return std::stoll(t);
    };
    const auto colon = s.find(':');
    const int64_t first = number(s.substr(0, colon));
    const int64_t last = colon == std::string::npos ? first : number(s.substr(colon + 1));
    DTUNE_CHECK_AS(UsageError, first >= 1 && last >= first, "DTUNE_PROFILE_STEPS=", s,
                   " is not a step range: give FIRST:LAST optimizer steps (1-based), e.g. 20:22");
    return std::make_shared<StepProfiler>(first, last);
}

}  // namespace dtune::report

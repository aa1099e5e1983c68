// bench_train_step: full-size SDXL training steps with random weights, timed with device events,
// through the trainer's own step (train::optimizer_step_async = micro_step + backward + clipping +
// fused AdamW), so what speeds this up speeds up `dtune train`. One JSON line per mode. Usage:
//   bench_train_step <sdxl folder or unet/ folder> [--modes full1gc,lora1,lora4] [--res 1024]
//       [--steps 10] [--warmup 3] [--rank 16] [--fwd-tflop 6.76] [--profile DIR] [--no-peak]
//       [--no-cudnn-sdpa] [--cudnn-benchmark] [--no-fused-geglu] [--no-fused-lora] [--no-fused-adamw]
//       [--gc-interval N]
//       [--nhwc-group-norm]
// A mode is (lora|full)<batch>[gc][cl]: LoRA rank r on to_q,to_k,to_v,to_out.0 (bf16 base weights,
// float32 adapter weights) or a full fine-tune (float32 master weights); both under bf16 autocast,
// AdamW (fused), clip at norm 1, as ../shared/bench/diffusers_sdxl_baseline.py does; gc = gradient
// checkpointing, cl = channels-last convolutions, cg = the whole step as a CUDA graph (suffixes in
// any order), bf = (full only) bf16 weights and SimpleTuner's default optimizer adamw_bf16 (stochastic
// rounding, no float32 master copy) instead of float32 master weights and AdamW. Full float32 modes
// run first, then full bf modes, then LoRA (each step of that order is one-way). --no-cudnn-sdpa
// turns SDPA's cuDNN kernels off (flash/efficient then); --cudnn-benchmark lets cuDNN time its
// convolution algorithms per shape (benchmark mode); --no-fused-geglu uses chunk + gelu + mul;
// --no-fused-lora runs each adapted linear as base linear + adapter (models::set_fused_lora);
// --no-fused-adamw runs adamw_bf16 as whole-bucket ATen ops instead of its fused CUDA kernel;
// --gc-interval N checkpoints every N-th ResNet/transformer block in gc modes
// (gradient_checkpointing_interval); --nhwc-group-norm keeps GroupNorm in NHWC for channels-last
// (cl) modes (models::set_group_norm_nhwc) instead of ATen's, which makes its input NCHW first.
// MFU = model FLOPs / step time / measured bf16 matmul peak of this GPU (8192³, same program).
// Model FLOPs: fwd_tflop (the baseline's FLOP counter at 1024²: 6.76) × (res/1024)² × batch × 2
// for LoRA (forward + input gradients) or × 3 for a full fine-tune; recomputation is not counted.
// Without CUDA it prints {"skipped": ...} and exits 0.
#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <c10/core/Event.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "diffusion/noise_schedule.h"
#include "family/sdxl/sdxl_family.h"
#include "models/adapters/lora.h"
#include "models/common/blocks.h"
#include "models/common/geglu.h"
#include "models/unet/unet_2d_condition.h"
#include "train/graph_step.h"
#include "train/optimizer.h"
#include "train/step.h"

namespace {

using namespace dtune;

struct Args {
    std::filesystem::path model;
    std::string modes = "lora1,lora4";
    int64_t res = 1024, steps = 10, warmup = 3, rank = 16;
    double fwd_tflop_1024 = 6.76;  // PERFORMANCE.md: SDXL UNet forward, 1 image, 1024²
    std::filesystem::path profile_dir;
    bool measure_peak = true;
    bool cudnn_sdpa = true;
    bool cudnn_benchmark = false;
    bool fused_geglu = true;
    bool fused_lora = true;
    bool fused_adamw = true;
    int64_t gc_interval = 1;
    bool nhwc_group_norm = false;
};

struct Mode {
    std::string name;
    bool lora = true;
    int64_t batch = 1;
    bool checkpointing = false;
    bool channels_last = false;
    bool graph = false;         // the whole step as one CUDA graph per shape (train::GraphedStep)
    bool bf16_weights = false;  // full only: bf16 weights + adamw_bf16
};

Args parse_args(int argc, char** argv) {
    Args a;
    for (int i = 1; i < argc; ++i) {
        const std::string s = argv[i];
        auto next = [&] {
            if (i + 1 >= argc) throw std::invalid_argument(s + " needs a value");
            return std::string(argv[++i]);
        };
        if (s == "--modes")
            a.modes = next();
        else if (s == "--res")
            a.res = std::stoll(next());
        else if (s == "--steps")
            a.steps = std::stoll(next());
        else if (s == "--warmup")
            a.warmup = std::stoll(next());
        else if (s == "--rank")
            a.rank = std::stoll(next());
        else if (s == "--fwd-tflop")
            a.fwd_tflop_1024 = std::stod(next());
        else if (s == "--profile")
            a.profile_dir = next();
        else if (s == "--no-peak")
            a.measure_peak = false;
        else if (s == "--no-cudnn-sdpa")
            a.cudnn_sdpa = false;
        else if (s == "--no-fused-geglu")
            a.fused_geglu = false;
        else if (s == "--cudnn-benchmark")
            a.cudnn_benchmark = true;
        else if (s == "--no-fused-lora")
            a.fused_lora = false;
        else if (s == "--no-fused-adamw")
            a.fused_adamw = false;
        else if (s == "--gc-interval")
            a.gc_interval = std::stoll(next());
        else if (s == "--nhwc-group-norm")
            a.nhwc_group_norm = true;
        else
            a.model = s;
    }
    return a;
}

Mode parse_mode(const std::string& text) {
    Mode m;
    m.name = text;
    std::string rest = text;
    if (rest.rfind("lora", 0) == 0)
        rest = rest.substr(4);
    else if (rest.rfind("full", 0) == 0)
        m.lora = false, rest = rest.substr(4);
    else
        throw std::invalid_argument("mode \"" + text + "\" must start with lora or full (e.g. lora4gc)");
    size_t digits = 0;
    while (digits < rest.size() && std::isdigit(static_cast<unsigned char>(rest[digits]))) ++digits;
    if (digits == 0) throw std::invalid_argument("mode \"" + text + "\" needs a batch size, e.g. lora4");
    m.batch = std::stoll(rest.substr(0, digits));
    rest = rest.substr(digits);
    for (; rest.size() >= 2; rest = rest.substr(2)) {  // suffixes in any order: gc, cl, cg, bf
        const std::string sfx = rest.substr(0, 2);
        if (sfx == "bf" && !m.lora)
            m.bf16_weights = true;
        else if (sfx == "gc")
            m.checkpointing = true;
        else if (sfx == "cl")
            m.channels_last = true;
        else if (sfx == "cg")
            m.graph = true;
        else
            break;
    }
    if (!rest.empty()) throw std::invalid_argument("mode \"" + text + "\": unknown suffix \"" + rest + "\"");
    return m;
}

std::vector<Mode> parse_modes(const std::string& list) {
    std::vector<Mode> modes;
    std::stringstream ss(list);
    for (std::string item; std::getline(ss, item, ',');)
        if (!item.empty()) modes.push_back(parse_mode(item));
    // Full float32 fine-tunes first, then bf16 ones, then LoRA: turning the weights to bf16 and
    // injecting adapters are for good.
    auto order = [](const Mode& m) { return m.lora ? 2 : (m.bf16_weights ? 1 : 0); };
    std::stable_sort(modes.begin(), modes.end(),
                     [&](const Mode& a, const Mode& b) { return order(a) < order(b); });
    return modes;
}

c10::Stream current_stream() {
    return at::accelerator::getCurrentStream(0);
}

// Dense bf16 matmul throughput of this GPU (TFLOP/s), median of 10 timed products on random data.
double measure_matmul_peak() {
    const auto opts = at::TensorOptions().device(c10::kCUDA).dtype(at::kBFloat16);
    const int64_t n = 8192;
    const at::Tensor a = at::randn({n, n}, opts), b = at::randn({n, n}, opts);
    for (int i = 0; i < 3; ++i) at::mm(a, b);
    std::vector<double> ms;
    for (int i = 0; i < 10; ++i) {
        c10::Event start(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
        c10::Event end(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
        start.record(current_stream());
        at::mm(a, b);
        end.record(current_stream());
        end.synchronize();
        ms.push_back(start.elapsedTime(end));
    }
    std::sort(ms.begin(), ms.end());
    return 2.0 * static_cast<double>(n * n * n) / (ms[ms.size() / 2] * 1e-3) / 1e12;
}

// Random inputs shaped like an SDXL batch at `res` (latents [B, 4, res/8, res/8], context [B, 77, D]).
train::TrainBatch make_batch(const models::UNet2DConditionConfig& c, int64_t batch, int64_t res,
                             at::ScalarType dtype) {
    const auto opts = at::TensorOptions().device(c10::kCUDA).dtype(dtype);
    const int64_t lat = res / 8;
    train::TrainBatch b;
    b.latents = at::randn({batch, c.in_channels, lat, lat}, opts);                        // [B, 4, h, w]
    b.cond["prompt_embeds"] = at::randn({batch, 77, c.cross_attention_dim.at(0)}, opts);  // [B, 77, D]
    const int64_t pooled = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim;
    b.cond["pooled_prompt_embeds"] = at::randn({batch, pooled}, opts);  // [B, P]
    const double r = static_cast<double>(res);
    b.cond["time_ids"] =
        at::tensor(std::vector<double>{r, r, 0, 0, r, r}).to(opts).repeat({batch, 1});  // [B, 6]
    return b;
}

at::ScalarType weight_dtype(const Mode& mode) {
    return mode.lora || mode.bf16_weights ? at::kBFloat16 : at::kFloat;
}

// Everything a mode's timed loop needs besides the model.
struct Bench {
    const Args& args;
    const diffusion::NoiseSchedule& schedule;
    double peak_tflops = 0;
    int64_t total_params = 0;
};

struct Timing {
    std::vector<double> ms;  // per timed step, device events
    double wall_ms = 0;      // the timed steps back to back, host clock, one sync at the end
    double loss = 0, grad_norm = 0;
    double peak_gib = 0;
    int64_t replays = 0;  // steps replayed from a CUDA graph
};

Timing time_steps(models::UNet2DConditionModel& unet, const Mode& mode, const Bench& bench,
                  train::Optimizer& optimizer, const std::vector<at::Tensor>& params) {
    const auto& cfg = unet->config();
    const train::TrainBatch batch = make_batch(cfg, mode.batch, bench.args.res, weight_dtype(mode));
    train::StepOptions options;
    options.compute_dtype = at::kBFloat16;
    options.device_rng = mode.graph;
    at::Generator gen = at::detail::createCPUGenerator(0);
    train::GraphedStep graphed;
    const auto model = family::sdxl_family().wrap_denoiser(unet.ptr());
    at::accelerator::synchronizeDevice(0);
    at::accelerator::resetPeakStats(0);
    const int64_t n = bench.args.warmup + bench.args.steps;
    std::vector<c10::Event> starts, ends;
    for (int64_t s = 0; s < n; ++s) {
        starts.emplace_back(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
        ends.emplace_back(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
    }
    train::StepTensors last;
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t s = 0; s < n; ++s) {
        if (s == bench.args.warmup) {
            at::accelerator::synchronizeDevice(0);
            t0 = std::chrono::steady_clock::now();
        }
        starts[s].record(current_stream());
        last = mode.graph
                   ? graphed.run(*model, batch, bench.schedule, options, s, gen, optimizer, params, 1.0)
                   : train::optimizer_step_async(*model, batch, bench.schedule, options, s, gen, optimizer,
                                                 params, 1.0);
        ends[s].record(current_stream());
    }
    at::accelerator::synchronizeDevice(0);
    Timing t;
    t.wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    for (int64_t s = bench.args.warmup; s < n; ++s) t.ms.push_back(starts[s].elapsedTime(ends[s]));
    t.loss = last.loss.item<double>();  // read back once, after timing
    t.grad_norm = last.grad_norm.defined() ? last.grad_norm.item<double>() : 0.0;
    const auto stats = at::accelerator::getDeviceStats(0);
    t.peak_gib = static_cast<double>(stats.allocated_bytes[0].peak) / (1 << 30);  // [0]: all pools
    t.replays = graphed.replays();
    return t;
}

// Two more steps under the Kineto profiler (GPU activity only), written as a Chrome trace.
void profile_steps(models::UNet2DConditionModel& unet, const Mode& mode, const Bench& bench,
                   train::Optimizer& optimizer, const std::vector<at::Tensor>& params) {
    const auto model = family::sdxl_family().wrap_denoiser(unet.ptr());
    namespace prof = torch::autograd::profiler;
    const std::set<torch::profiler::impl::ActivityType> activities{torch::profiler::impl::ActivityType::CUDA};
    const prof::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
    const train::TrainBatch batch =
        make_batch(unet->config(), mode.batch, bench.args.res, weight_dtype(mode));
    train::StepOptions options;
    options.compute_dtype = at::kBFloat16;
    options.device_rng = mode.graph;
    at::Generator gen = at::detail::createCPUGenerator(1);
    train::GraphedStep graphed;
    for (int s = 0; mode.graph && s < 3; ++s)  // warm up and capture before the profiled replays
        graphed.run(*model, batch, bench.schedule, options, s, gen, optimizer, params, 1.0);
    prof::prepareProfiler(config, activities);
    prof::enableProfiler(config, activities);
    for (int s = 0; s < 2; ++s) {
        if (mode.graph)
            graphed.run(*model, batch, bench.schedule, options, s, gen, optimizer, params, 1.0);
        else
            train::optimizer_step_async(*model, batch, bench.schedule, options, s, gen, optimizer, params,
                                        1.0);
    }
    at::accelerator::synchronizeDevice(0);
    auto result = prof::disableProfiler();
    std::filesystem::create_directories(bench.args.profile_dir);
    result->save((bench.args.profile_dir / ("trace_" + mode.name + ".json")).string());
}

std::string percentile_json(std::vector<double> ms) {
    std::sort(ms.begin(), ms.end());
    auto at = [&](double q) { return ms[static_cast<size_t>(q * static_cast<double>(ms.size() - 1) + 0.5)]; };
    std::ostringstream o;
    o << "\"ms_step_median\": " << at(0.5) << ", \"ms_step_min\": " << ms.front()
      << ", \"ms_step_max\": " << ms.back() << ", \"ms_step_p10\": " << at(0.1)
      << ", \"ms_step_p90\": " << at(0.9);
    return o.str();
}

void report(const Mode& mode, const Bench& bench, const Timing& t, int64_t trainable, const std::string& sdpa,
            std::pair<int64_t, int64_t> checkpointed) {
    std::vector<double> sorted = t.ms;
    std::sort(sorted.begin(), sorted.end());
    const double median = sorted[sorted.size() / 2];
    const double scale = std::pow(static_cast<double>(bench.args.res) / 1024.0, 2);
    const double tflop =
        bench.args.fwd_tflop_1024 * scale * static_cast<double>(mode.batch) * (mode.lora ? 2 : 3);
    const double achieved = tflop / (median * 1e-3);
    std::cout << "{\"bench\": \"train_step\", \"mode\": \"" << mode.name << "\", \"batch\": " << mode.batch
              << ", \"res\": " << bench.args.res << ", \"lora_rank\": " << (mode.lora ? bench.args.rank : 0)
              << ", \"checkpointing\": " << (mode.checkpointing ? "true" : "false")
              << ", \"checkpointed_blocks\": " << checkpointed.first
              << ", \"checkpointable_blocks\": " << checkpointed.second
              << ", \"channels_last\": " << (mode.channels_last ? "true" : "false") << ", \"optimizer\": \""
              << (mode.bf16_weights ? "adamw_bf16" : "adamw") << "\""
              << ", \"fused_geglu\": " << (models::fused_geglu_enabled() ? "true" : "false")
              << ", \"fused_lora\": " << (models::fused_lora_enabled() ? "true" : "false")
              << ", \"nhwc_group_norm\": " << (bench.args.nhwc_group_norm ? "true" : "false")
              << ", \"fused_adamw\": " << (mode.bf16_weights && bench.args.fused_adamw ? "true" : "false")
              << ", \"cuda_graph_replays\": " << t.replays << ", \"params\": " << bench.total_params
              << ", \"trainable\": " << trainable << ", \"steps\": " << t.ms.size() << ", "
              << percentile_json(t.ms)
              << ", \"ms_step_wall_mean\": " << t.wall_ms / static_cast<double>(t.ms.size())
              << ", \"img_per_s\": " << static_cast<double>(mode.batch) / (median * 1e-3)
              << ", \"peak_gib\": " << t.peak_gib << ", \"model_tflop_per_step\": " << tflop
              << ", \"achieved_tflops\": " << achieved << ", \"matmul_peak_tflops\": " << bench.peak_tflops
              << ", \"mfu\": " << (bench.peak_tflops > 0 ? achieved / bench.peak_tflops : 0.0)
              << ", \"sdpa\": \"" << sdpa << "\", \"loss\": " << t.loss << ", \"grad_norm\": " << t.grad_norm
              << "}" << std::endl;
}

// The kernel SDPA picks for level-1 self-attention of this model at this size.
std::string sdpa_choice(const models::UNet2DConditionConfig& c, int64_t batch, int64_t res) {
    const int64_t heads = c.heads.size() > 1 ? c.heads[1] : c.heads[0];
    const int64_t ch = c.block_out_channels.size() > 1 ? c.block_out_channels[1] : c.block_out_channels[0];
    const int64_t n = (res / 16) * (res / 16);
    const auto opts = at::TensorOptions().device(c10::kCUDA).dtype(at::kBFloat16);
    const at::Tensor q = at::randn({batch, heads, n, ch / heads}, opts);  // [B, h, N, d]
    return models::sdpa_backend_name(q, q, q);
}

// One mode: set the model up (gc, channels-last, trainable set), build AdamW, time, report.
void run_mode(models::UNet2DConditionModel& unet, std::optional<models::LoRAAdapters>& adapters,
              const Mode& mode, const Bench& bench) {
    if (mode.lora && !adapters) {
        unet->to(at::kBFloat16);
        for (auto& p : unet->parameters()) p.set_requires_grad(false);
        models::LoRAConfig lc;
        lc.rank = bench.args.rank;
        lc.init = models::LoRAInit::kGaussian;
        adapters.emplace(models::inject_lora(*unet, lc));
        at::NoGradGuard no_grad;
        for (auto& p : adapters->parameters()) p.set_data(p.to(at::kFloat));  // float32 adapter weights
    }
    if (mode.bf16_weights) unet->to(at::kBFloat16);
    unet->set_gradient_checkpointing(mode.checkpointing, bench.args.gc_interval);
    unet->set_channels_last(mode.channels_last);
    std::vector<at::Tensor> params = mode.lora ? adapters->parameters() : unet->parameters();
    train::ParamGroup group;
    int64_t trainable = 0;
    for (size_t i = 0; i < params.size(); ++i) {
        group.names.push_back("p" + std::to_string(i));
        group.params.push_back(params[i]);
        trainable += params[i].numel();
    }
    group.lr = mode.lora ? 1e-4 : 1e-5;
    group.weight_decay = 1e-2;  // torch.optim.AdamW's default, as the baseline
    std::unique_ptr<train::Optimizer> optimizer;
    if (mode.bf16_weights) {
        at::Generator gen = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, 0)).clone();
        gen.set_current_seed(7);
        train::AdamWBF16Options o;
        o.fused_kernel = bench.args.fused_adamw;
        optimizer = std::make_unique<train::AdamWBF16>(std::vector<train::ParamGroup>{group}, gen, o);
    } else {
        optimizer = std::make_unique<train::AdamW>(std::vector<train::ParamGroup>{group});
    }
    const Timing t = time_steps(unet, mode, bench, *optimizer, params);
    report(mode, bench, t, trainable, sdpa_choice(unet->config(), mode.batch, bench.args.res),
           unet->checkpointed_blocks());
    if (!bench.args.profile_dir.empty()) profile_steps(unet, mode, bench, *optimizer, params);
    optimizer->zero_grad();
}

int run(const Args& args) {
    std::filesystem::path root = args.model;
    const bool pipeline = std::filesystem::exists(root / "unet" / "config.json");
    const auto unet_cfg = pipeline ? root / "unet" / "config.json" : root / "config.json";
    const auto config = models::UNet2DConditionConfig::from_json(models::ConfigReader::from_file(unet_cfg));
    const auto sched_path = pipeline ? root / "scheduler" / "scheduler_config.json" : std::filesystem::path();
    const diffusion::NoiseSchedule schedule =
        sched_path.empty() || !std::filesystem::exists(sched_path)
            ? diffusion::NoiseSchedule()
            : diffusion::NoiseSchedule(diffusion::NoiseScheduleConfig::from_json(
                  nlohmann::json::parse(std::ifstream(sched_path)), sched_path.string()));
    const std::vector<Mode> modes = parse_modes(args.modes);
    at::globalContext().setAllowTF32CuBLAS(true);  // as the baseline (allow_tf32 for matmul and cuDNN)
    at::globalContext().setAllowTF32CuDNN(true);
    if (!args.cudnn_sdpa) at::globalContext().setSDPUseCuDNN(false);
    at::globalContext().setBenchmarkCuDNN(args.cudnn_benchmark);
    models::set_fused_geglu(args.fused_geglu);
    models::set_fused_lora(args.fused_lora);
    models::set_group_norm_nhwc(args.nhwc_group_norm);
    Bench bench{args, schedule};
    if (args.measure_peak) bench.peak_tflops = measure_matmul_peak();
    models::UNet2DConditionModel unet(config);  // random init on the CPU in float32, then moved
    for (const auto& p : unet->parameters()) bench.total_params += p.numel();
    unet->to(c10::Device(c10::kCUDA, 0));
    unet->train();
    std::optional<models::LoRAAdapters> adapters;
    for (const Mode& mode : modes) run_mode(unet, adapters, mode, bench);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        const Args args = parse_args(argc, argv);
        if (args.model.empty()) {
            std::cerr << "usage: bench_train_step <sdxl folder|unet folder> [--modes lora1,lora4gc,full1gc] "
                         "[--res 1024] [--steps 10] [--warmup 3] [--rank 16] [--profile DIR]\n";
            return 2;
        }
        if (!at::hasCUDA()) {
            std::cout << R"({"bench": "train_step", "skipped": "no CUDA device"})" << std::endl;
            return 0;
        }
        return run(args);
    } catch (const std::exception& e) {
        std::cerr << "bench_train_step: " << e.what() << "\n";
        return 1;
    }
}

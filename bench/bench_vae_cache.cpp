// bench_vae_cache: dtune's VAE latent caching from JPEGs on disk, end to end, through the code
// `dtune train` and `dtune cache` run: bucketing (data::build_dataset_buckets) → the cache
// builder's pipeline (data::build_latent_cache: decode/resize threads → encoder batches per
// bucket shape → writes on threads) → the training VAE callable (family::make_vae_encode_fn: the
// pixel-seeded posterior sample, scaled). The VAE is full size with random weights built from a
// config (the speed does not depend on the values). Prints one JSON line:
//   img_per_s        images cached per second of wall time (cache emptied first; decode, encode
//                    and write all included; bucketing/discovery excluded, reported separately)
//   encoder_busy     device time between each encoder call's start and end events / wall time
//                    (CPU encoder: time inside the call / wall)
//   encode_only_img_per_s  the same encoder on random images already on the device, batch B at
//                    res×res, as bench/diffusers_vae_encode.py times diffusers
//   stages_s         decode/write seconds summed over pool threads; the calling thread's seconds
//                    waiting for decodes, inside encoder calls, waiting for the device
//   peak_gpu_gib, peak_rss_gib
// Usage:
//   bench_vae_cache --images DIR --model <sdxl folder or vae folder> [--make-images N]
//       [--work DIR] [--device cuda|cpu] [--dtype bf16|fp32] [--batch 8] [--res 1024]
//       [--threads T] [--variant base|cl|bm|cl+bm|cl+bm+gn|cl+fu|cl+bm+fu] [--encode-steps 10] [--profile
//       DIR]
// --make-images N first writes N photo-like JPEGs (quality 90, mixed aspect ratios, 1–2.4 MP)
// into DIR unless they exist. Variants: cl = channels-last convolutions, bm = cuDNN benchmark mode
// (algorithm search per shape), gn = GroupNorm kept in NHWC (with cl), fu = the fused inference
// kernels (models/common/group_norm_act.h: GroupNorm+SiLU, bias folding, wide-head attention; with
// cl; what `dtune train` and `dtune cache` use on CUDA); base = none.
#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <c10/core/Event.h>
#include <sys/resource.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/fs.h"
#include "core/thread_pool.h"
#include "data/cache_builder.h"
#include "data/dataset_buckets.h"
#include "family/data_encoders.h"
#include "io/image.h"
#include "models/common/blocks.h"
#include "models/common/config_json.h"
#include "models/common/group_norm_act.h"
#include "models/vae/autoencoder_kl.h"

namespace {

using namespace dtune;
namespace stdfs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Args {
    stdfs::path images, model, work = "out/vae_bench/work";
    int make_images = 0;
    std::string device = "cuda", dtype = "bf16", variant = "base";
    int batch = 8, res = 1024, threads = 0, encode_steps = 10;
    stdfs::path profile_dir;  // CUDA only: a Kineto trace of 2 encode-only batches
};

Args parse_args(int argc, char** argv) {
    Args a;
    for (int i = 1; i < argc; ++i) {
        const std::string s = argv[i];
        if (i + 1 >= argc) throw std::invalid_argument(s + " needs a value");
        const std::string v = argv[++i];
        if (s == "--images")
            a.images = v;
        else if (s == "--model")
            a.model = v;
        else if (s == "--work")
            a.work = v;
        else if (s == "--make-images")
            a.make_images = std::stoi(v);
        else if (s == "--device")
            a.device = v;
        else if (s == "--dtype")
            a.dtype = v;
        else if (s == "--variant")
            a.variant = v;
        else if (s == "--batch")
            a.batch = std::stoi(v);
        else if (s == "--res")
            a.res = std::stoi(v);
        else if (s == "--threads")
            a.threads = std::stoi(v);
        else if (s == "--encode-steps")
            a.encode_steps = std::stoi(v);
        else if (s == "--profile")
            a.profile_dir = v;
        else
            throw std::invalid_argument("unknown argument " + s);
    }
    if (a.images.empty() || a.model.empty()) throw std::invalid_argument("--images and --model are required");
    return a;
}

// A photo-like image: smooth colour fields (sums of slow waves), a few shapes, and grain, so
// it compresses like a photograph (≈0.2–0.5 MB per MP at quality 90).
io::RgbImage photo_like(int w, int h, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> u(0, 1);
    io::RgbImage im(w, h);
    std::vector<std::array<double, 3>> col(static_cast<size_t>(w)), row(static_cast<size_t>(h));
    for (int c = 0; c < 3; ++c) {
        const double fx = 2 + 6 * u(rng), fy = 2 + 6 * u(rng), px = 6.3 * u(rng), py = 6.3 * u(rng);
        for (int x = 0; x < w; ++x) col[size_t(x)][size_t(c)] = 60 * std::sin(fx * x / w + px);
        for (int y = 0; y < h; ++y) row[size_t(y)][size_t(c)] = 60 * std::sin(fy * y / h + py);
    }
    struct Disc {
        double cx, cy, r;
        uint8_t rgb[3];
    };
    std::vector<Disc> discs(6);
    for (auto& d : discs) {
        d = {u(rng) * w, u(rng) * h, (0.05 + 0.2 * u(rng)) * std::min(w, h), {}};
        for (auto& c : d.rgb) c = uint8_t(rng() % 256);
    }
    for (int y = 0; y < h; ++y)
        for (int x = 0; x < w; ++x) {
            uint8_t* p = im.at(x, y);
            const int grain = int(rng() % 17) - 8;
            for (int c = 0; c < 3; ++c)
                p[c] = uint8_t(std::clamp(128 + col[size_t(x)][size_t(c)] + row[size_t(y)][size_t(c)] + grain,
                                          0.0, 255.0));
            for (const auto& d : discs)
                if ((x - d.cx) * (x - d.cx) + (y - d.cy) * (y - d.cy) < d.r * d.r)
                    for (int c = 0; c < 3; ++c) p[c] = uint8_t(std::clamp(int(d.rgb[c]) + grain, 0, 255));
        }
    return im;
}

// N JPEGs of mixed aspect ratios around and above 1024² (what bucketing then resizes down).
void make_images(const stdfs::path& dir, int count, ThreadPool& pool) {
    static const std::vector<std::pair<int, int>> kSizes = {
        {1024, 1024}, {1280, 1280}, {1536, 1536}, {1600, 1200}, {1200, 1600}, {1536, 1024},
        {1024, 1536}, {1920, 1080}, {1080, 1920}, {1344, 1008}, {1792, 1344}, {1152, 1152}};
    stdfs::create_directories(dir);
    pool.parallel_for(size_t(count), [&](size_t i) {
        const stdfs::path p = dir / ("photo_" + std::to_string(i) + ".jpg");
        if (stdfs::exists(p)) return;
        const auto [w, h] = kSizes[(i * 7 + i / 3) % kSizes.size()];
        const stdfs::path tmp = p.string() + ".tmp.jpg";
        io::write_image(tmp, photo_like(w, h, uint32_t(i) + 1), 90);
        stdfs::rename(tmp, p);
    });
}

double peak_rss_gib() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return double(u.ru_maxrss) / (1 << 20);  // KiB → GiB
}

// Encoder calls timed on the device (events around each call) or on the host (CPU encoder).
class TimedEncoder {
  public:
    TimedEncoder(data::LatentEncodeFn fn, c10::Device device) : fn_(std::move(fn)), device_(device) {}
    data::LatentEncodeFn fn() {
        return [this](const at::Tensor& images, const std::vector<uint64_t>& salts) {
            if (!device_.is_cuda()) {
                const auto t0 = Clock::now();
                at::Tensor out = fn_(images, salts);
                host_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
                return out;
            }
            const auto stream = at::accelerator::getCurrentStream(device_.index());
            auto& e = events_.emplace_back(c10::Event(c10::kCUDA, c10::EventFlag::BACKEND_DEFAULT),
                                           c10::Event(c10::kCUDA, c10::EventFlag::BACKEND_DEFAULT));
            e.first.record(stream);
            at::Tensor out = fn_(images, salts);
            e.second.record(stream);
            return out;
        };
    }
    // Seconds the encoder was busy (call with the device synchronised).
    double busy_s() const {
        double s = host_s_;
        for (const auto& [a, b] : events_) s += a.elapsedTime(b) / 1000.0;
        return s;
    }

  private:
    data::LatentEncodeFn fn_;
    c10::Device device_;
    std::vector<std::pair<c10::Event, c10::Event>> events_;
    double host_s_ = 0;
};

void synchronize(c10::Device device) {
    if (device.is_cuda()) at::accelerator::synchronizeDevice(device.index());
}

// The encoder alone on random images already on the device in the VAE's dtype (posterior sample,
// scaled), as the diffusers baseline times it: median img/s over `steps` after 2 warm-ups.
double encode_only_rate(models::AutoencoderKLImpl& vae, const Args& a, c10::Device device,
                        c10::ScalarType dtype, bool channels_last) {
    at::NoGradGuard no_grad;
    const auto opts = at::TensorOptions().dtype(dtype).device(device);
    at::Tensor images = at::rand({a.batch, 3, a.res, a.res}, opts) * 2 - 1;  // [B, 3, H, W]
    if (channels_last) images = images.contiguous(at::MemoryFormat::ChannelsLast);
    std::vector<double> times;
    for (int s = 0; s < a.encode_steps + 2; ++s) {
        const auto t0 = Clock::now();
        (void)vae.scale_latents(vae.encode(images).sample());
        synchronize(device);
        if (s >= 2) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    std::sort(times.begin(), times.end());
    return times.empty() ? 0.0 : a.batch / times[times.size() / 2];
}

// Two encode-only batches under the Kineto profiler (GPU activity), written as a Chrome trace
// (bench/summarize_trace.py --steps 2 turns it into time per kernel family).
void profile_encoder(models::AutoencoderKLImpl& vae, const Args& a, c10::ScalarType dtype,
                     bool channels_last) {
    namespace prof = torch::autograd::profiler;
    const std::set<torch::profiler::impl::ActivityType> activities{torch::profiler::impl::ActivityType::CUDA};
    const prof::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
    at::NoGradGuard no_grad;
    at::Tensor images =
        at::rand({a.batch, 3, a.res, a.res}, at::TensorOptions().dtype(dtype).device(at::kCUDA)) * 2 - 1;
    if (channels_last) images = images.contiguous(at::MemoryFormat::ChannelsLast);
    prof::prepareProfiler(config, activities);
    prof::enableProfiler(config, activities);
    for (int s = 0; s < 2; ++s) (void)vae.scale_latents(vae.encode(images).sample());
    at::accelerator::synchronizeDevice(0);
    auto result = prof::disableProfiler();
    stdfs::create_directories(a.profile_dir);
    std::string name = a.variant;
    std::replace(name.begin(), name.end(), '+', '_');
    result->save((a.profile_dir / ("trace_vae_" + name + ".json")).string());
}

// multidatabackend.json for the folder: SDXL's defaults (pixel_area at --res, no crop).
data::DatasetConfig dataset_for(const Args& a) {
    const stdfs::path dir = stdfs::absolute(a.work);
    const nlohmann::json backends =
        nlohmann::json::array({{{"id", "bench"},
                                {"type", "local"},
                                {"instance_data_dir", stdfs::absolute(a.images).string()},
                                {"resolution", a.res},
                                {"resolution_type", "pixel_area"},
                                {"caption_strategy", "filename"},
                                {"cache_dir_vae", (dir / "vae_cache").string()},
                                {"vae_batch_size", a.batch}},
                               {{"id", "text"},
                                {"dataset_type", "text_embeds"},
                                {"default", true},
                                {"type", "local"},
                                {"cache_dir", (dir / "text_cache").string()}}});
    stdfs::create_directories(dir);
    fs::write_file_atomic(dir / "multidatabackend.json", backends.dump(2));
    data::GlobalDataArgs g;
    g.output_dir = (dir / "output").string();
    g.resolution = a.res;
    const auto config = data::load_data_backend_config(dir / "multidatabackend.json", g);
    for (const auto& d : config.datasets)
        if (d.id == "bench") return d;
    throw std::runtime_error("bench dataset missing from the generated multidatabackend.json");
}

int run(const Args& a) {
    const c10::Device device = a.device == "cuda" ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
    if (device.is_cuda() && !at::hasCUDA()) {
        std::cout << R"({"bench": "vae_cache", "skipped": "no CUDA device"})" << std::endl;
        return 0;
    }
    const bool cl = a.variant.find("cl") != std::string::npos, bm = a.variant.find("bm") != std::string::npos;
    at::globalContext().setBenchmarkCuDNN(bm);
    models::set_group_norm_nhwc(a.variant.find("gn") != std::string::npos);
    models::set_fused_inference(a.variant.find("fu") != std::string::npos);
    ThreadPool pool(size_t(std::max(0, a.threads)));
    if (a.make_images > 0) make_images(a.images, a.make_images, pool);

    // Bucketing (header scan + plans), timed apart from caching.
    const auto t_scan = Clock::now();
    const data::DatasetConfig d = dataset_for(a);
    data::BucketBuildOptions bo;
    bo.output_dir = (stdfs::absolute(a.work) / "output").string();
    bo.allow_dataset_oversubscription = true;
    const auto buckets = data::build_dataset_buckets(d, bo, pool);
    std::map<std::string, std::vector<data::LatentRequest>> requests;
    std::map<std::string, int> shapes;  // "WxH" → images
    for (const auto& [key, paths] : buckets.index.buckets)
        for (const auto& p : paths) {
            const auto& plan = buckets.index.metadata.at(p);
            requests[key].push_back({p, plan, false});
            ++shapes[std::to_string(plan.target.width) + "x" + std::to_string(plan.target.height)];
        }
    const double scan_s = std::chrono::duration<double>(Clock::now() - t_scan).count();

    // Full-size VAE, random weights.
    const stdfs::path cfg = stdfs::exists(a.model / "vae" / "config.json") ? a.model / "vae" / "config.json"
                                                                           : a.model / "config.json";
    const auto config = models::AutoencoderKLConfig::from_json(models::ConfigReader::from_file(cfg));
    torch::manual_seed(0);
    models::AutoencoderKL vae(config);
    const auto dtype = a.dtype == "bf16" ? at::kBFloat16 : at::kFloat;
    vae->to(device, dtype);
    vae->eval();
    const data::LatentEncodeFn encode =
        family::make_vae_encode_fn(vae.ptr(), device, dtype, {.channels_last = cl});

    // Warm-up: every batch shape the build will see (full and each bucket's last, short batch), so
    // algorithm choice and allocator growth are not timed, as the baseline warms up.
    for (const auto& [shape, n] : shapes) {
        const auto x = shape.find('x');
        const int64_t w = std::stoll(shape.substr(0, x)), h = std::stoll(shape.substr(x + 1));
        std::set<int64_t> sizes = {std::min<int64_t>(n, a.batch)};
        if (n % a.batch) sizes.insert(n % a.batch);
        for (int64_t b : sizes)
            (void)encode(at::rand({b, 3, h, w}) * 2 - 1, std::vector<uint64_t>(size_t(b)));
    }
    const double encode_only = encode_only_rate(*vae, a, device, dtype, cl);
    if (!a.profile_dir.empty() && device.is_cuda()) profile_encoder(*vae, a, dtype, cl);
    synchronize(device);
    TimedEncoder pipeline_timer(encode, device);

    stdfs::remove_all(d.cache_dir_vae);
    data::LatentCache cache(data::latent_cache_settings(d, "bench random AutoencoderKL " + a.dtype));
    data::CacheBuildOptions opt;
    opt.batch_size = a.batch;
    const auto t0 = Clock::now();
    const auto report = data::build_latent_cache(cache, requests, pipeline_timer.fn(), opt, pool);
    synchronize(device);
    const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
    const int64_t built = report.built + report.rebuilt_stale + report.rebuilt_corrupt;

    double peak_gpu = 0;
    if (device.is_cuda())
        peak_gpu =
            double(at::accelerator::getDeviceStats(device.index()).allocated_bytes[0].peak) / (1 << 30);
    nlohmann::json out = {{"bench", "vae_cache"},
                          {"variant", a.variant},
                          {"device", a.device},
                          {"dtype", a.dtype},
                          {"batch", a.batch},
                          {"res", a.res},
                          {"threads", pool.size()},
                          {"images", report.total},
                          {"built", built},
                          {"skipped", report.skipped},
                          {"encoder_calls", report.encoder_calls},
                          {"shapes", shapes},
                          {"bucketing_s", scan_s},
                          {"wall_s", wall},
                          {"img_per_s", double(built) / wall},
                          {"encoder_busy", pipeline_timer.busy_s() / wall},
                          {"encode_only_img_per_s", encode_only},
                          {"stages_s",
                           {{"decode_all_threads", report.stages.decode},
                            {"write_all_threads", report.stages.write},
                            {"main_wait_decode", report.stages.wait_decode},
                            {"main_encode_call", report.stages.encode_call},
                            {"main_wait_device", report.stages.wait_device}}},
                          {"peak_gpu_gib", peak_gpu},
                          {"peak_rss_gib", peak_rss_gib()}};
    std::cout << out.dump() << std::endl;
    return report.skipped == 0 && built == report.total ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        return run(parse_args(argc, argv));
    } catch (const std::exception& e) {
        std::cerr << "bench_vae_cache: " << e.what() << "\n";
        return 1;
    }
}

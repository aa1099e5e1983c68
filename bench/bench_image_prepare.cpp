// Decode + Lanczos resize + crop throughput on 4000×3000 JPEGs at SDXL's default bucketing
// (pixel_area 1024, crop off), the work the VAE cache builder does per image. Generates the files
// once (--dir), then times T threads and prints JSON. bench/pillow_prepare.py times Pillow on the
// same files with the same geometry, for the ratio.
// Usage: bench_image_prepare [--files N] [--threads T] [--dir PATH] [--fast 0|1]
//   --fast 1 lets libjpeg decode at 1/2 scale when that still leaves ≥ the resize size.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <thread>

#include "core/fs.h"
#include "core/thread_pool.h"
#include "data/buckets.h"
#include "io/image.h"

namespace {

std::string arg(int argc, char** argv, const std::string& name, const std::string& fallback) {
    for (int i = 1; i + 1 < argc; ++i)
        if (argv[i] == name) return argv[i + 1];
    return fallback;
}

// Smooth colour fields plus noise: compresses like a photo (≈2–4 MB at quality 90).
dtune::io::RgbImage photo_like(int w, int h, uint32_t seed) {
    dtune::io::RgbImage im(w, h);
    std::mt19937 rng(seed);
    for (int y = 0; y < h; ++y)
        for (int x = 0; x < w; ++x) {
            uint8_t* p = im.at(x, y);
            const int n = static_cast<int>(rng() % 24);
            p[0] = static_cast<uint8_t>((x * 255 / w + n) & 0xFF);
            p[1] = static_cast<uint8_t>((y * 255 / h + n) & 0xFF);
            p[2] = static_cast<uint8_t>(((x + y + static_cast<int>(seed) * 40) % 256 + n) & 0xFF);
        }
    return im;
}

}  // namespace

int main(int argc, char** argv) {
    namespace stdfs = std::filesystem;
    using namespace dtune;
    const int files = std::stoi(arg(argc, argv, "--files", "1000"));
    const int threads =
        std::stoi(arg(argc, argv, "--threads", std::to_string(std::thread::hardware_concurrency())));
    const bool fast = arg(argc, argv, "--fast", "0") == "1";
    const stdfs::path dir =
        arg(argc, argv, "--dir", (stdfs::temp_directory_path() / "dtune_bench_prepare").string());
    stdfs::create_directories(dir);
    std::vector<std::string> paths;
    std::string blob;
    for (int i = 0; i < files; ++i) {
        const stdfs::path p = dir / ("photo_" + std::to_string(i) + ".jpg");
        if (!stdfs::exists(p)) {
            if (blob.empty() || i < 8)
                blob = io::encode_jpeg(photo_like(4000, 3000, static_cast<uint32_t>(i)), 90);
            fs::write_file_atomic(p, blob);
        }
        paths.push_back(p.string());
    }
    data::BucketSettings settings;  // SDXL defaults: area 1.048576 MP, crop off
    std::mt19937_64 rng(0);
    const data::SamplePlan plan = data::plan_sample(settings, {4000, 3000}, rng);
    io::DecodeOptions options;
    if (fast) {
        options.min_width = plan.resize_size.width;
        options.min_height = plan.resize_size.height;
        options.scale_margin = 1.0;
    }
    ThreadPool pool(static_cast<size_t>(threads));
    std::atomic<int64_t> checksum{0};
    auto run = [&] {
        pool.parallel_for(paths.size(), [&](size_t i) {
            io::RgbImage im = io::read_image(paths[i], options);
            im = io::resize_lanczos(im, plan.resize_size.width, plan.resize_size.height);
            im = io::crop(im, plan.crop_top, plan.crop_left, plan.target.width, plan.target.height);
            checksum += im.pixels[im.pixels.size() / 2];
        });
    };
    run();  // warm the page cache and the allocator
    const auto t0 = std::chrono::steady_clock::now();
    run();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf(
        "{\"bench\": \"image_prepare\", \"impl\": \"dtune%s\", \"files\": %d, \"threads\": %d, \"resize\": "
        "[%d, %d], "
        "\"target\": [%d, %d], \"crop_top_left\": [%d, %d], \"seconds\": %.3f, \"images_per_s\": %.2f, "
        "\"images_per_s_per_core\": %.2f}\n",
        fast ? "-dct" : "", files, threads, plan.resize_size.width, plan.resize_size.height,
        plan.target.width, plan.target.height, plan.crop_top, plan.crop_left, s, files / s,
        files / s / threads);
    return checksum.load() >= 0 ? 0 : 1;
}

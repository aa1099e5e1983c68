// Header-scan throughput: generates N JPEG/PNG files (varied sizes, some with EXIF), warms the
// page cache with one scan, then times scans on the thread pool and prints JSON:
//   {"bench": "image_header_scan", "files": 10000, "threads": 16, "files_per_s": ..., ...}
// Usage: bench_image_scan [--files N] [--threads T] [--dir PATH] [--repeat R]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>

#include "core/fs.h"
#include "core/thread_pool.h"
#include "data/bucket_index.h"
#include "io/image.h"

namespace {

std::string arg(int argc, char** argv, const std::string& name, const std::string& fallback) {
    for (int i = 1; i + 1 < argc; ++i)
        if (argv[i] == name) return argv[i + 1];
    return fallback;
}

}  // namespace

int main(int argc, char** argv) {
    namespace stdfs = std::filesystem;
    const int files = std::stoi(arg(argc, argv, "--files", "10000"));
    const int threads =
        std::stoi(arg(argc, argv, "--threads", std::to_string(std::thread::hardware_concurrency())));
    const int repeat = std::stoi(arg(argc, argv, "--repeat", "3"));
    const stdfs::path dir =
        arg(argc, argv, "--dir", (stdfs::temp_directory_path() / "dtune_bench_scan").string());
    stdfs::create_directories(dir);
    // 64 distinct encoded images, copied round-robin: realistic headers, cheap to generate.
    std::vector<std::string> blobs;
    for (int k = 0; k < 64; ++k) {
        dtune::io::RgbImage im(48 + k, 32 + 2 * k);
        for (size_t i = 0; i < im.pixels.size(); ++i) im.pixels[i] = static_cast<uint8_t>(i * (k + 1));
        blobs.push_back(k % 2 ? dtune::io::encode_png(im) : dtune::io::encode_jpeg(im, 85, 1 + k % 8));
    }
    std::vector<std::string> paths;
    for (int i = 0; i < files; ++i) {
        const stdfs::path p = dir / (std::to_string(i) + (i % 2 ? ".png" : ".jpg"));
        if (!stdfs::exists(p)) {
            std::FILE* f = std::fopen(p.c_str(), "wb");
            std::fwrite(blobs[i % 64].data(), 1, blobs[i % 64].size(), f);
            std::fclose(f);
        }
        paths.push_back(p.string());
    }
    dtune::ThreadPool pool(static_cast<size_t>(threads));
    dtune::data::scan_image_headers(paths, pool, false);  // warm the page cache
    double best = 1e30;
    size_t ok = 0;
    for (int r = 0; r < repeat; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        const auto scan = dtune::data::scan_image_headers(paths, pool, false);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::min(best, s);
        ok = scan.images.size();
    }
    std::printf(
        "{\"bench\": \"image_header_scan\", \"files\": %d, \"ok\": %zu, \"threads\": %d, \"best_s\": %.4f, "
        "\"files_per_s\": %.0f}\n",
        files, ok, threads, best, files / best);
    return ok == static_cast<size_t>(files) ? 0 : 1;
}

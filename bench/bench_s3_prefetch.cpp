// Read-ahead of a `type: aws` dataset: uploads N PNG images (512×512 by default) and measures,
// one JSON line each: decoding alone (bytes already in memory), then fetch + decode through the
// ObjectPrefetcher the latent-cache builder uses, at read-ahead depths 1 (one GET at a time, on
// its own thread), 4, 16 and 32. vs_decode_only near 1 means the decoder did not wait on the
// network (it can exceed 1 on a noisy machine: the decode-only pass is timed once).
// Usage: bench_s3_prefetch <endpoint> [bucket] [images] [edge]
//   credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; bench/run_s3_bench.sh runs it.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "data/prefetch.h"
#include "data/s3_storage.h"
#include "io/image.h"

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
    using namespace dtune;
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s <endpoint> [bucket] [images] [edge]\n", argv[0]);
        return 2;
    }
    io::S3Config config;
    config.endpoint = argv[1];
    config.bucket = argc > 2 ? argv[2] : "dtune-bench";
    const int images = argc > 3 ? std::atoi(argv[3]) : 200;
    const int edge = argc > 4 ? std::atoi(argv[4]) : 512;
    try {
        config.max_connections = 32;
        io::S3Client uploader(config);
        uploader.create_bucket();
        std::mt19937 rng(1);
        std::vector<std::pair<std::string, std::string>> objects;
        std::vector<std::string> keys;
        for (int i = 0; i < images; ++i) {
            io::RgbImage img(edge, edge);
            for (size_t p = 0; p < img.pixels.size(); ++p)  // smooth with noise: a photo-like PNG size
                img.pixels[p] = static_cast<uint8_t>((p / 3 % edge + p / 3 / edge) / 4 + rng() % 16);
            keys.push_back("prefetch/" + std::to_string(i) + ".png");
            objects.emplace_back(keys.back(), io::encode_png(img));
        }
        uploader.put_many(objects);
        double mb = 0;
        for (const auto& [k, bytes] : objects) mb += double(bytes.size()) / 1e6;

        auto start = std::chrono::steady_clock::now();
        for (const auto& [k, bytes] : objects) io::decode_image(bytes, k);
        const double decode_s = seconds_since(start);
        std::printf("{\"mode\": \"decode only\", \"images\": %d, \"MB\": %.1f, \"img_per_s\": %.1f}\n",
                    images, mb, images / decode_s);
        double depth1_rate = 0;
        for (int depth : {1, 4, 16, 32}) {
            data::S3Storage storage(config, "", depth);
            start = std::chrono::steady_clock::now();
            data::ObjectPrefetcher ahead(
                keys, [&](const std::string& k) { return storage.read(k); }, storage.max_parallel_reads());
            for (size_t i = 0; i < keys.size(); ++i) io::decode_image(ahead.take(i), keys[i]);
            const double s = seconds_since(start);
            if (depth == 1) depth1_rate = images / s;
            std::printf(
                "{\"mode\": \"fetch + decode\", \"depth\": %d, \"img_per_s\": %.1f, \"MB_per_s\": %.1f, "
                "\"vs_depth_1\": %.2f, \"vs_decode_only\": %.2f}\n",
                depth, images / s, mb / s, images / s / depth1_rate, decode_s / s);
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_s3_prefetch: %s\n", e.what());
        return 1;
    }
    return 0;
}

// Parallel GET throughput of the S3 client: uploads N objects of ~200 KB to a bucket, then reads
// them all back at 1, 8 and 32 concurrent requests and prints one JSON object per level.
// Usage: bench_s3_get <endpoint> [bucket] [objects] [object_kb]
//   credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or ~/.aws/credentials);
//   bench/run_s3_bench.sh starts a local SeaweedFS and runs this against it.
#include "io/s3.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s <endpoint> [bucket] [objects] [object_kb]\n", argv[0]);
        return 2;
    }
    dtune::io::S3Config config;
    config.endpoint = argv[1];
    config.bucket = argc > 2 ? argv[2] : "dtune-bench";
    const int objects = argc > 3 ? std::atoi(argv[3]) : 1000;
    const std::size_t object_bytes = (argc > 4 ? std::strtoul(argv[4], nullptr, 10) : 200) * 1024;
    try {
        config.max_connections = 32;
        dtune::io::S3Client uploader(config);
        uploader.create_bucket();
        std::mt19937_64 rng(1);
        std::vector<std::pair<std::string, std::string>> data;
        std::vector<std::string> keys;
        for (int i = 0; i < objects; ++i) {
            std::string bytes(object_bytes, '\0');
            for (auto& c : bytes) c = static_cast<char>(rng());
            keys.push_back("bench/" + std::to_string(i) + ".bin");
            data.emplace_back(keys.back(), std::move(bytes));
        }
        uploader.put_many(data);
        for (int concurrency : {1, 8, 32}) {
            config.max_connections = concurrency;
            dtune::io::S3Client client(config);
            client.get(keys[0]);  // connect outside the timed region
            const auto t0 = std::chrono::steady_clock::now();
            const auto got = client.get_many(keys);
            const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            std::size_t bytes = 0;
            for (std::size_t i = 0; i < got.size(); ++i) {
                if (got[i] != data[i].second) {
                    std::fprintf(stderr, "object %s came back different\n", keys[i].c_str());
                    return 1;
                }
                bytes += got[i].size();
            }
            std::printf(
                "{\"bench\": \"s3_get\", \"concurrency\": %d, \"objects\": %d, \"object_kb\": %zu, "
                "\"seconds\": %.3f, "
                "\"objects_per_s\": %.1f, \"mb_per_s\": %.1f, \"retries\": %llu}\n",
                concurrency, objects, object_bytes / 1024, s, objects / s, bytes / s / 1e6,
                static_cast<unsigned long long>(client.retries()));
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_s3_get: %s\n", e.what());
        return 1;
    }
    return 0;
}

// Latent and text-embedding caches: build, reuse, invalidation, corruption recovery, compression,
// skipped images, rank shares and the LatentSource modes. The encoders are small real
// computations (8×8 average pool + a fixed channel mix; byte statistics of the caption), and every
// expected latent is recomputed independently from the decoded image.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <fstream>
#include <set>

#include "core/error.h"
#include "core/fs.h"
#include "core/thread_pool.h"
#include "data/cache_builder.h"
#include "io/image.h"
#include "io/image_tensor.h"
#include "support/test_support.h"

namespace dtune::data {
namespace test_caches_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

// images [B, 3, H, W] → [B, 4, H/8, W/8]: average pool, then a fixed 4×3 mix plus bias.
at::Tensor tiny_vae(const at::Tensor& images) {
    const at::Tensor pooled = at::avg_pool2d(images, {8, 8});  // [B, 3, h, w]
    const at::Tensor mix =
        at::tensor({0.5f, -0.25f, 1.0f, 0.1f, 0.2f, 0.3f, -1.0f, 0.0f, 0.5f, 0.3f, 0.3f, 0.3f})
            .reshape({4, 3});
    const at::Tensor bias = at::tensor({0.01f, -0.02f, 0.03f, 0.0f}).reshape({1, 4, 1, 1});
    return at::einsum("oc,bchw->bohw", {mix, pooled}) + bias;
}

struct CountingEncoder {
    std::atomic<int> calls{0}, images{0};
    LatentEncodeFn fn() {
        return [this](const at::Tensor& x, const std::vector<uint64_t>&) {
            ++calls;
            images += static_cast<int>(x.size(0));
            return tiny_vae(x);
        };
    }
};

// Caption → prompt_embeds [4, 3] from its bytes and pooled [2] = (length, byte sum / 1000).
TextEmbeds tiny_text(const std::vector<std::string>& captions) {
    auto prompt = at::zeros({static_cast<int64_t>(captions.size()), 4, 3});
    auto pooled = at::zeros({static_cast<int64_t>(captions.size()), 2});
    for (size_t b = 0; b < captions.size(); ++b) {
        double sum = 0;
        for (size_t i = 0; i < captions[b].size(); ++i) {
            const double v = static_cast<unsigned char>(captions[b][i]);
            sum += v;
            if (i < 12) prompt[long(b)][long(i / 3)][long(i % 3)] = v / 255.0;
        }
        pooled[long(b)][0] = static_cast<double>(captions[b].size());
        pooled[long(b)][1] = sum / 1000.0;
    }
    return {{"prompt_embeds", prompt}, {"pooled_prompt_embeds", pooled}};
}

// A dozen small images (PNG and JPEG, two folders, different sizes and aspects).
class CacheTest : public ::testing::Test {
  protected:
    void SetUp() override {
        data_ = dir_ / "data";
        cache_dir_ = (dir_ / "cache").string();
        const std::vector<std::pair<int, int>> sizes = {{48, 32}, {32, 48}, {40, 40}, {64, 32},
                                                        {32, 32}, {56, 40}, {40, 56}, {48, 48},
                                                        {72, 40}, {36, 44}, {44, 36}, {50, 34}};
        for (size_t i = 0; i < sizes.size(); ++i) {
            io::RgbImage img(sizes[i].first, sizes[i].second);
            for (int y = 0; y < img.height; ++y)
                for (int x = 0; x < img.width; ++x) {
                    uint8_t* p = img.at(x, y);
                    p[0] = uint8_t((x * 7 + int(i) * 20) % 256);
                    p[1] = uint8_t((y * 5 + int(i) * 3) % 256);
                    p[2] = uint8_t(((x ^ y) * 11) % 256);
                }
            const auto sub = data_ / (i % 2 ? "a" : "b");
            std::filesystem::create_directories(sub);
            const auto path = sub / ("img" + std::to_string(i) + (i % 3 ? ".png" : ".jpg"));
            io::write_image(path, img, 95);
            paths_.push_back(path.string());
            originals_.push_back({sizes[i].first, sizes[i].second});
        }
    }

    // Square 32×32 crops: the short side resized to 32, centred (or shifted by `shift`).
    std::map<std::string, std::vector<LatentRequest>> requests(int shift_every = 0) const {
        std::map<std::string, std::vector<LatentRequest>> buckets;
        for (size_t i = 0; i < paths_.size(); ++i) {
            const Size o = originals_[i];
            const double s = 32.0 / std::min(o.width, o.height);
            LatentRequest r;
            r.path = paths_[i];
            r.plan.original = o;
            r.plan.intermediary =
                r.plan.resize_size = {int(std::lround(o.width * s)), int(std::lround(o.height * s))};
            r.plan.target = {32, 32};
            r.plan.crop_left = (r.plan.resize_size.width - 32) / 2;
            r.plan.crop_top = (r.plan.resize_size.height - 32) / 2;
            if (shift_every && i % size_t(shift_every) == 0) r.plan.crop_left = r.plan.crop_top = 0;
            buckets["1.0"].push_back(r);
        }
        return buckets;
    }

    LatentCacheSettings settings(CacheCompression c = CacheCompression::kZstd,
                                 const std::string& res = "32") const {
        LatentCacheSettings s;
        s.cache_dir = cache_dir_;
        s.data_root = data_.string();
        s.encoder_identity = "tiny_vae v1";
        s.dataset_settings = "resolution=" + res + "\nresolution_type=pixel\ncrop=true\n";
        s.compression = c;
        return s;
    }

    test::TempDir dir_;
    std::filesystem::path data_;
    std::string cache_dir_;
    std::vector<std::string> paths_;
    std::vector<Size> originals_;
    ThreadPool pool_{2};
};

TEST(CacheCodec, Sha256KnownVectors) {
    EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
              "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    EXPECT_EQ(sha256_hex(std::string(1000000, 'a')),
              "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(CacheCodec, RoundTripsAndDetectsDamage) {
    std::string raw;
    for (int i = 0; i < 5000; ++i) raw += char(i % 251);
    for (auto c : {CacheCompression::kNone, CacheCompression::kZstd, CacheCompression::kGzip}) {
        const std::string packed = compress_cache_bytes(raw, c);
        EXPECT_EQ(detect_compression(packed), c);
        EXPECT_EQ(decompress_cache_bytes(packed, "x"), raw);
        if (c != CacheCompression::kNone) {
            EXPECT_THROW(decompress_cache_bytes(packed.substr(0, packed.size() / 2), "x"), DataError);
        }
    }
    EXPECT_EQ(crc32_of("123456789"), 0xCBF43926u);  // the CRC-32 check value
}

TEST_F(CacheTest, BuildReuseAndInvalidateExactlyTheAffectedEntries) {
    CountingEncoder enc;
    LatentCache cache(settings());
    CacheBuildOptions opt;
    opt.batch_size = 5;
    auto report = build_latent_cache(cache, requests(), enc.fn(), opt, pool_);
    EXPECT_EQ(report.total, 12);
    EXPECT_EQ(report.built, 12);
    EXPECT_EQ(report.skipped, 0);
    EXPECT_EQ(enc.calls, 3);  // 5 + 5 + 2, one shape
    EXPECT_EQ(enc.images, 12);
    // Each entry equals the encoder applied to the independently prepared image.
    const auto all = requests();
    for (const auto& r : all.at("1.0")) {
        const auto found = cache.load(r);
        ASSERT_EQ(found.status, EntryStatus::kValid) << found.reason;
        const auto pixels =
            io::prepare_image_tensor(r.path, {r.plan.resize_size.width, r.plan.resize_size.height,
                                              r.plan.crop_top, r.plan.crop_left, 32, 32, false});
        EXPECT_TRUE(at::allclose(found.value, tiny_vae(pixels.unsqueeze(0))[0], 1e-6, 1e-6)) << r.path;
        // Subfolders of the data are mirrored; the name is sha256 of the stem.
        const auto rel = std::filesystem::path(r.path).lexically_relative(data_);
        EXPECT_EQ(cache.entry_path(r.path),
                  std::filesystem::path(cache_dir_) / rel.parent_path() /
                      (sha256_hex(std::filesystem::path(r.path).stem().string()) + ".safetensors"));
    }
    // Reuse: nothing is encoded again.
    report = build_latent_cache(cache, requests(), enc.fn(), opt, pool_);
    EXPECT_EQ(report.reused, 12);
    EXPECT_EQ(enc.calls, 3);
    // A changed crop for images 0, 4, 8 (those whose centred crop is not at 0,0) rebuilds exactly them.
    int moved = 0;
    for (const auto& [a, b] : {std::pair{requests().at("1.0"), requests(4).at("1.0")}})
        for (size_t i = 0; i < a.size(); ++i)
            moved += (a[i].plan.crop_left != b[i].plan.crop_left || a[i].plan.crop_top != b[i].plan.crop_top);
    ASSERT_GT(moved, 0);
    report = build_latent_cache(cache, requests(4), enc.fn(), opt, pool_);
    EXPECT_EQ(report.rebuilt_stale, moved);
    EXPECT_EQ(report.reused, 12 - moved);
    EXPECT_EQ(enc.images, 12 + moved);
    // A changed resolution setting invalidates every entry.
    LatentCache other(settings(CacheCompression::kZstd, "40"));
    report = build_latent_cache(other, requests(4), enc.fn(), opt, pool_);
    EXPECT_EQ(report.rebuilt_stale, 12);
    // Touching an image (new mtime/size) invalidates just that one.
    io::write_image(paths_[1], io::RgbImage(32, 48), 95);
    report = build_latent_cache(other, requests(4), enc.fn(), opt, pool_);
    EXPECT_EQ(report.rebuilt_stale, 1);
    EXPECT_EQ(report.reused, 11);
}

// An entry built with the old crop geometry (the image stretched to cover the crop) is not trusted
// once the plan resizes keeping the aspect: same path, target and offsets, another resize size.
TEST_F(CacheTest, AnEntryOfAnotherResizeSizeIsRebuilt) {
    CountingEncoder enc;
    LatentCache cache(settings());
    CacheBuildOptions opt;
    std::map<std::string, std::vector<LatentRequest>> old_plan = requests();
    LatentRequest& wide = old_plan.at("1.0")[3];  // 64x32
    ASSERT_EQ(wide.plan.original, (Size{64, 32}));
    wide.plan.intermediary = wide.plan.resize_size = {32, 32};  // stretched to the square
    wide.plan.crop_left = wide.plan.crop_top = 0;
    build_latent_cache(cache, old_plan, enc.fn(), opt, pool_);
    LatentRequest kept = wide;
    kept.plan.intermediary = kept.plan.resize_size = {64, 32};  // the aspect kept
    EXPECT_EQ(cache.load(kept).status, EntryStatus::kStale);
    EXPECT_EQ(cache.load(wide).status, EntryStatus::kValid);
}

TEST_F(CacheTest, TruncatedAndBitFlippedEntriesAreRebuilt) {
    CountingEncoder enc;
    LatentCache cache(settings(CacheCompression::kNone));
    build_latent_cache(cache, requests(), enc.fn(), {}, pool_);
    const auto reqs = requests().at("1.0");
    const auto p0 = cache.entry_path(reqs[0].path), p1 = cache.entry_path(reqs[1].path),
               p2 = cache.entry_path(reqs[2].path), p3 = cache.entry_path(reqs[3].path);
    std::string b0 = fs::read_file(p0), b1 = fs::read_file(p1), b2 = fs::read_file(p2);
    test::write_bytes(p0, b0.substr(0, b0.size() - 10));  // truncated data
    b1[b1.size() - 3] ^= 0x40;                            // a flipped bit in the latents
    test::write_bytes(p1, b1);
    const auto at = b2.find("\"crop_coords\":\"");  // a changed metadata value, same length
    ASSERT_NE(at, std::string::npos);
    b2[at + 15] = b2[at + 15] == '9' ? '8' : '9';
    test::write_bytes(p2, b2);
    test::write_bytes(p3, std::string(fs::read_file(p3)).substr(0, 5));  // a torn header
    for (const auto& r : {reqs[0], reqs[1], reqs[2], reqs[3]})
        EXPECT_EQ(cache.load(r).status, EntryStatus::kCorrupt);
    const auto report = build_latent_cache(cache, requests(), enc.fn(), {}, pool_);
    EXPECT_EQ(report.rebuilt_corrupt, 4);
    EXPECT_EQ(report.reused, 8);
    for (const auto& r : reqs) EXPECT_EQ(cache.load(r).status, EntryStatus::kValid);
}

TEST_F(CacheTest, CompressedAndUncompressedEntriesAreReadByAnySetting) {
    CountingEncoder enc;
    for (auto written : {CacheCompression::kNone, CacheCompression::kZstd, CacheCompression::kGzip}) {
        std::filesystem::remove_all(cache_dir_);
        build_latent_cache(LatentCache(settings(written)), requests(), enc.fn(), {}, pool_);
        const auto path = LatentCache(settings()).entry_path(paths_[0]);
        EXPECT_EQ(detect_compression(fs::read_file(path)), written);
        for (auto reader : {CacheCompression::kNone, CacheCompression::kZstd, CacheCompression::kGzip}) {
            const auto report =
                build_latent_cache(LatentCache(settings(reader)), requests(), enc.fn(), {}, pool_);
            EXPECT_EQ(report.reused, 12) << to_string(written) << " read with " << to_string(reader);
        }
    }
    EXPECT_EQ(enc.images, 36);
}

TEST_F(CacheTest, CorruptImagesAreSkippedAndListed) {
    const auto bad = data_ / "a" / "broken.jpg";
    test::write_bytes(bad, std::string("\xff\xd8\xff\xe0 not really a jpeg", 24));
    auto buckets = requests();
    LatentRequest r = buckets["1.0"][0];
    r.path = bad.string();
    buckets["1.0"].push_back(r);
    CountingEncoder enc;
    CacheBuildOptions opt;
    opt.report_path = (dir_ / "out" / "vae_cache_skipped.json").string();
    const auto report = build_latent_cache(LatentCache(settings()), buckets, enc.fn(), opt, pool_);
    EXPECT_EQ(report.total, 13);
    EXPECT_EQ(report.built, 12);
    EXPECT_EQ(report.skipped, 1);
    EXPECT_EQ(enc.images, 12);
    const auto listed = nlohmann::json::parse(fs::read_file(opt.report_path));
    ASSERT_EQ(listed.size(), 1u);
    EXPECT_TRUE(listed.contains(bad.string()));
}

TEST_F(CacheTest, RankSharesAreDisjointAndCoverEverything) {
    CountingEncoder enc;
    std::set<std::string> seen;
    int64_t total = 0;
    for (int rank = 0; rank < 5; ++rank) {
        for (const auto& [key, reqs] : shard_requests(requests(), 5, rank))
            for (const auto& r : reqs) EXPECT_TRUE(seen.insert(r.path).second) << r.path << " in two shares";
        CacheBuildOptions opt;
        opt.world_size = 5;
        opt.rank = rank;
        total += build_latent_cache(LatentCache(settings()), requests(), enc.fn(), opt, pool_).built;
    }
    EXPECT_EQ(seen.size(), 12u);
    EXPECT_EQ(total, 12);
    EXPECT_EQ(build_latent_cache(LatentCache(settings()), requests(), enc.fn(), {}, pool_).reused, 12);
}

// Two target shapes (32×32 for even images, 48×32 for odd ones), one bucket each.
std::map<std::string, std::vector<LatentRequest>> two_shapes(const std::vector<LatentRequest>& square) {
    std::map<std::string, std::vector<LatentRequest>> out;
    for (size_t i = 0; i < square.size(); ++i) {
        LatentRequest r = square[i];
        if (i % 2) {
            const Size o = r.plan.original;
            const double s = std::max(48.0 / o.width, 32.0 / o.height);
            r.plan.resize_size = {int(std::ceil(o.width * s)), int(std::ceil(o.height * s))};
            r.plan.target = {48, 32};
            r.plan.crop_left = (r.plan.resize_size.width - 48) / 2;
            r.plan.crop_top = (r.plan.resize_size.height - 32) / 2;
        }
        out[i % 2 ? "1.5" : "1.0"].push_back(r);
    }
    return out;
}

// The pipeline's depth, thread count and host-memory kind must not change a single byte of the
// cache, and each entry must be what the encoder gives for its batch: consecutive images of one
// target shape in path order, batch_size at a time. The encoder depends on the whole batch (a
// batch mean is added), so any other batch composition would show.
TEST_F(CacheTest, EntriesDependOnlyOnInputsNotOnThePipeline) {
    const LatentEncodeFn batch_dependent = [](const at::Tensor& x, const std::vector<uint64_t>&) {
        return tiny_vae(x) + 0.01 * x.mean();
    };
    const auto buckets = two_shapes(requests().at("1.0"));
    std::vector<std::map<std::string, std::string>> bytes;  // entry file -> contents, per run
    for (const auto& [threads, prefetch] : {std::pair{1, 1}, std::pair{4, 5}}) {
        ThreadPool pool(static_cast<size_t>(threads));
        LatentCacheSettings s = settings(CacheCompression::kNone);
        s.cache_dir = (dir_ / ("cache" + std::to_string(threads))).string();
        CacheBuildOptions opt;
        opt.batch_size = 4;
        opt.prefetch_batches = prefetch;
        opt.pin_memory = false;
        const auto report = build_latent_cache(LatentCache(s), buckets, batch_dependent, opt, pool);
        EXPECT_EQ(report.built, 12);
        EXPECT_EQ(report.encoder_calls, 4);  // 6 per shape: 4 + 2, twice
        auto& files = bytes.emplace_back();
        for (const auto& e : std::filesystem::recursive_directory_iterator(s.cache_dir))
            if (e.is_regular_file())
                files[e.path().lexically_relative(s.cache_dir).string()] = fs::read_file(e.path());
    }
    ASSERT_EQ(bytes[0].size(), 12u);
    EXPECT_TRUE(bytes[0] == bytes[1]) << "cache files differ between pipeline settings";

    LatentCacheSettings s = settings(CacheCompression::kNone);
    s.cache_dir = (dir_ / "cache1").string();
    const LatentCache cache(s);
    for (const auto& [key, reqs] : buckets) {
        auto sorted = reqs;
        std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.path < b.path; });
        for (size_t b = 0; b < sorted.size(); b += 4) {
            std::vector<at::Tensor> images;
            for (size_t i = b; i < std::min(sorted.size(), b + 4); ++i) {
                const auto& p = sorted[i].plan;
                images.push_back(io::prepare_image_tensor(
                    sorted[i].path, {p.resize_size.width, p.resize_size.height, p.crop_top, p.crop_left,
                                     p.target.width, p.target.height, false}));
            }
            const at::Tensor want =
                batch_dependent(at::stack(images), std::vector<uint64_t>(images.size()));  // [n, 4, h, w]
            for (size_t i = b; i < std::min(sorted.size(), b + 4); ++i) {
                const auto found = cache.load(sorted[i]);
                ASSERT_EQ(found.status, EntryStatus::kValid) << found.reason;
                EXPECT_TRUE(at::equal(found.value, want[long(i - b)])) << sorted[i].path;
            }
        }
    }
}

// An encoder on the GPU returns device tensors without waiting; the builder reads them back after
// queuing the next batch. The entries must equal the same encoder's on the CPU.
TEST_F(CacheTest, DeviceEncoderWithPinnedAsynchronousCopies) {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    const auto buckets = two_shapes(requests().at("1.0"));
    // Average pool to [B, 3, h, w] plus the channel mean as a 4th channel, in float64 on either device.
    const auto pool4 = [](const at::Tensor& x) {
        const at::Tensor pooled = at::avg_pool2d(x.to(at::kDouble), {8, 8});  // [B, 3, h, w]
        return at::cat({pooled, pooled.mean(1, true)}, 1);                    // [B, 4, h, w]
    };
    const LatentEncodeFn on_gpu = [&](const at::Tensor& x, const std::vector<uint64_t>&) {
        EXPECT_TRUE(x.is_pinned());
        return pool4(x.to(at::kCUDA, /*non_blocking=*/true));  // stays on the device
    };
    const LatentEncodeFn on_cpu = [&](const at::Tensor& x, const std::vector<uint64_t>&) { return pool4(x); };
    LatentCacheSettings gpu_settings = settings(CacheCompression::kNone);
    gpu_settings.cache_dir = (dir_ / "gpu").string();
    CacheBuildOptions opt;
    opt.batch_size = 4;
    build_latent_cache(LatentCache(gpu_settings), buckets, on_gpu, opt, pool_);
    opt.pin_memory = false;
    build_latent_cache(LatentCache(settings(CacheCompression::kNone)), buckets, on_cpu, opt, pool_);
    const LatentCache gpu(gpu_settings), cpu(settings(CacheCompression::kNone));
    for (const auto& [key, reqs] : buckets)
        for (const auto& r : reqs) {
            const auto a = gpu.load(r), b = cpu.load(r);
            ASSERT_EQ(a.status, EntryStatus::kValid) << a.reason;
            EXPECT_TRUE(at::allclose(a.value, b.value, 1e-9, 1e-9)) << r.path;
        }
}

TEST_F(CacheTest, LatentSourceModes) {
    CountingEncoder enc;
    LatentCache cache(settings());
    const auto batch = requests().at("1.0");
    const std::vector<LatentRequest> four(batch.begin(), batch.begin() + 4);
    auto ondemand = make_latent_source(LatentMode::kCache, &cache, enc.fn(), pool_);
    const at::Tensor first = ondemand->get(four);  // [4, 4, 4, 4]
    EXPECT_EQ(first.sizes().vec(), (std::vector<int64_t>{4, 4, 4, 4}));
    EXPECT_EQ(ondemand->encoded(), 4);
    EXPECT_TRUE(at::allclose(ondemand->get(four), first));  // now from the cache
    EXPECT_EQ(ondemand->encoded(), 4);
    EXPECT_EQ(cache.load(batch[0]).status, EntryStatus::kValid);

    LatentCache unused(settings());
    auto disabled = make_latent_source(LatentMode::kEncodeOnly, nullptr, enc.fn(), pool_);
    std::filesystem::remove_all(cache_dir_);
    EXPECT_TRUE(at::allclose(disabled->get(four), first));
    disabled->get(four);
    EXPECT_EQ(disabled->encoded(), 8);
    EXPECT_FALSE(std::filesystem::exists(cache_dir_));
}

TEST_F(CacheTest, TextEmbeddingCache) {
    TextCacheSettings ts;
    ts.cache_dir = (dir_ / "text").string();
    ts.encoder_identity = "tiny_text v1";
    TextEmbedCache cache(ts);
    std::atomic<int> encoded{0};
    TextEncodeFn fn = [&](const std::vector<std::string>& c) {
        encoded += int(c.size());
        return tiny_text(c);
    };
    const std::vector<std::string> captions = {"a cat", "a dog", "a cat", "", "a bird on a wire", "x"};
    CacheBuildOptions opt;
    opt.batch_size = 2;
    auto report = build_text_cache(cache, captions, fn, opt, pool_);
    EXPECT_EQ(report.built, 5);  // distinct captions, the empty one included
    EXPECT_EQ(report.encoder_calls, 3);
    EXPECT_EQ(build_text_cache(cache, captions, fn, opt, pool_).reused, 5);
    EXPECT_EQ(encoded, 5);
    const TextEmbeds got = text_embeds_for(cache, {"a dog", "a cat"}, fn);
    const TextEmbeds want = tiny_text({"a dog", "a cat"});
    EXPECT_TRUE(at::equal(got.at("prompt_embeds"), want.at("prompt_embeds")));
    EXPECT_TRUE(at::equal(got.at("pooled_prompt_embeds"), want.at("pooled_prompt_embeds")));
    EXPECT_EQ(encoded, 5);
    EXPECT_EQ(cache.entry_path("a cat").filename().string(), sha256_hex("a cat").substr(0, 32) + "-sdxl-" +
                                                                 sha256_hex("tiny_text v1").substr(0, 12) +
                                                                 ".safetensors");
    // A damaged entry is rebuilt; another encoder invalidates them all.
    const auto p = cache.entry_path("a cat");
    test::write_bytes(p, fs::read_file(p).substr(0, 40));
    report = build_text_cache(cache, captions, fn, opt, pool_);
    EXPECT_EQ(report.rebuilt_corrupt, 1);
    // Another encoder (issue #25: another model) gets entries of its own, leaving these alone:
    // switching back reuses every one.
    ts.encoder_identity = "tiny_text v2";
    const auto other = build_text_cache(TextEmbedCache(ts), captions, fn, opt, pool_);
    EXPECT_EQ(other.built, 5);
    EXPECT_EQ(other.rebuilt_stale, 0);
    EXPECT_NE(TextEmbedCache(ts).entry_path("a cat"), cache.entry_path("a cat"));
    EXPECT_EQ(build_text_cache(cache, captions, fn, opt, pool_).reused, 5);
    EXPECT_NE(report.summary().find("prompts/s"), std::string::npos) << report.summary();
    EXPECT_EQ(report.summary().find("img"), std::string::npos) << report.summary();
    // Rank shares of the distinct captions are disjoint and complete.
    ts.cache_dir = (dir_ / "text2").string();
    int64_t built = 0;
    for (int rank = 0; rank < 4; ++rank) {
        opt.world_size = 4;
        opt.rank = rank;
        built += build_text_cache(TextEmbedCache(ts), captions, fn, opt, pool_).built;
    }
    EXPECT_EQ(built, 5);
}

}  // namespace
}  // namespace test_caches_local
}  // namespace dtune::data

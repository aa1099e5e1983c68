// The whole `type: aws` pipeline against real S3 servers started on 127.0.0.1 (SeaweedFS, which
// verifies signatures, and moto): `dtune train` on the tiny fixture model with
//   1. images and a Parquet metadata table in the bucket (sizes and captions from the table),
//      caches on local disk: the run trains, the bucket metadata files land under the prefix,
//      nothing is mirrored locally (preserve_data_backend_cache on a bucket: tests/data/test_s3_storage.cpp);
//   2. images on local disk, text embeddings and latents in the bucket (aws text_embeds and
//      image_embeds entries): the cache objects exist in the bucket, a second run reuses them all;
//   3. eval datasets in the bucket (one rooted at aws_data_prefix, one at instance_data_dir): the
//      eval loss rows are finite and equal, bit for bit, to those of the same images on local disk;
//   4. `dtune cache` on images in the bucket, caches in the bucket or on local disk (captions from
//      .txt objects or a Parquet table): a training run afterwards reuses every entry;
//   5. a wrong secret: the run fails with an error naming the bucket, the key and the fix, and the
//      secret appears in no output.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <set>
#include <tuple>

#include <sys/wait.h>

#include "core/fs.h"
#include "io/image.h"
#include "io/s3.h"
#include "s3_test_server.h"
#include "support/test_support.h"

namespace dtune {
namespace test_train_s3_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

namespace stdfs = std::filesystem;
using test::S3ServerKind;
using test::S3TestServer;
using json = nlohmann::json;

constexpr const char* kBucket = "dtune-train";

int run(const std::string& cmd) {
    const int status = std::system(cmd.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string png(int w, int h, int seed) {
    io::RgbImage img(w, h);
    for (size_t p = 0; p < img.pixels.size(); ++p)
        img.pixels[p] = static_cast<uint8_t>((p * 5 + seed * 37) % 256);
    return io::encode_png(img);
}

int64_t count_local(const stdfs::path& dir) {
    int64_t n = 0;
    if (!stdfs::exists(dir)) return 0;
    for (const auto& e : stdfs::recursive_directory_iterator(dir))
        if (e.is_regular_file() && e.path().extension() == ".safetensors") ++n;
    return n;
}

// Every file under `dir` (recursively) read into one string, for secret greps.
std::string all_output(const stdfs::path& dir) {
    std::string out;
    for (const auto& e : stdfs::recursive_directory_iterator(dir))
        if (e.is_regular_file()) out += fs::read_file(e.path());
    return out;
}

class TrainS3 : public ::testing::TestWithParam<S3ServerKind> {
  protected:
    void SetUp() override {
        server_ = S3TestServer::start(GetParam());
        ASSERT_TRUE(server_) << "could not start the S3 server";
        client_ = std::make_unique<io::S3Client>(client_config(S3TestServer::kSecretKey));
        client_->create_bucket();
        const json cfg = {{"--model_family", "sdxl"},
                          {"--pretrained_model_name_or_path", (test::fixtures_dir() / "tiny-sdxl").string()},
                          {"--data_backend_config", (dir_ / "multidatabackend.json").string()},
                          {"--train_batch_size", 1},
                          {"--learning_rate", 1e-4},
                          {"--optimizer", "torch-adamw"},
                          {"--mixed_precision", "no"},
                          {"--seed", 3},
                          {"--device", "cpu"}};
        fs::write_file_atomic(dir_ / "config.json", cfg.dump(2));
    }
    io::S3Config client_config(const std::string& secret) const {
        io::S3Config c;
        c.bucket = kBucket;
        c.endpoint = server_->endpoint();
        c.region = "us-east-1";
        c.credentials = {S3TestServer::kAccessKey, secret, ""};
        return c;
    }
    // The aws_* keys of an entry on this server's bucket.
    json aws_keys(const std::string& secret = S3TestServer::kSecretKey) const {
        return {{"type", "aws"},
                {"aws_bucket_name", kBucket},
                {"aws_region_name", "us-east-1"},
                {"aws_endpoint_url", server_->endpoint()},
                {"aws_access_key_id", S3TestServer::kAccessKey},
                {"aws_secret_access_key", secret},
                {"aws_max_pool_connections", 8}};
    }
    std::vector<std::string> keys_under(const std::string& prefix) const {
        std::vector<std::string> out;
        for (const auto& o : client_->list(prefix)) out.push_back(o.key);
        return out;
    }
    int64_t count_in_bucket(const std::string& prefix) const {
        int64_t n = 0;
        for (const auto& k : keys_under(prefix)) n += k.size() > 12 && k.ends_with(".safetensors");
        return n;
    }
    // Runs `dtune train` for `steps` steps into output `out`; the log is dir_/<out>.log.
    int train(const std::string& out, int steps = 2) const {
        return run(std::string(DTUNE_BIN) + " train --config '" + (dir_ / "config.json").string() +
                   "' --output_dir '" + (dir_ / out).string() + "' --max_train_steps " +
                   std::to_string(steps) + " >'" + (dir_ / (out + ".log")).string() + "' 2>&1");
    }
    // Runs `dtune cache` with output_dir dir_/<out>; the log is dir_/<out>.log.
    int cache(const std::string& out) const {
        auto cfg = json::parse(fs::read_file(dir_ / "config.json"));
        cfg["--output_dir"] = (dir_ / out).string();
        fs::write_file_atomic(dir_ / (out + ".json"), cfg.dump(2));
        return run(std::string(DTUNE_BIN) + " cache --config '" + (dir_ / (out + ".json")).string() + "' >'" +
                   (dir_ / (out + ".log")).string() + "' 2>&1");
    }
    std::string log(const std::string& out) const { return fs::read_file(dir_ / (out + ".log")); }
    // Adds (or replaces) settings of config.json.
    void set_config(const json& settings) const {
        auto cfg = json::parse(fs::read_file(dir_ / "config.json"));
        cfg.update(settings);
        fs::write_file_atomic(dir_ / "config.json", cfg.dump(2));
    }
    // The secret is in multidatabackend.json by construction; it must be in no output of a run.
    void expect_no_secret(const std::string& out) const {
        std::string everything = log(out);
        if (stdfs::exists(dir_ / out)) everything += all_output(dir_ / out);
        EXPECT_EQ(everything.find(S3TestServer::kSecretKey), std::string::npos)
            << "the secret leaked in " << out;
    }
    void write_backends(const json& entries) const {
        fs::write_file_atomic(dir_ / "multidatabackend.json", entries.dump(2));
    }
    std::vector<json> parquet_dataset_with_local_caches();
    // Entries for text embeddings ("text-s3", the default) and latents ("vae-s3") kept in the bucket.
    std::pair<json, json> bucket_cache_entries() const {
        json text = aws_keys();
        text.update({{"id", "text-s3"},
                     {"dataset_type", "text_embeds"},
                     {"default", true},
                     {"cache_dir", "caches/text"}});
        json vae = aws_keys();
        vae.update({{"id", "vae-s3"}, {"dataset_type", "image_embeds"}, {"cache_dir", "caches/vae"}});
        return {text, vae};
    }

    test::TempDir dir_;
    std::unique_ptr<S3TestServer> server_;
    std::unique_ptr<io::S3Client> client_;
};

// Rows 1–8 of the fixture table (row 0 has no caption): the images are uploaded under their
// `filename`; the table's width/height (not the 64×64 pixels) decide the buckets.
std::vector<json> fixture_rows() {
    std::ifstream in(test::fixtures_dir() / "parquet" / "expected_rows.jsonl");
    std::vector<json> rows;
    std::string line;
    for (int i = 0; i < 9 && std::getline(in, line); ++i)
        if (i > 0) rows.push_back(json::parse(line));
    return rows;
}

// Rows 1-8's images and the Parquet table (captions, sizes) in the bucket under ds/; the dataset
// entry reads them from there, with latent and text caches on local disk. Returns the rows.
std::vector<json> TrainS3::parquet_dataset_with_local_caches() {
    const auto rows = fixture_rows();
    for (size_t i = 0; i < rows.size(); ++i)
        client_->put("ds/images/" + rows[i].at("filename").get<std::string>(), png(64, 64, int(i)));
    client_->put("ds/meta/table.parquet",
                 fs::read_file(test::fixtures_dir() / "parquet" / "zstd_dict_v2.parquet"));
    json entry = aws_keys();
    entry.update({{"id", "s3"},
                  {"aws_data_prefix", "ds/images"},
                  {"resolution", 64},
                  {"resolution_type", "pixel"},
                  {"caption_strategy", "parquet"},
                  {"metadata_backend", "parquet"},
                  {"parquet",
                   {{"path", "ds/meta/table.parquet"},
                    {"filename_column", "filename"},
                    {"caption_column", "caption"},
                    {"width_column", "width"},
                    {"height_column", "height"},
                    {"identifier_includes_extension", true}}},
                  {"cache_dir_vae", (dir_ / "vae").string()}});
    const json text = {{"id", "text"},
                       {"dataset_type", "text_embeds"},
                       {"default", true},
                       {"cache_dir", (dir_ / "text").string()}};
    write_backends(json::array({entry, text}));
    return rows;
}

TEST_P(TrainS3, ImagesAndParquetInTheBucketCachesLocal) {
    const auto rows = parquet_dataset_with_local_caches();
    ASSERT_EQ(rows.size(), 8u);
    client_->put("ds/images-other/stray.png", png(64, 64, 99));  // outside the prefix: never listed

    ASSERT_EQ(train("first", 1), 0) << log("first");
    const std::string first = log("first");
    EXPECT_NE(first.find("latents of 's3': 8 entries: 8 built, 0 reused"), std::string::npos) << first;
    EXPECT_EQ(count_local(dir_ / "vae"), 8);
    EXPECT_EQ(count_local(dir_ / "text"), 9);  // 8 captions + "" for caption dropout
    EXPECT_FALSE(stdfs::exists(dir_ / "first" / "cache" / "s3")) << "the dataset was mirrored";
    std::ifstream metrics(dir_ / "first" / "metrics.jsonl");
    int lines = 0;
    for (std::string line; std::getline(metrics, line); ++lines)
        EXPECT_TRUE(std::isfinite(json::parse(line).at("loss").get<double>())) << line;
    EXPECT_EQ(lines, 1);
    // Bucket metadata is written through the backend, under the prefix, with the table's sizes.
    const auto index = json::parse(client_->get("ds/images/aspect_ratio_bucket_indices_s3.json"));
    std::set<std::string> buckets;
    for (const auto& [key, paths] : index.at("aspect_ratio_bucket_indices").items()) buckets.insert(key);
    EXPECT_GE(buckets.size(), 3u) << index.dump();  // 4:3, 1:1, 7:4 and 4:7 in the table
    EXPECT_TRUE(client_->head("ds/images/aspect_ratio_bucket_metadata_s3.json").has_value());
    EXPECT_EQ(first.find("stray.png"), std::string::npos);

    // The secret is in multidatabackend.json by construction; it must be in no output of the runs.
    EXPECT_EQ((all_output(dir_ / "first") + first).find(S3TestServer::kSecretKey), std::string::npos);
}

TEST_P(TrainS3, LocalImagesWithTextAndLatentCachesInTheBucket) {
    const stdfs::path images = dir_ / "images";
    stdfs::create_directories(images);
    for (int i = 0; i < 4; ++i) {
        fs::write_file_atomic(images / ("photo " + std::to_string(i) + ".png"), png(i % 2 ? 96 : 64, 64, i));
        fs::write_file_atomic(images / ("photo " + std::to_string(i) + ".txt"),
                              "a photo number " + std::to_string(i));
    }
    const auto [text, vae] = bucket_cache_entries();
    const json entry = {{"id", "local"},
                        {"type", "local"},
                        {"instance_data_dir", images.string()},
                        {"resolution", 64},
                        {"resolution_type", "pixel"},
                        {"caption_strategy", "textfile"},
                        {"image_embeds", "vae-s3"},
                        {"text_embeds", "text-s3"}};
    write_backends(json::array({entry, text, vae}));

    ASSERT_EQ(train("first", 1), 0) << log("first");
    const std::string first = log("first");
    EXPECT_NE(first.find("latents of 'local': 4 entries: 4 built"), std::string::npos) << first;
    EXPECT_EQ(count_in_bucket("caches/vae/local/"), 4);
    EXPECT_EQ(count_in_bucket("caches/text/"), 5);  // 4 captions + ""
    EXPECT_FALSE(stdfs::exists(dir_ / "first" / "cache" / "vae")) << "latents were written locally";
    EXPECT_EQ(count_local(dir_ / "first" / "cache"), 0) << "a cache entry was written to local disk";

    ASSERT_EQ(train("second", 1), 0) << log("second");
    const std::string second = log("second");
    EXPECT_NE(second.find("4 entries: 0 built, 4 reused"), std::string::npos) << second;
    EXPECT_NE(second.find("5 entries: 0 built, 5 reused"), std::string::npos) << second;
    EXPECT_NE(second.find("VAE released after caching"), std::string::npos) << second;
}

// The rows of <out>/eval.jsonl.
std::vector<json> eval_rows(const stdfs::path& out) {
    std::vector<json> rows;
    std::ifstream in(out / "eval.jsonl");
    for (std::string line; std::getline(in, line);) rows.push_back(json::parse(line));
    return rows;
}

TEST_P(TrainS3, EvalDatasetsInTheBucketScoreAsOnLocalDisk) {
    for (int i = 0; i < 2; ++i) {
        client_->put("ds/train/t" + std::to_string(i) + ".png", png(64, 64, 10 + i));
        client_->put("ds/train/t" + std::to_string(i) + ".txt", "a training shape " + std::to_string(i));
    }
    // The eval images, uploaded and also written to local disk for the reference run. The JPEG is
    // stored 96×64 with EXIF orientation 6 (shown 64×96): its crop depends on honouring EXIF.
    io::RgbImage wide(96, 64);
    for (size_t p = 0; p < wide.pixels.size(); ++p) wide.pixels[p] = static_cast<uint8_t>((p * 7) % 253);
    const std::vector<std::tuple<std::string, std::string, std::string>> evals = {
        {"ds/eval/e0.png", "eval", png(64, 64, 20)},
        {"ds/eval/e1.png", "eval", png(80, 64, 21)},
        {"other/eval2/e2.jpg", "eval2", io::encode_jpeg(wide, 90, 6)}};
    for (const auto& [key, local, bytes] : evals) {
        const std::string name = stdfs::path(key).filename().string();
        const std::string caption = "an eval shape " + stdfs::path(key).stem().string();
        client_->put(key, bytes);
        client_->put(stdfs::path(key).replace_extension(".txt").string(), caption);
        stdfs::create_directories(dir_ / local);
        fs::write_file_atomic(dir_ / local / name, bytes);
        fs::write_file_atomic((dir_ / local / name).replace_extension(".txt"), caption);
    }
    client_->put("ds/eval-other/stray.png", png(64, 64, 99));  // outside both eval roots: never scored
    json training = aws_keys();
    training.update({{"id", "train"},
                     {"aws_data_prefix", "ds/train"},
                     {"resolution", 64},
                     {"resolution_type", "pixel"},
                     {"caption_strategy", "textfile"}});
    const json eval_keys = {{"dataset_type", "eval"},
                            {"resolution", 64},
                            {"resolution_type", "pixel"},
                            {"caption_strategy", "textfile"}};
    // One eval entry rooted at aws_data_prefix, one at instance_data_dir (a key prefix that wins
    // over aws_data_prefix, as for image datasets).
    json eval_prefix = aws_keys();
    eval_prefix.update(eval_keys);
    eval_prefix.update({{"id", "eval"}, {"aws_data_prefix", "ds/eval"}});
    json eval_dir = aws_keys();
    eval_dir.update(eval_keys);
    eval_dir.update({{"id", "eval2"}, {"aws_data_prefix", "ds"}, {"instance_data_dir", "other/eval2"}});
    const json text = {{"id", "text"},
                       {"dataset_type", "text_embeds"},
                       {"default", true},
                       {"cache_dir", (dir_ / "text").string()}};
    set_config({{"--eval_steps_interval", 1}, {"--eval_timesteps", 3}, {"--num_eval_images", 8}});

    write_backends(json::array({training, eval_prefix, eval_dir, text}));
    ASSERT_EQ(train("s3_eval", 2), 0) << log("s3_eval");
    const auto rows = eval_rows(dir_ / "s3_eval");
    ASSERT_EQ(rows.size(), 2u) << log("s3_eval");
    for (const auto& r : rows) {
        EXPECT_EQ(r.at("images"), 3) << r.dump();  // e0, e1, e2: not the stray image
        EXPECT_TRUE(std::isfinite(r.at("eval_loss").get<double>())) << r.dump();
    }
    EXPECT_NE(log("s3_eval").find("eval loss: 3 image(s) x 3 timesteps"), std::string::npos)
        << log("s3_eval");
    expect_no_secret("s3_eval");

    // The same images read from local disk: the same training, so the same losses, bit for bit.
    json local_eval = eval_keys, local_eval2 = eval_keys;
    local_eval.update({{"id", "eval"}, {"type", "local"}, {"instance_data_dir", (dir_ / "eval").string()}});
    local_eval2.update(
        {{"id", "eval2"}, {"type", "local"}, {"instance_data_dir", (dir_ / "eval2").string()}});
    write_backends(json::array({training, local_eval, local_eval2, text}));
    ASSERT_EQ(train("local_eval", 2), 0) << log("local_eval");
    const auto local_rows = eval_rows(dir_ / "local_eval");
    ASSERT_EQ(local_rows.size(), rows.size());
    for (size_t i = 0; i < rows.size(); ++i) {
        EXPECT_EQ(rows[i].at("step"), local_rows[i].at("step"));
        EXPECT_EQ(rows[i].at("eval_loss").get<double>(), local_rows[i].at("eval_loss").get<double>())
            << "step " << rows[i].at("step");
    }
}

// Images and captions in the bucket, text embeddings and latents in the bucket too (aws
// text_embeds and image_embeds entries): `dtune cache` fills the bucket, training encodes nothing.
TEST_P(TrainS3, DtuneCacheFillsBucketCachesThatTrainingReuses) {
    for (int i = 0; i < 4; ++i) {
        client_->put("ds/images/photo " + std::to_string(i) + ".png", png(i % 2 ? 96 : 64, 64, i));
        client_->put("ds/images/photo " + std::to_string(i) + ".txt", "a photo number " + std::to_string(i));
    }
    json images = aws_keys();
    images.update({{"id", "s3"},
                   {"aws_data_prefix", "ds/images"},
                   {"resolution", 64},
                   {"resolution_type", "pixel"},
                   {"caption_strategy", "textfile"},
                   {"image_embeds", "vae-s3"},
                   {"text_embeds", "text-s3"}});
    const auto [text, vae] = bucket_cache_entries();
    write_backends(json::array({images, text, vae}));

    ASSERT_EQ(cache("cached"), 0) << log("cached");
    const auto report = json::parse(fs::read_file(dir_ / "cached" / "cache_report_rank0.json"));
    EXPECT_EQ(report.at("s3").at("latents").at("built"), 4) << report.dump();
    EXPECT_EQ(report.at("s3").at("text").at("built"), 5) << report.dump();  // 4 captions + ""
    EXPECT_EQ(count_in_bucket("caches/vae/s3/"), 4);
    EXPECT_EQ(count_in_bucket("caches/text/"), 5);
    EXPECT_TRUE(client_->head("ds/images/aspect_ratio_bucket_indices_s3.json").has_value());
    EXPECT_EQ(count_local(dir_ / "cached"), 0) << "a cache entry was written to local disk";
    expect_no_secret("cached");

    ASSERT_EQ(train("after", 1), 0) << log("after");
    const std::string after = log("after");
    EXPECT_NE(after.find("latents of 's3': 4 entries: 0 built, 4 reused"), std::string::npos) << after;
    EXPECT_NE(after.find("5 entries: 0 built, 5 reused"), std::string::npos) << after;
    EXPECT_NE(after.find("VAE released after caching"), std::string::npos) << after;
    EXPECT_EQ(count_in_bucket("caches/vae/s3/"), 4);
    expect_no_secret("after");
}

// Images and a Parquet table (captions and sizes) in the bucket, caches on local disk.
TEST_P(TrainS3, DtuneCacheOnBucketImagesWithLocalCaches) {
    parquet_dataset_with_local_caches();

    ASSERT_EQ(cache("cached"), 0) << log("cached");
    EXPECT_EQ(count_local(dir_ / "vae"), 8);
    EXPECT_EQ(count_local(dir_ / "text"), 9);  // 8 captions + ""
    expect_no_secret("cached");

    ASSERT_EQ(train("after", 1), 0) << log("after");
    const std::string after = log("after");
    EXPECT_NE(after.find("latents of 's3': 8 entries: 0 built, 8 reused"), std::string::npos) << after;
    EXPECT_NE(after.find("9 entries: 0 built, 9 reused"), std::string::npos) << after;
    EXPECT_EQ(count_local(dir_ / "vae"), 8);
    expect_no_secret("after");
}

INSTANTIATE_TEST_SUITE_P(Servers, TrainS3, ::testing::Values(S3ServerKind::kSeaweed, S3ServerKind::kMoto));

// SeaweedFS checks signatures: a wrong secret must stop the run with an error naming the bucket,
// the object and the keys to fix, and the secret must appear in no output.
TEST(TrainS3Auth, WrongSecretFailsWithAnActionableError) {
    auto server = S3TestServer::start(S3ServerKind::kSeaweed);
    ASSERT_TRUE(server);
    io::S3Config good;
    good.bucket = kBucket;
    good.endpoint = server->endpoint();
    good.region = "us-east-1";
    good.credentials = {S3TestServer::kAccessKey, S3TestServer::kSecretKey, ""};
    io::S3Client client(good);
    client.create_bucket();
    client.put("ds/a.png", png(64, 64, 1));
    test::TempDir dir;
    const std::string wrong = "WRONG-secret-that-must-not-leak-77";
    const json backends = json::array({{{"id", "s3"},
                                        {"type", "aws"},
                                        {"aws_bucket_name", kBucket},
                                        {"aws_endpoint_url", server->endpoint()},
                                        {"aws_region_name", "us-east-1"},
                                        {"aws_access_key_id", S3TestServer::kAccessKey},
                                        {"aws_secret_access_key", wrong},
                                        {"aws_data_prefix", "ds"},
                                        {"resolution", 64},
                                        {"resolution_type", "pixel"},
                                        {"caption_strategy", "filename"}},
                                       {{"id", "text"},
                                        {"dataset_type", "text_embeds"},
                                        {"default", true},
                                        {"cache_dir", (dir / "text").string()}}});
    fs::write_file_atomic(dir / "mdb.json", backends.dump());
    const json cfg = {{"--model_family", "sdxl"},
                      {"--pretrained_model_name_or_path", (test::fixtures_dir() / "tiny-sdxl").string()},
                      {"--data_backend_config", (dir / "mdb.json").string()},
                      {"--optimizer", "torch-adamw"},
                      {"--mixed_precision", "no"},
                      {"--device", "cpu"}};
    fs::write_file_atomic(dir / "config.json", cfg.dump());
    const int rc = run(std::string(DTUNE_BIN) + " train --config '" + (dir / "config.json").string() +
                       "' --output_dir '" + (dir / "out").string() + "' --max_train_steps 1 >'" +
                       (dir / "run.log").string() + "' 2>&1");
    const std::string out = fs::read_file(dir / "run.log");
    EXPECT_NE(rc, 0) << out;
    EXPECT_NE(out.find("s3://dtune-train/ds/"), std::string::npos) << out;  // bucket and key
    EXPECT_NE(out.find("HTTP 403"), std::string::npos) << out;
    EXPECT_NE(out.find("aws_secret_access_key"), std::string::npos) << out;  // the fix
    std::string everything = out;
    if (stdfs::exists(dir / "out")) everything += all_output(dir / "out");
    EXPECT_EQ(everything.find(wrong), std::string::npos) << "the secret leaked";
}

}  // namespace
}  // namespace test_train_s3_local
}  // namespace dtune

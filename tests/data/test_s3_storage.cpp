// The `type: aws` backend end to end against SeaweedFS on loopback: a dataset entry with
// SimpleTuner's aws_* keys, parsed by the dataset config, gives a backend that lists only under
// its prefix, reads images that decode to the pixels that were uploaded, reads just the header
// bytes for bucketing, and writes/removes metadata files.
#include "core/error.h"
#include "core/fs.h"
#include "core/thread_pool.h"
#include "data/dataset_buckets.h"
#include "data/dataset_config.h"
#include "data/listing_cache.h"
#include "data/s3_storage.h"
#include "io/image.h"
#include "io/image_info.h"
#include "s3_test_server.h"
#include "support/http_listener.h"

#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>

namespace dtune::data {
namespace test_s3_storage_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

using test::S3TestServer;

io::RgbImage gradient(int w, int h, int seed) {
    io::RgbImage img(w, h);
    for (int y = 0; y < h; ++y)
        for (int x = 0; x < w; ++x) {
            uint8_t* p = img.at(x, y);
            p[0] = static_cast<uint8_t>(x * 7 + seed);
            p[1] = static_cast<uint8_t>(y * 5 + seed);
            p[2] = static_cast<uint8_t>((x + y) * 3);
        }
    return img;
}

// A config with the entry plus the text_embeds entry every config needs; returns the entry.
DatasetConfig parse_entry(const nlohmann::json& entry) {
    const nlohmann::json text = {
        {"id", "text"}, {"dataset_type", "text_embeds"}, {"default", true}, {"cache_dir", "cache/text"}};
    return parse_data_backend_config(nlohmann::json::array({entry, text}), GlobalDataArgs{}).datasets.at(0);
}

DatasetConfig aws_entry(const S3TestServer& server, const std::string& prefix) {
    const nlohmann::json entry = {{"id", "s3-images"},
                                  {"type", "aws"},
                                  {"aws_bucket_name", "dtune-dataset"},
                                  {"aws_region_name", "us-east-1"},
                                  {"aws_endpoint_url", server.endpoint()},
                                  {"aws_access_key_id", S3TestServer::kAccessKey},
                                  {"aws_secret_access_key", S3TestServer::kSecretKey},
                                  {"aws_data_prefix", prefix},
                                  {"aws_max_pool_connections", 4},
                                  {"caption_strategy", "filename"}};
    return parse_entry(entry);
}

TEST(S3Storage, ListsUnderThePrefixAndReadsImages) {
    auto server = S3TestServer::start(test::S3ServerKind::kSeaweed);
    ASSERT_TRUE(server);
    const DatasetConfig entry = aws_entry(*server, "train/images");
    EXPECT_EQ(s3_data_prefix_for(entry), "train/images/");
    const io::S3Config s3 = s3_config_for(entry);
    EXPECT_EQ(s3.max_connections, 4);
    io::S3Client(s3).create_bucket();

    auto storage = make_storage(entry);
    ASSERT_EQ(storage->kind(), "aws");
    const io::RgbImage a = gradient(64, 48, 1), b = gradient(40, 80, 2);
    storage->write("train/images/a cat.png", io::encode_png(a));
    storage->write("train/images/sub/b.PNG", io::encode_png(b));
    storage->write("train/images/a cat.txt", "a cat");
    storage->write("train/images-other/c.png", io::encode_png(a));  // shares the text prefix only
    storage->write("val/d.png", io::encode_png(b));

    const std::vector<std::string> ext = {".png", ".jpg"};
    EXPECT_EQ(storage->list_files("", ext),
              (std::vector<std::string>{"train/images/a cat.png", "train/images/sub/b.PNG"}));
    EXPECT_EQ(storage->list_files("train/images/sub", ext),
              (std::vector<std::string>{"train/images/sub/b.PNG"}));
    EXPECT_EQ(storage->list_files("train/images", {}).size(), 3u);  // the caption file too

    const io::RgbImage got = io::decode_image(storage->read("train/images/sub/b.PNG"), "b.PNG");
    EXPECT_EQ(got.width, 40);
    EXPECT_EQ(got.height, 80);
    EXPECT_TRUE(got.pixels == b.pixels);

    auto* s3_storage = dynamic_cast<S3Storage*>(storage.get());
    ASSERT_NE(s3_storage, nullptr);
    const std::string header = s3_storage->read_prefix("train/images/a cat.png", 64);
    ASSERT_EQ(header.size(), 64u);
    io::ImageInfo info;
    std::string error;
    ASSERT_EQ(io::parse_image_info(reinterpret_cast<const uint8_t*>(header.data()), header.size(), false,
                                   info, error),
              io::ParseStatus::kOk)
        << error;
    EXPECT_EQ(info.width, 64);
    EXPECT_EQ(info.height, 48);
    const auto many = s3_storage->read_many({"train/images/a cat.txt", "/val/d.png"});
    EXPECT_EQ(many[0], "a cat");
    EXPECT_EQ(io::decode_image(many[1], "d.png").pixels, b.pixels);

    EXPECT_EQ(storage->join("train/images", "sub/./b.PNG"), "train/images/sub/b.PNG");
    EXPECT_EQ(storage->join("train/images", "/val/d.png"), "val/d.png");
    EXPECT_TRUE(storage->exists("val/d.png"));
    storage->remove("val/d.png");
    EXPECT_FALSE(storage->exists("val/d.png"));
    try {
        storage->read("train/images/missing.png");
        FAIL() << "expected DataError";
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find("s3://dtune-dataset/train/images/missing.png"),
                  std::string::npos)
            << e.what();
    }
}

// What a user sees for a missing bucket and for an endpoint where no server listens: the bucket
// (and key), the key of the entry to fix, never the secret.
TEST(S3Storage, MissingBucketAndWrongEndpointNameTheBucketAndTheFix) {
    auto server = S3TestServer::start(test::S3ServerKind::kSeaweed);
    ASSERT_TRUE(server);
    nlohmann::json e = {{"id", "s3-missing"},
                        {"type", "aws"},
                        {"aws_bucket_name", "no-such-bucket-here"},
                        {"aws_region_name", "us-east-1"},
                        {"aws_endpoint_url", server->endpoint()},
                        {"aws_access_key_id", S3TestServer::kAccessKey},
                        {"aws_secret_access_key", S3TestServer::kSecretKey},
                        {"aws_data_prefix", "imgs"}};
    auto expect_error = [](const std::function<void()>& fn, const std::vector<std::string>& parts) {
        try {
            fn();
            ADD_FAILURE() << "expected DataError";
        } catch (const DataError& err) {
            const std::string m = err.what();
            for (const auto& p : parts) EXPECT_NE(m.find(p), std::string::npos) << p << " not in: " << m;
            EXPECT_EQ(m.find(S3TestServer::kSecretKey), std::string::npos) << m;
        }
    };
    auto missing = make_storage(parse_entry(e));
    expect_error([&] { missing->list_files("imgs", {".png"}); },
                 {"s3://no-such-bucket-here/", "NoSuchBucket", "aws_bucket_name"});
    // A GET that may miss (cache lookups) must not read a missing bucket as a missing object.
    expect_error([&] { missing->read_if_exists("imgs/a.png"); },
                 {"s3://no-such-bucket-here/imgs/a.png", "NoSuchBucket", "aws_bucket_name"});

    // Nothing listens on loopback port 9 (discard): the connection is refused on every attempt.
    e["aws_bucket_name"] = "dtune-dataset";
    e["aws_endpoint_url"] = "http://127.0.0.1:9";
    e["aws_max_pool_connections"] = 2;
    auto nowhere = make_storage(parse_entry(e));
    expect_error([&] { nowhere->read("imgs/a.png"); },
                 {"s3://dtune-dataset/imgs/a.png", "http://127.0.0.1:9", "aws_endpoint_url"});
}

// A bucket in another region: AWS answers 301 PermanentRedirect (SeaweedFS and moto accept any
// region, so a plain HTTP listener plays AWS here). The error names the bucket, key and the fix.
TEST(S3Storage, WrongRegionNamesTheRegionKey) {
    test::HttpListener aws;
    aws.set_status(301);
    const nlohmann::json e = {{"id", "s3-region"},
                              {"type", "aws"},
                              {"aws_bucket_name", "eu-bucket"},
                              {"aws_region_name", "us-east-1"},
                              {"aws_endpoint_url", "http://127.0.0.1:" + std::to_string(aws.port())},
                              {"aws_access_key_id", "AKIDEXAMPLE"},
                              {"aws_secret_access_key", "region-test-secret-never-shown"}};
    auto storage = make_storage(parse_entry(e));
    try {
        storage->read("imgs/a.png");
        FAIL() << "expected DataError";
    } catch (const DataError& err) {
        const std::string m = err.what();
        EXPECT_NE(m.find("s3://eu-bucket/imgs/a.png"), std::string::npos) << m;
        EXPECT_NE(m.find("HTTP 301"), std::string::npos) << m;
        EXPECT_NE(m.find("aws_region_name"), std::string::npos) << m;
        EXPECT_EQ(m.find("region-test-secret-never-shown"), std::string::npos) << m;
    }
}

// preserve_data_backend_cache on a bucket: the first bucketing lists the prefix and stores the
// listing (with sizes and ETags) in output_dir; with the flag on, an object uploaded afterwards is
// not seen (no relisting) and the ETags come from the stored listing; with it off, it is.
TEST(S3Storage, PreservedListingSkipsRelistingTheBucket) {
    auto server = S3TestServer::start(test::S3ServerKind::kSeaweed);
    ASSERT_TRUE(server);
    nlohmann::json e = {{"id", "pres"},
                        {"type", "aws"},
                        {"aws_bucket_name", "dtune-preserve"},
                        {"aws_region_name", "us-east-1"},
                        {"aws_endpoint_url", server->endpoint()},
                        {"aws_access_key_id", S3TestServer::kAccessKey},
                        {"aws_secret_access_key", S3TestServer::kSecretKey},
                        {"aws_data_prefix", "pres/img"},
                        {"resolution", 64},
                        {"resolution_type", "pixel"},
                        {"caption_strategy", "filename"},
                        {"train_batch_size", 1},
                        {"preserve_data_backend_cache", true}};
    io::S3Client(s3_config_for(parse_entry(e))).create_bucket();
    auto storage = make_storage(parse_entry(e));
    for (int i = 0; i < 3; ++i)
        storage->write(str("pres/img/", i, ".png"), io::encode_png(gradient(64, 64, i)));
    test::TempDir out;
    ThreadPool pool(2);
    BucketBuildOptions bo;
    bo.output_dir = out.path().string();
    auto bucketed = [&](const nlohmann::json& entry) {
        return build_dataset_buckets(parse_entry(entry), bo, pool).index.sample_count();
    };
    EXPECT_EQ(bucketed(e), 3);  // nothing stored yet: listed
    const auto stored = nlohmann::json::parse(fs::read_file(listing_cache_path(bo.output_dir, "pres")));
    ASSERT_EQ(stored.at("files").size(), 3u);
    EXPECT_EQ(stored.at("files").at(0).at("version_name"), "source_etag");
    EXPECT_FALSE(stored.at("files").at(0).at("version").get<std::string>().empty());
    EXPECT_TRUE(storage->exists("pres/img/aspect_ratio_bucket_indices_pres.json"));  // under the prefix

    storage->write("pres/img/3.png", io::encode_png(gradient(64, 64, 3)));
    EXPECT_EQ(bucketed(e), 3);  // the stored listing: 3.png is not seen
    e["preserve_data_backend_cache"] = false;
    EXPECT_EQ(bucketed(e), 4);  // relisted
    e["preserve_data_backend_cache"] = true;
    e["aws_data_prefix"] = "pres";  // another root: the stored listing does not apply
    EXPECT_EQ(bucketed(e), 4);
}

TEST(S3Storage, ConfigKeysAreTypeCheckedWithoutShowingSecrets) {
    const nlohmann::json bad = {{"id", "s3"},
                                {"type", "aws"},
                                {"aws_bucket_name", "b-b-b"},
                                {"aws_secret_access_key", 12345987},
                                {"aws_access_key_id", "AK"}};
    const DatasetConfig entry = parse_entry(bad);
    try {
        s3_config_for(entry);
        FAIL() << "expected UsageError";
    } catch (const UsageError& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("aws_secret_access_key"), std::string::npos) << m;
        EXPECT_EQ(m.find("12345987"), std::string::npos) << m;
    }
}

}  // namespace
}  // namespace test_s3_storage_local
}  // namespace dtune::data

// `type: csv` datasets against a real HTTP server on loopback serving real PNG/JPEG/WebP files: the
// config keys, the fetch into csv_cache_dir (verified, resumable, retried), the rows through
// discovery, buckets and captions, and bad input (a missing column, a 404, a corrupt image, a cut
// connection) with errors naming the row and URL.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <set>

#include "core/error.h"
#include "core/fs.h"
#include "core/thread_pool.h"
#include "data/captions.h"
#include "data/csv_dataset.h"
#include "data/dataset_buckets.h"
#include "data/storage.h"
#include "io/image.h"
#include "support/http_listener.h"
#include "support/test_support.h"

namespace dtune::data {
namespace test_csv_dataset_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

namespace stdfs = std::filesystem;
using nlohmann::json;

io::RgbImage pattern(int width, int height, int seed) {
    io::RgbImage img(width, height);
    for (size_t p = 0; p < img.pixels.size(); ++p)
        img.pixels[p] = static_cast<uint8_t>((p * 7 + seed * 31) % 256);
    return img;
}

// A csv entry plus the default text_embeds entry it needs.
json backends(const stdfs::path& csv, const stdfs::path& cache, json extra = json::object()) {
    json entry = {{"id", "web"},
                  {"type", "csv"},
                  {"csv_file", csv.string()},
                  {"csv_cache_dir", cache.string()},
                  {"csv_caption_column", "caption"},
                  {"resolution", 64},
                  {"resolution_type", "pixel"},
                  {"cache_dir_vae", (cache.parent_path() / "vae").string()}};
    entry.update(extra);
    return json::array(
        {entry, {{"id", "text"}, {"dataset_type", "text_embeds"}, {"default", true}, {"cache_dir", "t"}}});
}

DatasetConfig csv_config(const stdfs::path& csv, const stdfs::path& cache, json extra = json::object()) {
    return parse_data_backend_config(backends(csv, cache, std::move(extra)), {}).datasets.at(0);
}

std::string usage_error(const json& j) {
    try {
        parse_data_backend_config(j, {});
    } catch (const UsageError& e) {
        return e.what();
    }
    return "(no UsageError)";
}

CsvFetchOptions fast() {
    CsvFetchOptions o;
    o.backoff_s = 0.01;
    o.timeout_s = 10;
    return o;
}

std::string data_error(const DatasetConfig& c, const CsvFetchOptions& o = fast()) {
    try {
        fetch_csv_images(c, o);
    } catch (const DataError& e) {
        return e.what();
    }
    return "(no DataError)";
}

size_t count_requests(test::HttpListener& server, const std::string& path) {
    size_t n = 0;
    for (const auto& r : server.requests()) n += r.path == path;
    return n;
}

TEST(CsvDatasetConfig, KeysAndDefaults) {
    const DatasetConfig c = csv_config("/d/list.csv", "/d/cache");
    EXPECT_EQ(c.type, StorageType::kCsv);
    ASSERT_TRUE(c.csv.has_value());
    EXPECT_EQ(c.csv->url_column, "url");  // SimpleTuner's default
    EXPECT_EQ(c.csv->caption_column, "caption");
    EXPECT_EQ(c.caption_strategy, CaptionStrategy::kCsv);  // implied when the entry leaves it out
    EXPECT_EQ(c.instance_data_dir, "/d/cache");            // the images live in the cache folder
    EXPECT_EQ(csv_config("/l.csv", "/c", {{"csv_url_column", "image"}, {"caption_strategy", "csv"}})
                  .csv->url_column,
              "image");

    for (const char* key : {"csv_file", "csv_cache_dir", "csv_caption_column"}) {
        json j = backends("/l.csv", "/c");
        j[0].erase(key);
        const std::string e = usage_error(j);
        EXPECT_NE(e.find(str("key '", key, "': required for a csv dataset")), std::string::npos) << e;
    }
    std::string e = usage_error(backends("/l.csv", "/c", {{"caption_strategy", "filename"}}));
    EXPECT_NE(e.find("must be 'csv'"), std::string::npos) << e;
    // csv keys and the csv strategy on another type are mistakes, not silently ignored.
    json local = json::array({{{"id", "l"}, {"instance_data_dir", "/x"}, {"csv_file", "/l.csv"}},
                              {{"id", "text"}, {"dataset_type", "text_embeds"}, {"default", true}}});
    e = usage_error(local);
    EXPECT_NE(e.find("key 'csv_file'"), std::string::npos) << e;
    json embeds = backends("/l.csv", "/c");
    embeds[1]["type"] = "csv";  // SimpleTuner: csv is not a storage for caches
    e = usage_error(embeds);
    EXPECT_NE(e.find("dataset 'text', key 'type': 'csv' lists images"), std::string::npos) << e;
    local[0].erase("csv_file");
    local[0]["caption_strategy"] = "csv";
    e = usage_error(local);
    EXPECT_NE(e.find("'csv' needs \"type\": \"csv\""), std::string::npos) << e;
}

TEST(CsvDataset, FetchesRowsIntoTheCacheAndTrainsThemThroughBucketsAndCaptions) {
    test::TempDir dir;
    test::HttpListener server;
    const std::string png = io::encode_png(pattern(96, 64, 1));
    const std::string jpg = io::encode_jpeg(pattern(64, 96, 2));
    const std::string webp = io::encode_webp(pattern(64, 64, 3), 100);
    server.set_route("/a/cat.png", {200, png});
    server.set_route("/b/cat.png", {200, jpg});  // the same file name under another folder
    server.set_route("/c.webp?size=large", {200, webp});
    const stdfs::path local = dir / "local photo.png";
    io::write_image(local, pattern(64, 64, 4));
    const stdfs::path csv = dir / "list.csv";
    fs::write_file_atomic(csv,
                          "\xEF\xBB\xBF"
                          "caption,url,extra\r\n"
                          "\"a cat, sitting\"," +
                              server.url("/a/cat.png") +
                              ",1\r\n"
                              "old caption," +
                              server.url("/b/cat.png") +
                              ",2\r\n"
                              "\"a \"\"quoted\"\"\nsecond line\"," +
                              server.url("/c.webp?size=large") +
                              ",3\r\n"
                              "\r\n"
                              "a local file," +
                              local.string() +
                              "\r\n"
                              "a dog," +
                              server.url("/b/cat.png") + ",5\r\n");
    const stdfs::path cache = dir / "cache";
    const DatasetConfig c = csv_config(csv, cache);

    const std::vector<CsvRow> rows = read_csv_rows(c);
    ASSERT_EQ(rows.size(), 4u);  // /b/cat.png twice: one sample, its last row's caption
    EXPECT_EQ(rows[1].caption, "a dog");
    EXPECT_EQ(rows[1].line, 8);  // the quoted line break and the blank line count
    EXPECT_EQ(rows[3].line, 7);
    EXPECT_EQ(rows[2].caption, "a \"quoted\"\nsecond line");
    EXPECT_EQ(rows[3].source, local.string());

    // A stray image in the cache folder is not a row: never trained.
    stdfs::create_directories(cache);
    io::write_image(cache / "stray.png", pattern(64, 64, 9));

    ThreadPool pool(2);
    BucketBuildOptions bo;
    bo.output_dir = (dir / "out").string();
    bo.allow_dataset_oversubscription = true;
    const DatasetBuckets built = build_dataset_buckets(c, bo, pool);  // fetches first
    std::set<std::string> trained;
    for (const auto& [key, paths] : built.index.buckets) trained.insert(paths.begin(), paths.end());
    std::set<std::string> expected;
    const std::vector<std::pair<std::string, std::string>> files = {{rows[0].source, ".png"},
                                                                    {rows[1].source, ".jpg"},
                                                                    {rows[2].source, ".webp"},
                                                                    {rows[3].source, ".png"}};
    for (const auto& [source, ext] : files) {
        const stdfs::path p = cache / (csv_cache_stem(source) + ext);
        ASSERT_TRUE(stdfs::exists(p)) << source;
        expected.insert(p.string());
    }
    EXPECT_EQ(trained, expected);
    EXPECT_EQ(fs::read_file(cache / (csv_cache_stem(rows[0].source) + ".png")), png);  // byte for byte
    EXPECT_EQ(fs::read_file(cache / (csv_cache_stem(rows[1].source) + ".jpg")), jpg);
    EXPECT_EQ(count_requests(server, "/b/cat.png"), 1u);

    auto storage = make_storage(c);
    const std::optional<MetadataTable> table = caption_table_for(c, *storage);
    ASSERT_TRUE(table.has_value());
    std::map<std::string, std::string> captions;
    for (const auto& p : trained) captions[p] = resolve_captions(c, *storage, p, &*table).at(0);
    EXPECT_EQ(captions.at((cache / (csv_cache_stem(rows[0].source) + ".png")).string()), "a cat, sitting");
    EXPECT_EQ(captions.at((cache / (csv_cache_stem(rows[1].source) + ".jpg")).string()), "a dog");
    EXPECT_EQ(captions.at((cache / (csv_cache_stem(rows[3].source) + ".png")).string()), "a local file");
}

TEST(CsvDataset, ResumesWithTheRowsStillMissing) {
    test::TempDir dir;
    test::HttpListener server;
    std::string csv_text = "url,caption\n";
    for (int i = 0; i < 4; ++i) {
        const std::string path = "/img" + std::to_string(i) + ".png";
        server.set_route(path, {200, io::encode_png(pattern(64, 64, i))});
        csv_text += server.url(path) + ",image " + std::to_string(i) + "\n";
    }
    fs::write_file_atomic(dir / "list.csv", csv_text);
    const DatasetConfig c = csv_config(dir / "list.csv", dir / "cache");
    CsvFetchReport r = fetch_csv_images(c, fast());
    EXPECT_EQ(r.rows, 4);
    EXPECT_EQ(r.fetched, 4);
    EXPECT_EQ(r.reused, 0);

    // A crash before the rename leaves only a temporary file: not trusted, fetched again; a
    // complete file is trusted without a request.
    const stdfs::path lost = dir / "cache" / (csv_cache_stem(server.url("/img2.png")) + ".png");
    ASSERT_TRUE(stdfs::exists(lost));
    stdfs::rename(lost, lost.string() + ".tmp.1234");
    r = fetch_csv_images(c, fast());
    EXPECT_EQ(r.fetched, 1);
    EXPECT_EQ(r.reused, 3);
    EXPECT_TRUE(stdfs::exists(lost));
    EXPECT_EQ(server.requests().size(), 5u);
    EXPECT_EQ(count_requests(server, "/img2.png"), 2u);
}

TEST(CsvDataset, TransientFailuresAreRetriedAFewTimes) {
    test::TempDir dir;
    test::HttpListener server;
    const std::string png = io::encode_png(pattern(64, 64, 5));
    server.set_route("/flaky.png", {200, png, /*fail_first=*/2, /*fail_status=*/503});
    server.set_route("/cut.png", {200, png, 0, 503, /*cut_after=*/40});
    fs::write_file_atomic(dir / "list.csv", "url,caption\n" + server.url("/flaky.png") + ",flaky\n" +
                                                server.url("/cut.png") + ",cut\n");
    const DatasetConfig c = csv_config(dir / "list.csv", dir / "cache");
    const std::string e = data_error(c);
    // The flaky URL came through on its third request...
    EXPECT_EQ(count_requests(server, "/flaky.png"), 3u);
    EXPECT_TRUE(stdfs::exists(dir / "cache" / (csv_cache_stem(server.url("/flaky.png")) + ".png")));
    // ...the cut one is given up after max_attempts, naming its line and URL; nothing half-written.
    EXPECT_EQ(count_requests(server, "/cut.png"), 4u);
    EXPECT_NE(e.find("1 of 2 image(s)"), std::string::npos) << e;
    EXPECT_NE(e.find("line 3: " + server.url("/cut.png")), std::string::npos) << e;
    EXPECT_NE(e.find("after 4 attempts"), std::string::npos) << e;
    for (const auto& f : stdfs::directory_iterator(dir / "cache"))
        EXPECT_EQ(f.path().stem().string(), csv_cache_stem(server.url("/flaky.png"))) << f.path();
}

TEST(CsvDataset, BadRowsAreNamedAfterTheOthersWereFetched) {
    test::TempDir dir;
    test::HttpListener server;
    const std::string png = io::encode_png(pattern(64, 64, 6));
    server.set_route("/good.png", {200, png});
    server.set_route("/gone.png", {404, "not found"});
    server.set_route("/corrupt.png", {200, png.substr(0, png.size() / 2)});  // complete answer, half an image
    server.set_route("/page.png", {200, "<html>an error page</html>"});
    fs::write_file_atomic(dir / "list.csv", "url,caption\n" + server.url("/gone.png") + ",gone\n" +
                                                server.url("/corrupt.png") + ",corrupt\n" +
                                                server.url("/page.png") + ",page\n" +
                                                server.url("/good.png") + ",good\n");
    const DatasetConfig c = csv_config(dir / "list.csv", dir / "cache");
    const std::string e = data_error(c);
    EXPECT_NE(e.find("dataset 'web': 3 of 4 image(s) listed in " + (dir / "list.csv").string()),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("line 2: " + server.url("/gone.png") + ": HTTP status 404"), std::string::npos) << e;
    EXPECT_NE(e.find("line 3: " + server.url("/corrupt.png")), std::string::npos) << e;
    EXPECT_NE(
        e.find("line 4: " + server.url("/page.png") + ": the content (26 bytes) is not a JPEG, PNG or WebP"),
        std::string::npos)
        << e;
    EXPECT_EQ(count_requests(server, "/gone.png"), 1u);  // a 404 is final: not retried
    EXPECT_TRUE(stdfs::exists(dir / "cache" / (csv_cache_stem(server.url("/good.png")) + ".png")));
    EXPECT_FALSE(stdfs::exists(dir / "cache" / (csv_cache_stem(server.url("/corrupt.png")) + ".png")));

    // A missing column names the key, the file and the columns it has.
    fs::write_file_atomic(dir / "cols.csv", "image,text\n" + server.url("/good.png") + ",x\n");
    try {
        fetch_csv_images(csv_config(dir / "cols.csv", dir / "cache"), fast());
        ADD_FAILURE() << "no error for a missing column";
    } catch (const UsageError& err) {
        const std::string m = err.what();
        EXPECT_NE(m.find("key 'csv_url_column': " + (dir / "cols.csv").string() + " has no column 'url'"),
                  std::string::npos)
            << m;
        EXPECT_NE(m.find("'image', 'text'"), std::string::npos) << m;
    }
    // A row without a URL and a row with too many fields name their line.
    fs::write_file_atomic(dir / "rows.csv", "url,caption\n,no url\n");
    EXPECT_NE(
        data_error(csv_config(dir / "rows.csv", dir / "cache")).find("line 2 has no value in column 'url'"),
        std::string::npos);
    fs::write_file_atomic(dir / "rows.csv", "url,caption\n" + server.url("/good.png") + ",a, b\n");
    EXPECT_NE(data_error(csv_config(dir / "rows.csv", dir / "cache")).find("line 2 has 3 fields"),
              std::string::npos);
}

}  // namespace
}  // namespace test_csv_dataset_local
}  // namespace dtune::data

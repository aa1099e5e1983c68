// ObjectPrefetcher (bounded parallel read-ahead) and ListingCacheStorage
// (preserve_data_backend_cache) on local folders.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "data/listing_cache.h"
#include "data/prefetch.h"
#include "data/storage.h"
#include "support/test_support.h"

namespace dtune::data {
namespace test_prefetch_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

std::vector<std::string> names(int n) {
    std::vector<std::string> out;
    for (int i = 0; i < n; ++i) out.push_back("obj" + std::to_string(i));
    return out;
}

TEST(ObjectPrefetcher, FetchesInParallelWithinTheWindowAndKeepsOrder) {
    std::atomic<int> in_flight{0}, peak{0}, fetched{0};
    auto fetch = [&](const std::string& p) {
        const int now = ++in_flight;
        for (int seen = peak.load(); now > seen && !peak.compare_exchange_weak(seen, now);) {
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));  // a slow GET
        --in_flight;
        ++fetched;
        return "bytes of " + p;
    };
    ObjectPrefetcher ahead(names(40), fetch, 8);
    // Before anything is taken, at most the window is fetched.
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    EXPECT_EQ(fetched.load(), 8);
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < 40; ++i) EXPECT_EQ(ahead.take(size_t(i)), "bytes of obj" + std::to_string(i));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(peak.load(), 8);
    EXPECT_LE(ahead.peak_in_flight(), 8);
    // 32 remaining fetches of 20 ms, 8 at a time: ~80 ms; one at a time would be 640 ms.
    EXPECT_LT(s, 0.4) << "fetches did not overlap";
}

TEST(ObjectPrefetcher, OutOfOrderTakesAndErrorsOfOneObjectOnly) {
    auto fetch = [](const std::string& p) -> std::string {
        if (p == "obj3") throw DataError("obj3: HTTP 503");
        return p;
    };
    ObjectPrefetcher ahead(names(10), fetch, 2);
    // Taking a later index first must not deadlock: the window follows the lowest untaken one.
    std::thread late([&] { EXPECT_EQ(ahead.take(9), "obj9"); });
    for (size_t i = 0; i < 9; ++i) {
        if (i == 3) {
            EXPECT_THROW(ahead.take(i), DataError);
            continue;
        }
        EXPECT_EQ(ahead.take(i), "obj" + std::to_string(i));
    }
    late.join();
    EXPECT_THROW(ahead.take(0), Error);  // once only
}

TEST(ObjectPrefetcher, DestroyedEarlyJoinsItsThreads) {
    std::atomic<int> fetched{0};
    {
        ObjectPrefetcher ahead(
            names(100), [&](const std::string& p) { return ++fetched, p; }, 4);
        EXPECT_EQ(ahead.take(0), "obj0");
    }
    EXPECT_LE(fetched.load(), 5);  // the window, never the whole list
}

TEST(ListingCache, PreservedListingIsReusedUntilSwitchedOffOrInvalid) {
    test::TempDir dir;
    const auto images = dir / "images";
    std::filesystem::create_directories(images);
    fs::write_file_atomic(images / "a.png", "x");
    fs::write_file_atomic(images / "b.png", "x");
    const std::string listing = listing_cache_path((dir / "out").string(), "ds");
    EXPECT_EQ(std::filesystem::path(listing).filename(), "all_image_files_ds.json");
    auto local = std::make_shared<LocalStorage>();
    const std::vector<std::string> ext = {".png"};

    ListingCacheStorage first(local, listing, /*preserve=*/true);  // no listing stored yet
    EXPECT_EQ(first.list_files(images.string(), ext).size(), 2u);
    EXPECT_FALSE(first.reused());
    ASSERT_TRUE(std::filesystem::exists(listing));

    fs::write_file_atomic(images / "c.png", "x");
    ListingCacheStorage preserved(local, listing, true);
    EXPECT_EQ(preserved.list_files(images.string(), ext).size(), 2u);  // c.png not seen
    EXPECT_TRUE(preserved.reused());
    // Another folder or another filter: the stored listing does not apply.
    EXPECT_EQ(preserved.list_files(images.string(), {".png", ".jpg"}).size(), 3u);
    EXPECT_FALSE(preserved.reused());

    ListingCacheStorage off(local, listing, false);
    EXPECT_EQ(off.list_files(images.string(), ext).size(), 3u);
    EXPECT_FALSE(off.reused());
    ListingCacheStorage again(local, listing, true);  // the relisting was recorded
    EXPECT_EQ(again.list_files(images.string(), ext).size(), 3u);
    EXPECT_TRUE(again.reused());

    fs::write_file_atomic(listing, "{not json");
    ListingCacheStorage damaged(local, listing, true);
    EXPECT_EQ(damaged.list_files(images.string(), ext).size(), 3u);
    EXPECT_FALSE(damaged.reused());
}

TEST(LocalStorage, SymlinkLoopsAndRepeatedFolderLinksListEachImageOnce) {
    test::TempDir dir;
    const auto images = dir / "images";
    std::filesystem::create_directories(images / "sub");
    std::filesystem::create_directories(dir / "elsewhere");
    fs::write_file_atomic(images / "a.png", "x");
    fs::write_file_atomic(images / "sub" / "b.png", "x");
    fs::write_file_atomic(dir / "elsewhere" / "c.png", "x");
    std::filesystem::create_directory_symlink(".", images / "loop");                  // back to the root
    std::filesystem::create_directory_symlink("..", images / "sub" / "up");           // back up from below
    std::filesystem::create_directory_symlink(dir / "elsewhere", images / "linked");  // followed
    std::filesystem::create_directory_symlink(dir / "elsewhere", images / "linked_again");
    const auto listed = LocalStorage().list_files(images.string(), {".png"});
    // Before: a.png and sub/b.png at every depth of loop/loop/... until ELOOP (hundreds of paths).
    ASSERT_EQ(listed.size(), 3u) << listed.size() << " paths, first " << listed.front();
    EXPECT_EQ(std::filesystem::path(listed[0]).filename(), "a.png");
    EXPECT_EQ(std::filesystem::path(listed[1]).filename(), "c.png");
    const auto via = std::filesystem::path(listed[1]).parent_path().filename().string();
    EXPECT_TRUE(via == "linked" || via == "linked_again") << listed[1];  // whichever link comes first
    EXPECT_EQ(std::filesystem::path(listed[2]).filename(), "b.png");
}

// A folder the user cannot list (`lost+found`, a chmod 000 folder) is left out with one warning
// naming it, however often the dataset is listed; the readable images around it are all listed.
// Run as an unprivileged user: root lists a chmod 000 folder regardless.
TEST(LocalStorage, UnreadableFolderIsSkippedWithOneWarningNamingIt) {
    test::TempDir dir;
    std::filesystem::permissions(dir.path(), std::filesystem::perms(0755));
    const auto images = dir / "images";
    const auto locked = images / "lost+found";
    std::filesystem::create_directories(images / "sub");
    std::filesystem::create_directories(locked);
    fs::write_file_atomic(images / "a.png", "x");
    fs::write_file_atomic(images / "sub" / "b.png", "x");
    fs::write_file_atomic(locked / "c.png", "x");
    std::filesystem::permissions(locked, std::filesystem::perms::none);
    const auto log_file = dir / "child.log";  // written by the unprivileged child
    fs::write_file_atomic(log_file, "");
    std::filesystem::permissions(log_file, std::filesystem::perms(0666));
    const test::ChildRun child = test::run_unprivileged([&] {
        if (::access(locked.c_str(), R_OK) == 0) return 3;  // the folder must really be unreadable here
        log::set_stderr(false);
        log::set_file(log_file);
        std::vector<std::string> listed;
        for (int i = 0; i < 2; ++i) listed = LocalStorage().list_files(images.string(), {".png"});
        log::set_file({});
        if (listed.size() != 2) return 4;
        if (std::filesystem::path(listed[0]).filename() != "a.png") return 5;
        return 0;
    });
    std::filesystem::permissions(locked, std::filesystem::perms(0755));
    if (!child.skip_reason.empty()) GTEST_SKIP() << child.skip_reason;
    ASSERT_NE(child.exit_code, 3) << "the test could not make " << locked << " unreadable";
    // Before: 0 with no warning (skip_permission_denied left the folder out silently).
    ASSERT_EQ(child.exit_code, 0) << "see the child's stderr above";
    const std::string log = fs::read_file(log_file);
    const std::string warning = "not listing " + locked.string() + " under " + images.string();
    const auto first = log.find(warning);
    EXPECT_NE(first, std::string::npos) << log;
    EXPECT_EQ(log.find(warning, first + 1), std::string::npos) << "warned more than once:\n" << log;
}

}  // namespace
}  // namespace test_prefetch_local
}  // namespace dtune::data

#include <gtest/gtest.h>

#include <stdexcept>

#include "core/error.h"
#include "core/fs.h"
#include "support/test_support.h"

namespace dtune {

TEST(AtomicFile, CommitReplacesContent) {
    test::TempDir dir;
    const auto path = dir / "a/b/config.json";
    fs::write_file_atomic(path, "old");
    fs::write_file_atomic(path, "new content");
    EXPECT_EQ(fs::read_file(path), "new content");
    // No temp files left behind.
    int files = 0;
    for (auto& e : std::filesystem::directory_iterator(path.parent_path())) files += e.is_regular_file();
    EXPECT_EQ(files, 1);
}

TEST(AtomicFile, AbandonedWriteLeavesOldFileUntouched) {
    test::TempDir dir;
    const auto path = dir / "weights.bin";
    fs::write_file_atomic(path, "precious");
    std::filesystem::path temp;
    try {
        fs::AtomicFile f(path);
        temp = f.temp_path();
        f.write("half-writ");
        EXPECT_TRUE(std::filesystem::exists(temp));
        throw std::runtime_error("crash mid-write");
    } catch (const std::runtime_error&) {
    }
    EXPECT_EQ(fs::read_file(path), "precious");
    EXPECT_FALSE(std::filesystem::exists(temp));
}

TEST(AtomicFile, UnwritableDirectoryNamesThePath) {
    try {
        fs::AtomicFile f("/proc/no-such-dir/file");
        FAIL();
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find("/proc/no-such-dir/file"), std::string::npos);
    }
}

TEST(MappedFile, MapsContentAndReportsMissingFiles) {
    test::TempDir dir;
    fs::write_file_atomic(dir / "x", "abcdef");
    fs::MappedFile m(dir / "x");
    ASSERT_EQ(m.size(), 6u);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(m.data()), 6), "abcdef");
    // Private mapping: writes do not reach the file.
    m.mutable_data()[0] = 'Z';
    EXPECT_EQ(fs::read_file(dir / "x"), "abcdef");
    try {
        fs::MappedFile missing(dir / "nope.safetensors");
        FAIL();
    } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find("nope.safetensors"), std::string::npos);
    }
    EXPECT_THROW(fs::MappedFile(dir.path()), DataError);  // a directory
}

TEST(MappedFile, EmptyFileHasSizeZero) {
    test::TempDir dir;
    fs::write_file_atomic(dir / "empty", "");
    fs::MappedFile m(dir / "empty");
    EXPECT_EQ(m.size(), 0u);
}

}  // namespace dtune

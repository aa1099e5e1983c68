// Test helpers implementation.
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>

namespace dtune::test {

std::filesystem::path fixtures_dir() {
    std::filesystem::path dir = DTUNE_FIXTURES_DIR;
    if (const char* env = std::getenv("DTUNE_FIXTURES")) dir = env;
    if (!std::filesystem::is_directory(dir)) {
        ADD_FAILURE() << "reference fixtures not found at '" << dir.string()
                      << "'; set DTUNE_FIXTURES to the shared/fixtures folder";
    }
    return dir;
}

TempDir::TempDir() {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("dtune-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
}

TempDir::~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
}

void write_bytes(const std::filesystem::path& path, const std::string& bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace dtune::test

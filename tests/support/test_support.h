// Helpers shared by the test suites: fixture paths and scratch directories.
#pragma once

#include <filesystem>
#include <string>

namespace dtune::test {

// The shared reference fixtures folder (DTUNE_FIXTURES env, else the path CMake found). Fails
// the calling test with a clear message when it does not exist.
std::filesystem::path fixtures_dir();

// A fresh empty directory under the system temp dir, removed when the object goes away.
class TempDir {
  public:
    TempDir();
    ~TempDir();
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    const std::filesystem::path& path() const { return path_; }
    std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

  private:
    std::filesystem::path path_;
};

// Writes bytes to a file (not atomically: tests use this to build malformed inputs).
void write_bytes(const std::filesystem::path& path, const std::string& bytes);

}  // namespace dtune::test

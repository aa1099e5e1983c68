// File-system helpers whose job is to never leave a half-written file that is later trusted.
//
// AtomicFile writes to "<path>.tmp.<pid>.<n>" in the same directory, and commit() fsyncs the
// file, renames it over `path` and fsyncs the directory. A writer destroyed without commit()
// (an exception, a crash) removes its temp file, and the old `path` is untouched.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace dtune::fs {

namespace stdfs = std::filesystem;

class AtomicFile {
  public:
    explicit AtomicFile(stdfs::path path);
    ~AtomicFile();
    AtomicFile(const AtomicFile&) = delete;
    AtomicFile& operator=(const AtomicFile&) = delete;

    void write(const void* data, std::size_t size);
    void write(std::string_view text) { write(text.data(), text.size()); }
    uint64_t bytes_written() const { return written_; }
    // Flushes, fsyncs, renames into place and fsyncs the directory.
    void commit();

    const stdfs::path& path() const { return path_; }
    const stdfs::path& temp_path() const { return temp_; }

  private:
    stdfs::path path_;
    stdfs::path temp_;
    int fd_ = -1;
    uint64_t written_ = 0;
    bool committed_ = false;
};

// Writes the whole buffer atomically.
void write_file_atomic(const stdfs::path& path, std::string_view content);
// Reads a whole file; throws DataError naming the file when it cannot.
std::string read_file(const stdfs::path& path);
// fsync of a directory, so a rename inside it survives a power cut.
void sync_directory(const stdfs::path& dir);
// Creates `dir` (and its parents) and checks that this process may write into it; throws UsageError
// naming `key` (the config option that chose the folder) when it cannot. Called before any slow
// work, so an unwritable folder fails at start rather than deep inside a cache or checkpoint writer.
void require_writable_dir(const stdfs::path& dir, std::string_view key);

// A read-only view of a whole file through mmap. Pages are private copy-on-write, so a tensor
// that views this memory can be written to without touching the file.
class MappedFile {
  public:
    explicit MappedFile(const stdfs::path& path);
    ~MappedFile();
    MappedFile(const MappedFile&) = delete;
    MappedFile& operator=(const MappedFile&) = delete;

    const uint8_t* data() const { return static_cast<const uint8_t*>(data_); }
    uint8_t* mutable_data() { return static_cast<uint8_t*>(data_); }
    std::size_t size() const { return size_; }
    const stdfs::path& path() const { return path_; }

  private:
    stdfs::path path_;
    void* data_ = nullptr;
    std::size_t size_ = 0;
};

}  // namespace dtune::fs

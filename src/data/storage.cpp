// The local-folder storage backend.
#include "data/storage.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <utility>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "data/dataset_config.h"
#include "data/s3_storage.h"

namespace dtune::data {

namespace stdfs = std::filesystem;

std::string LocalStorage::read(const std::string& path) const {
    return fs::read_file(path);
}

void LocalStorage::write(const std::string& path, std::string_view bytes) {
    const stdfs::path p(path);
    if (p.has_parent_path()) stdfs::create_directories(p.parent_path());
    fs::write_file_atomic(p, bytes);
}

bool LocalStorage::exists(const std::string& path) const {
    std::error_code ec;
    return stdfs::exists(path, ec);
}

void LocalStorage::remove(const std::string& path) {
    std::error_code ec;
    stdfs::remove(path, ec);
}

namespace {

// errno of opening `dir` for listing; 0 when it can be listed.
int open_dir_error(const stdfs::path& dir) {
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) return errno;
    ::closedir(d);
    return 0;
}

// A folder that cannot be listed (`lost+found` seen by a user, a chmod 000 folder) is left out
// with one warning per folder per process, however many listings (discovery, the report) meet it.
void warn_unlistable_once(const stdfs::path& dir, const std::string& root, int error) {
    static std::mutex mutex;
    static std::set<std::string> warned;
    {
        std::lock_guard<std::mutex> lock(mutex);
        if (!warned.insert(dir.string()).second) return;
    }
    log::warn() << "not listing " << dir.string() << " under " << root << ": " << std::strerror(error)
                << "; its images (if any) are left out. Make it readable (chmod a+rx) or move it out of "
                   "the dataset folder to silence this";
}

}  // namespace

std::vector<std::string> LocalStorage::list_files(const std::string& root,
                                                  const std::vector<std::string>& extensions) const {
    std::error_code ec;
    if (!stdfs::is_directory(root, ec))
        throw DataError(str("'", root, "' is not a readable folder; check instance_data_dir"));
    if (const int error = open_dir_error(root))
        throw DataError(str("'", root, "' cannot be listed (", std::strerror(error),
                            "); make it readable for the user running dtune or check instance_data_dir"));
    std::vector<std::string> out;
    const auto options =
        stdfs::directory_options::follow_directory_symlink | stdfs::directory_options::skip_permission_denied;
    // Symlinked folders are followed, but each real folder is listed once: a link back up the tree
    // (`images/loop -> .`) would otherwise list every image again at each depth until ELOOP, and
    // two links to one folder would train its images twice.
    std::set<std::pair<dev_t, ino_t>> seen_dirs;
    const auto first_visit = [&](const stdfs::path& dir) {
        struct stat st {};
        if (::stat(dir.c_str(), &st) != 0) return true;  // the iterator reports what it cannot read
        return seen_dirs.emplace(st.st_dev, st.st_ino).second;
    };
    first_visit(root);
    for (auto it = stdfs::recursive_directory_iterator(root, options, ec); !ec && it != stdfs::end(it);
         it.increment(ec)) {
        if (it->is_directory(ec)) {
            // skip_permission_denied would leave such a folder out silently; say which one it is.
            if (const int error = open_dir_error(it->path())) {
                it.disable_recursion_pending();
                warn_unlistable_once(it->path(), root, error);
                continue;
            }
            if (!first_visit(it->path())) {
                it.disable_recursion_pending();
                log::warn() << "not listing " << it->path().string() << " under " << root
                            << ": it links to a folder already listed (a symlink loop or a second link to "
                               "the same folder); its images are used once";
            }
            continue;
        }
        if (!it->is_regular_file(ec)) continue;
        if (!extensions.empty()) {
            std::string ext = it->path().extension().string();
            std::transform(ext.begin(), ext.end(), ext.begin(),
                           [](unsigned char c) { return std::tolower(c); });
            if (std::find(extensions.begin(), extensions.end(), ext) == extensions.end()) continue;
        }
        out.push_back(stdfs::absolute(it->path()).lexically_normal().string());
    }
    if (ec) throw DataError(str("listing '", root, "' failed: ", ec.message()));
    std::sort(out.begin(), out.end());
    return out;
}

std::string LocalStorage::join(const std::string& root, const std::string& path) const {
    const stdfs::path p(path);
    return p.is_absolute() ? path : (stdfs::path(root) / p).lexically_normal().string();
}

std::optional<ObjectStat> LocalStorage::stat(const std::string& path) const {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
        if (errno == ENOENT || errno == ENOTDIR) return std::nullopt;
        throw DataError(str(path, ": cannot stat (", std::strerror(errno), ")"));
    }
    return ObjectStat{static_cast<uint64_t>(st.st_size), "source_mtime_ns",
                      std::to_string(int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec)};
}

std::optional<std::string> LocalStorage::read_if_exists(const std::string& path) const {
    std::error_code ec;
    if (!stdfs::exists(path, ec)) return std::nullopt;
    return fs::read_file(path);
}

std::vector<std::optional<std::string>> StorageBackend::read_many_if_exists(
    const std::vector<std::string>& paths) const {
    std::vector<std::optional<std::string>> out;
    out.reserve(paths.size());
    for (const auto& p : paths) out.push_back(read_if_exists(p));
    return out;
}

std::string StorageBackend::read_prefix(const std::string& path, std::size_t length) const {
    std::ifstream in(path, std::ios::binary);
    if (!in) return read(path);  // read() reports the failure with its own message
    std::string out(length, '\0');
    in.read(out.data(), static_cast<std::streamsize>(length));
    out.resize(static_cast<size_t>(in.gcount()));
    return out;
}

std::shared_ptr<StorageBackend> make_storage(const DatasetConfig& config) {
    if (config.type == StorageType::kAws) return make_s3_storage(config);
    return std::make_shared<LocalStorage>();
}

}  // namespace dtune::data

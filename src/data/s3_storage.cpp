// The `type: aws` storage backend over io::S3Client. See s3_storage.h.
#include "data/s3_storage.h"

#include "core/error.h"
#include "data/dataset_config.h"

#include <nlohmann/json.hpp>

#include <algorithm>

namespace dtune::data {
namespace {

const nlohmann::json* find_key(const DatasetConfig& config, const std::string& key, nlohmann::json& storage) {
    for (const auto& [k, text] : config.passthrough) {
        if (k != key) continue;
        storage = nlohmann::json::parse(text);
        return storage.is_null() ? nullptr : &storage;
    }
    return nullptr;
}

std::string string_key(const DatasetConfig& config, const std::string& key, bool secret = false) {
    nlohmann::json holder;
    const nlohmann::json* v = find_key(config, key, holder);
    if (!v) return {};
    DTUNE_CHECK_AS(UsageError, v->is_string(), "dataset '", config.id, "', key '", key,
                   "': expected a string", secret ? "" : str(", got ", v->dump()));
    return v->get<std::string>();
}

// "a//b/./c" -> "a/b/c"; no leading '/'.
std::string normalise_key(const std::string& path) {
    std::string out;
    std::size_t start = 0;
    while (start <= path.size()) {
        std::size_t end = path.find('/', start);
        if (end == std::string::npos) end = path.size();
        const std::string part = path.substr(start, end - start);
        if (!part.empty() && part != ".") out += (out.empty() ? "" : "/") + part;
        start = end + 1;
    }
    return out;
}

std::string as_folder(const std::string& prefix) {
    const std::string p = normalise_key(prefix);
    return p.empty() ? p : p + "/";
}

}  // namespace

io::S3Config s3_config_for(const DatasetConfig& config) {
    io::S3Config c;
    c.bucket = string_key(config, "aws_bucket_name");
    DTUNE_CHECK_AS(UsageError, !c.bucket.empty(), "dataset '", config.id,
                   "': \"type\": \"aws\" needs aws_bucket_name (the bucket's name)");
    c.region = string_key(config, "aws_region_name");
    c.endpoint = string_key(config, "aws_endpoint_url");
    c.credentials.access_key_id = string_key(config, "aws_access_key_id", true);
    c.credentials.secret_access_key = string_key(config, "aws_secret_access_key", true);
    c.credentials.session_token = string_key(config, "aws_session_token", true);
    nlohmann::json holder;
    if (const auto* v = find_key(config, "aws_max_pool_connections", holder)) {
        DTUNE_CHECK_AS(UsageError, v->is_number_integer() && v->get<long>() >= 1 && v->get<long>() <= 4096,
                       "dataset '", config.id,
                       "', key 'aws_max_pool_connections': expected an integer in [1, 4096], got ",
                       v->dump());
        c.max_connections = v->get<int>();
    } else {
        c.max_connections = 128;  // SimpleTuner's --aws_max_pool_connections default
    }
    return c;
}

std::string s3_data_prefix_for(const DatasetConfig& config) {
    return as_folder(string_key(config, "aws_data_prefix"));
}

int s3_prefetch_depth_for(const DatasetConfig& config) {
    nlohmann::json holder;
    if (const auto* v = find_key(config, "aws_prefetch_depth", holder)) {
        DTUNE_CHECK_AS(UsageError, v->is_number_integer() && v->get<long>() >= 1 && v->get<long>() <= 1024,
                       "dataset '", config.id,
                       "', key 'aws_prefetch_depth': expected an integer in [1, 1024], got ", v->dump());
        return v->get<int>();
    }
    return std::min(32, s3_config_for(config).max_connections);
}

S3Storage::S3Storage(io::S3Config config, std::string data_prefix, int prefetch_depth)
    : client_(std::move(config)),
      data_prefix_(as_folder(data_prefix)),
      prefetch_depth_(std::max(1, prefetch_depth)) {}

namespace {

// ETags come quoted from HEAD and XML-escaped or quoted from listings; compare the bare value.
std::string bare_etag(std::string etag) {
    for (const std::string q : {"&quot;", "\""}) {
        for (auto p = etag.find(q); p != std::string::npos; p = etag.find(q)) etag.erase(p, q.size());
    }
    return etag;
}

ObjectStat stat_of(const io::S3Object& o) {
    return {o.size, "source_etag", bare_etag(o.etag)};
}

}  // namespace

std::optional<ObjectStat> S3Storage::stat(const std::string& path) const {
    const std::string key = normalise_key(path);
    {
        std::lock_guard lock(stats_mutex_);
        if (auto it = stats_.find(key); it != stats_.end()) return it->second;
    }
    const auto head = client_.head(key);
    if (!head) return std::nullopt;
    ObjectStat s = stat_of(*head);
    std::lock_guard lock(stats_mutex_);
    stats_[key] = s;
    return s;
}

std::optional<std::string> S3Storage::read_if_exists(const std::string& path) const {
    return client_.get_if_exists(normalise_key(path));
}

std::vector<std::optional<std::string>> S3Storage::read_many_if_exists(
    const std::vector<std::string>& paths) const {
    std::vector<std::string> keys;
    keys.reserve(paths.size());
    for (const auto& p : paths) keys.push_back(normalise_key(p));
    return client_.get_many_if_exists(keys);
}

std::string S3Storage::location() const {
    return str("s3://", client_.bucket(), " at ", client_.endpoint().empty() ? "AWS" : client_.endpoint());
}

void S3Storage::remember_stats(const std::vector<std::pair<std::string, ObjectStat>>& stats) {
    std::lock_guard lock(stats_mutex_);
    for (const auto& [path, st] : stats) stats_[normalise_key(path)] = st;
}

std::vector<std::pair<std::string, ObjectStat>> S3Storage::listed_stats(
    const std::vector<std::string>& paths) const {
    std::vector<std::pair<std::string, ObjectStat>> out;
    std::lock_guard lock(stats_mutex_);
    for (const auto& p : paths)
        if (auto it = stats_.find(normalise_key(p)); it != stats_.end()) out.emplace_back(p, it->second);
    return out;
}

std::string S3Storage::read(const std::string& path) const {
    return client_.get(normalise_key(path));
}

std::vector<std::string> S3Storage::read_many(const std::vector<std::string>& paths) const {
    std::vector<std::string> keys;
    keys.reserve(paths.size());
    for (const auto& p : paths) keys.push_back(normalise_key(p));
    return client_.get_many(keys);
}

std::string S3Storage::read_prefix(const std::string& path, std::size_t length) const {
    return client_.get_range(normalise_key(path), 0, length);
}

void S3Storage::write(const std::string& path, std::string_view bytes) {
    client_.put(normalise_key(path), bytes);
}

bool S3Storage::exists(const std::string& path) const {
    return client_.head(normalise_key(path)).has_value();
}

void S3Storage::remove(const std::string& path) {
    client_.remove(normalise_key(path));
}

std::vector<std::string> S3Storage::list_files(const std::string& root,
                                               const std::vector<std::string>& extensions) const {
    const std::string prefix = root.empty() ? data_prefix_ : as_folder(root);
    std::vector<std::string> out;
    const std::vector<io::S3Object> objects = client_.list(prefix);
    {
        std::lock_guard lock(stats_mutex_);
        for (const auto& object : objects) stats_[object.key] = stat_of(object);
    }
    for (const auto& object : objects) {
        if (object.key.empty() || object.key.back() == '/') continue;  // "folder" marker objects
        if (!extensions.empty()) {
            const auto dot = object.key.rfind('.');
            const auto slash = object.key.rfind('/');
            if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) continue;
            std::string ext = object.key.substr(dot);
            std::transform(ext.begin(), ext.end(), ext.begin(),
                           [](unsigned char ch) { return std::tolower(ch); });
            if (std::find(extensions.begin(), extensions.end(), ext) == extensions.end()) continue;
        }
        out.push_back(object.key);
    }
    return out;  // S3Client::list returns keys sorted
}

std::string S3Storage::join(const std::string& root, const std::string& path) const {
    if (!path.empty() && path.front() == '/') return normalise_key(path);
    return normalise_key(root + "/" + path);
}

std::shared_ptr<StorageBackend> make_s3_storage(const DatasetConfig& config) {
    const io::S3Config c = s3_config_for(config);
    const std::string prefix = s3_data_prefix_for(config);
    const int depth = s3_prefetch_depth_for(config);
    // The registry key holds the credentials (in memory only) so two entries with other
    // credentials never share a client.
    const std::string key = str(c.bucket, '\0', c.endpoint, '\0', c.region, '\0', c.credentials.access_key_id,
                                '\0', c.credentials.secret_access_key, '\0', c.credentials.session_token,
                                '\0', c.max_connections, '\0', prefix, '\0', depth);
    static std::mutex mutex;
    // Kept for the life of the process: the listing's stats must outlive the listing's caller.
    static std::map<std::string, std::shared_ptr<StorageBackend>> registry;
    std::lock_guard lock(mutex);
    auto& slot = registry[key];
    if (!slot) slot = std::make_shared<S3Storage>(c, prefix, depth);
    return slot;
}

}  // namespace dtune::data

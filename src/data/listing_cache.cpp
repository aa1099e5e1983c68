// The stored dataset listing behind preserve_data_backend_cache. See listing_cache.h.
#include "data/listing_cache.h"

#include <nlohmann/json.hpp>

#include <filesystem>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"

namespace dtune::data {

using nlohmann::json;

namespace {

constexpr int kListingVersion = 1;

// The stored files when `doc` was written for this location, root and filter; nullopt otherwise.
std::optional<std::vector<std::pair<std::string, std::optional<ObjectStat>>>> stored_files(
    const json& doc, const std::string& location, const std::string& root,
    const std::vector<std::string>& ext) {
    if (doc.value("dtune_listing_version", 0) != kListingVersion || doc.value("location", "") != location ||
        doc.value("root", "") != root || doc.value("extensions", std::vector<std::string>{}) != ext)
        return std::nullopt;
    std::vector<std::pair<std::string, std::optional<ObjectStat>>> out;
    for (const auto& f : doc.at("files")) {
        std::optional<ObjectStat> st;
        if (f.contains("size"))
            st = ObjectStat{f.at("size").get<uint64_t>(), f.at("version_name").get<std::string>(),
                            f.at("version").get<std::string>()};
        out.emplace_back(f.at("path").get<std::string>(), st);
    }
    return out;
}

}  // namespace

std::string listing_cache_path(const std::string& output_dir, const std::string& dataset_id) {
    return (std::filesystem::path(output_dir) / ("all_image_files_" + dataset_id + ".json")).string();
}

ListingCacheStorage::ListingCacheStorage(std::shared_ptr<StorageBackend> inner, std::string path,
                                         bool preserve)
    : inner_(std::move(inner)), path_(std::move(path)), preserve_(preserve) {}

std::vector<std::string> ListingCacheStorage::list_files(const std::string& root,
                                                         const std::vector<std::string>& extensions) const {
    reused_ = false;
    const std::string location = inner_->location();
    if (preserve_ && std::filesystem::exists(path_)) {
        try {
            if (auto files = stored_files(json::parse(fs::read_file(path_)), location, root, extensions)) {
                std::vector<std::string> paths;
                std::vector<std::pair<std::string, ObjectStat>> stats;
                for (auto& [p, st] : *files) {
                    paths.push_back(p);
                    if (st) stats.emplace_back(p, *st);
                }
                inner_->remember_stats(stats);
                reused_ = true;
                log::info() << "preserve_data_backend_cache: " << paths.size() << " files of " << location
                            << " from " << path_ << " (not relisted; delete it to see new files)";
                return paths;
            }
            log::info() << path_ << " was written for another location, folder or filter; relisting";
        } catch (const std::exception& e) {
            log::warn() << path_ << " is unreadable (" << e.what() << "); relisting";
        }
    }
    std::vector<std::string> files = inner_->list_files(root, extensions);
    json list = json::array();
    std::map<std::string, ObjectStat> stats;
    for (auto& [p, st] : inner_->listed_stats(files)) stats.emplace(p, st);
    for (const auto& f : files) {
        json item = {{"path", f}};
        if (auto it = stats.find(f); it != stats.end())
            item.update({{"size", it->second.size},
                         {"version_name", it->second.version_name},
                         {"version", it->second.version}});
        list.push_back(std::move(item));
    }
    const json doc = {{"dtune_listing_version", kListingVersion},
                      {"location", location},
                      {"root", root},
                      {"extensions", extensions},
                      {"files", list}};
    try {
        std::filesystem::create_directories(std::filesystem::path(path_).parent_path());
        fs::write_file_atomic(path_, doc.dump());
    } catch (const std::exception& e) {
        log::warn() << "could not store the listing in " << path_ << " (" << e.what()
                    << "); preserve_data_backend_cache will relist next time";
    }
    return files;
}

}  // namespace dtune::data

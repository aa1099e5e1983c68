// safetensors reading (mmap, zero-copy) and writing (atomic), single files and sharded sets.
#include "io/safetensors.h"

#include <ATen/ATen.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/fs.h"

namespace dtune::io {
namespace stdfs = std::filesystem;

c10::ScalarType to_torch_dtype(StDType dtype) {
    switch (dtype) {
        case StDType::F64: return at::kDouble;
        case StDType::F32: return at::kFloat;
        case StDType::F16: return at::kHalf;
        case StDType::BF16: return at::kBFloat16;
        case StDType::F8_E4M3: return at::ScalarType::Float8_e4m3fn;
        case StDType::F8_E5M2: return at::ScalarType::Float8_e5m2;
        case StDType::I64: return at::kLong;
        case StDType::I32: return at::kInt;
        case StDType::I16: return at::kShort;
        case StDType::I8: return at::kChar;
        case StDType::U8: return at::kByte;
        case StDType::BOOL: return at::kBool;
    }
    throw Error("unreachable safetensors dtype");
}

StDType from_torch_dtype(c10::ScalarType dtype, const std::string& tensor_name) {
    switch (dtype) {
        case at::kDouble: return StDType::F64;
        case at::kFloat: return StDType::F32;
        case at::kHalf: return StDType::F16;
        case at::kBFloat16: return StDType::BF16;
        case at::ScalarType::Float8_e4m3fn: return StDType::F8_E4M3;
        case at::ScalarType::Float8_e5m2: return StDType::F8_E5M2;
        case at::kLong: return StDType::I64;
        case at::kInt: return StDType::I32;
        case at::kShort: return StDType::I16;
        case at::kChar: return StDType::I8;
        case at::kByte: return StDType::U8;
        case at::kBool: return StDType::BOOL;
        default: break;
    }
    throw DataError(str("tensor '", tensor_name, "' has dtype ", c10::toString(dtype),
                        ", which safetensors cannot store; convert it (e.g. to float32) before saving"));
}

// ---- single file ------------------------------------------------------------------------------

SafetensorsFile::SafetensorsFile(const stdfs::path& path) : path_(path) {
    map_ = std::make_shared<fs::MappedFile>(path);
    header_ = parse_safetensors_header(map_->data(), map_->size(), map_->size(), path.string());
    for (std::size_t i = 0; i < header_.tensors.size(); ++i) index_[header_.tensors[i].name] = i;
}

std::vector<std::string> SafetensorsFile::keys() const {
    std::vector<std::string> out;
    out.reserve(index_.size());
    for (const auto& [name, _] : index_) out.push_back(name);
    return out;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
    auto it = index_.find(name);
    if (it == index_.end())
        throw DataError(str("tensor '", name, "' is not in '", path_.string(), "' (", index_.size(),
                            " tensors); check the model folder and the key name"));
    return header_.tensors[it->second];
}

at::Tensor SafetensorsFile::get(const std::string& name) const {
    const TensorInfo& t = info(name);
    const auto dtype = to_torch_dtype(t.dtype);
    uint8_t* data = map_->mutable_data() + header_.data_offset + t.begin;
    const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
    if (t.nbytes() == 0) return at::empty(t.shape, options);
    if (reinterpret_cast<uintptr_t>(data) % st_dtype_size(t.dtype) != 0) {
        // Misaligned for the element type: copy into an aligned buffer.
        at::Tensor out = at::empty(t.shape, options);
        std::memcpy(out.data_ptr(), data, t.nbytes());
        return out;
    }
    auto keep_alive = map_;
    return at::from_blob(
        data, t.shape, [keep_alive](void*) mutable { keep_alive.reset(); }, options);
}

void SafetensorsFile::release(const at::Tensor& view) const {
    if (!view.defined() || view.numel() == 0 || !view.device().is_cpu()) return;
    // The byte extent of the view: its first element plus the farthest element along each axis.
    int64_t last = 0;
    for (int64_t d = 0; d < view.dim(); ++d) {
        if (view.stride(d) < 0) return;
        last += (view.size(d) - 1) * view.stride(d);
    }
    const auto* begin = static_cast<const uint8_t*>(view.const_data_ptr());
    const auto* end = begin + (last + 1) * static_cast<int64_t>(view.element_size());
    const uint8_t* map_begin = map_->data();
    if (begin < map_begin || end > map_begin + map_->size()) return;  // not ours (e.g. a misaligned copy)
    // Only whole pages inside the view: a page shared with a neighbouring tensor stays.
    const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    const uintptr_t first = (reinterpret_cast<uintptr_t>(begin) + page - 1) / page * page;
    const uintptr_t stop = reinterpret_cast<uintptr_t>(end) / page * page;
    if (stop > first) ::madvise(reinterpret_cast<void*>(first), stop - first, MADV_DONTNEED);
}

TensorList load_safetensors(const stdfs::path& path) {
    SafetensorsFile file(path);
    TensorList out;
    for (const auto& name : file.keys()) out.emplace_back(name, file.get(name));
    return out;
}

void save_safetensors(const stdfs::path& path, const TensorList& tensors, const Metadata& metadata) {
    std::vector<TensorInfo> infos;
    std::set<std::string> seen;
    uint64_t offset = 0;
    for (const auto& [name, tensor] : tensors) {
        DTUNE_CHECK(seen.insert(name).second, "tensor name '", name, "' appears twice in the list saved to '",
                    path.string(), "'");
        DTUNE_CHECK(tensor.defined(), "tensor '", name, "' is undefined and cannot be saved to '",
                    path.string(), "'");
        TensorInfo info;
        info.name = name;
        info.dtype = from_torch_dtype(tensor.scalar_type(), name);
        info.shape = tensor.sizes().vec();
        info.begin = offset;
        info.end =
            offset + static_cast<uint64_t>(tensor.numel()) * static_cast<uint64_t>(tensor.element_size());
        offset = info.end;
        infos.push_back(std::move(info));
    }
    fs::AtomicFile file(path);
    file.write(build_safetensors_header(infos, metadata));
    // One tensor in host memory at a time (a GPU tensor is copied over just before it is written):
    // a 12 B model's 24 GB of weights no longer need 24 GB of host memory on top of the file.
    for (const auto& [name, tensor] : tensors) {
        const at::Tensor c = tensor.detach().to(at::kCPU).contiguous();
        file.write(c.data_ptr(), c.nbytes());
    }
    file.commit();
}

// ---- sharded sets -----------------------------------------------------------------------------

namespace {

stdfs::path find_weights_in_dir(const stdfs::path& dir, const std::string& stem) {
    std::vector<stdfs::path> indexes, singles;
    for (const auto& entry : stdfs::directory_iterator(dir)) {
        const std::string name = entry.path().filename().string();
        if (!stem.empty() && name.rfind(stem, 0) != 0) continue;
        if (name.size() > 23 && name.ends_with(".safetensors.index.json"))
            indexes.push_back(entry.path());
        else if (name.ends_with(".safetensors") && name.find("-of-") == std::string::npos)
            singles.push_back(entry.path());
    }
    std::sort(indexes.begin(), indexes.end());
    std::sort(singles.begin(), singles.end());
    const std::string what = stem.empty() ? "*.safetensors" : stem + ".safetensors";
    if (indexes.size() == 1) return indexes[0];
    if (indexes.empty() && singles.size() == 1) return singles[0];
    if (indexes.empty() && singles.empty())
        throw DataError(str("no ", what, " (or its .index.json) in '", dir.string(),
                            "'; check the folder, or convert .bin weights to safetensors"));
    throw DataError(str("'", dir.string(), "' holds several candidate weight files for ", what,
                        "; pass the file itself instead of the folder"));
}

}  // namespace

WeightSource WeightSource::open(const stdfs::path& path, const std::string& stem) {
    std::error_code ec;
    if (!stdfs::exists(path, ec))
        throw DataError(str("weights path '", path.string(), "' does not exist; check the model path"));
    if (stdfs::is_directory(path)) return open(find_weights_in_dir(path, stem));

    WeightSource src;
    const std::string name = path.filename().string();
    if (name.ends_with(".index.json")) {
        nlohmann::json index = nlohmann::json::parse(fs::read_file(path), nullptr, false);
        if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") ||
            !index["weight_map"].is_object())
            throw DataError(str("sharded index '", path.string(),
                                "' is not JSON with a \"weight_map\" object; ",
                                "the file is corrupt: re-download or re-export the model"));
        std::map<std::string, std::size_t> shard_of_file;
        for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
            if (!it->is_string())
                throw DataError(str("sharded index '", path.string(), "': weight_map entry '", it.key(),
                                    "' is not a file name"));
            const std::string file = it->get<std::string>();
            auto [pos, inserted] = shard_of_file.emplace(file, src.files_.size());
            if (inserted) src.files_.push_back(path.parent_path() / file);
            src.where_[it.key()] = pos->second;
        }
        for (const auto& f : src.files_) src.shards_.push_back(std::make_shared<SafetensorsFile>(f));
        for (const auto& [key, shard] : src.where_)
            if (!src.shards_[shard]->contains(key))
                throw DataError(str("sharded index '", path.string(), "' puts '", key, "' in '",
                                    src.files_[shard].filename().string(),
                                    "' but that shard does not hold it"));
        if (index.contains("metadata") && index["metadata"].is_object())
            for (auto it = index["metadata"].begin(); it != index["metadata"].end(); ++it)
                src.metadata_[it.key()] = it->is_string() ? it->get<std::string>() : it->dump();
        return src;
    }
    src.files_.push_back(path);
    src.shards_.push_back(std::make_shared<SafetensorsFile>(path));
    for (const auto& key : src.shards_[0]->keys()) src.where_[key] = 0;
    src.metadata_ = src.shards_[0]->metadata();
    return src;
}

std::vector<std::string> WeightSource::keys() const {
    std::vector<std::string> out;
    for (const auto& [name, _] : where_) out.push_back(name);
    return out;
}

const TensorInfo& WeightSource::info(const std::string& name) const {
    auto it = where_.find(name);
    if (it == where_.end())
        throw DataError(str("tensor '", name, "' is not in '", files_.empty() ? "" : files_[0].string(), "'",
                            files_.size() > 1 ? " or its other shards" : "",
                            "; check the model and the key name"));
    return shards_[it->second]->info(name);
}

at::Tensor WeightSource::get(const std::string& name) const {
    info(name);  // throws a clear error for a missing key
    return shards_[where_.at(name)]->get(name);
}

void WeightSource::release(const at::Tensor& view) const {
    for (const auto& shard : shards_) shard->release(view);
}

uint64_t WeightSource::total_bytes() const {
    uint64_t total = 0;
    for (const auto& s : shards_)
        for (const auto& t : s->header().tensors) total += t.nbytes();
    return total;
}

std::vector<stdfs::path> save_sharded_safetensors(const stdfs::path& dir, const std::string& stem,
                                                  const TensorList& tensors, uint64_t max_shard_bytes,
                                                  const Metadata& metadata) {
    DTUNE_CHECK(max_shard_bytes > 0, "max_shard_bytes must be positive");
    std::vector<TensorList> shards(1);
    uint64_t current = 0, total = 0;
    for (const auto& item : tensors) {
        const uint64_t n = static_cast<uint64_t>(item.second.nbytes());
        if (current > 0 && current + n > max_shard_bytes) {
            shards.emplace_back();
            current = 0;
        }
        shards.back().push_back(item);
        current += n;
        total += n;
    }
    stdfs::create_directories(dir);
    if (shards.size() == 1) {
        const stdfs::path file = dir / (stem + ".safetensors");
        save_safetensors(file, tensors, metadata);
        return {file};
    }
    std::vector<stdfs::path> written;
    nlohmann::json weight_map = nlohmann::json::object();
    const std::size_t n = shards.size();
    for (std::size_t i = 0; i < n; ++i) {
        char name[64];
        std::snprintf(name, sizeof name, "-%05zu-of-%05zu.safetensors", i + 1, n);
        const stdfs::path file = dir / (stem + name);
        save_safetensors(file, shards[i], metadata);
        for (const auto& [key, _] : shards[i]) weight_map[key] = file.filename().string();
        written.push_back(file);
    }
    nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    for (const auto& [k, v] : metadata) index["metadata"][k] = v;
    const stdfs::path index_file = dir / (stem + ".safetensors.index.json");
    // The index is written last: a set without its index is never mistaken for a complete one.
    fs::write_file_atomic(index_file, index.dump(2) + "\n");
    written.push_back(index_file);
    return written;
}

}  // namespace dtune::io

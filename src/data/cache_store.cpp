// Latent and text-embedding cache entries: in-memory safetensors (de)serialisation with a data
// CRC, the content keys, and verification against the live inputs.
#include "data/cache_store.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "core/error.h"
#include "core/fs.h"
#include "core/thread_pool.h"
#include "data/sample_variants.h"
#include "io/safetensors.h"

namespace dtune::data {
namespace {

// "a, b, c".
std::string join(const std::vector<std::string>& parts, const char* separator) {
    std::string out;
    for (const auto& p : parts) out += (out.empty() ? "" : separator) + p;
    return out;
}

std::string size_text(Size s) {
    return str(s.width, "x", s.height);
}

std::string opt_text(const std::optional<double>& v) {
    return v ? python_float_str(*v) : "none";
}

// Compares an entry's metadata with the expected values: a different key means the inputs
// changed (stale); a matching key with any other mismatch means damage (corrupt).
EntryLookup verify_metadata(const std::map<std::string, std::string>& got,
                            const std::map<std::string, std::string>& want) {
    auto value = [&](const std::string& k) {
        auto it = got.find(k);
        return it == got.end() ? std::string("<absent>") : it->second;
    };
    if (value("format") != want.at("format") || value("format_version") != want.at("format_version"))
        return {EntryStatus::kStale,
                str("format ", value("format"), " v", value("format_version"), " is not ", want.at("format"),
                    " v", want.at("format_version")),
                {}};
    if (value("key") != want.at("key"))
        return {EntryStatus::kStale, "built from other inputs (key differs)", {}};
    for (const auto& [k, v] : want)
        if (value(k) != v)
            return {
                EntryStatus::kCorrupt, str("metadata ", k, " is '", value(k), "', expected '", v, "'"), {}};
    return {EntryStatus::kValid, "", {}};
}

// Parses fetched entry bytes; kMissing when absent, kCorrupt when they do not parse.
EntryLookup parse_fetched(const std::optional<std::string>& bytes, const std::string& name,
                          std::vector<std::pair<std::string, at::Tensor>>* tensors,
                          std::map<std::string, std::string>* metadata) {
    if (!bytes) return {EntryStatus::kMissing, "", {}};
    try {
        *tensors = parse_entry(decompress_cache_bytes(*bytes, name), name, metadata);
    } catch (const DataError& e) {
        return {EntryStatus::kCorrupt, e.what(), {}};
    }
    return {EntryStatus::kValid, "", {}};
}

std::shared_ptr<StorageBackend> or_local(std::shared_ptr<StorageBackend> storage) {
    return storage ? storage : std::make_shared<LocalStorage>();
}

}  // namespace

const char* to_string(EntryStatus status) {
    switch (status) {
        case EntryStatus::kValid: return "valid";
        case EntryStatus::kMissing: return "missing";
        case EntryStatus::kStale: return "stale";
        case EntryStatus::kCorrupt: return "corrupt";
    }
    return "?";
}

std::string dataset_settings_text(const DatasetConfig& c) {
    std::ostringstream o;
    o << "resolution=" << python_float_str(c.resolution)
      << "\nresolution_type=" << to_string(c.resolution_type) << "\ncrop=" << (c.crop ? "true" : "false")
      << "\ncrop_style=" << to_string(c.crop_style) << "\ncrop_aspect=" << to_string(c.crop_aspect)
      << "\ncrop_aspect_buckets=";
    for (const auto& b : c.crop_aspect_buckets)
        o << python_float_str(b.aspect) << (b.weight ? ":" + python_float_str(*b.weight) : "") << ",";
    o << "\nmaximum_image_size=" << opt_text(c.maximum_image_size)
      << "\ntarget_downsample_size=" << opt_text(c.target_downsample_size)
      << "\nmax_upscale_threshold=" << opt_text(c.max_upscale_threshold) << "\n";
    return o.str();
}

LatentCacheSettings latent_cache_settings(const DatasetConfig& config, const std::string& encoder_identity) {
    LatentCacheSettings s;
    s.cache_dir = config.cache_dir_vae;
    s.data_root = config.instance_data_dir;
    s.encoder_identity = encoder_identity;
    s.dataset_settings = dataset_settings_text(config);
    s.compression = config.compress_cache ? CacheCompression::kZstd : CacheCompression::kNone;
    s.size_in_name = rebuckets_per_epoch(config);
    return s;
}

std::string serialize_entry(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                            std::map<std::string, std::string> metadata) {
    std::vector<io::TensorInfo> infos;
    std::string data;
    for (const auto& [name, t] : tensors) {
        const at::Tensor c = t.detach().to(at::kCPU).contiguous();
        io::TensorInfo info;
        info.name = name;
        info.dtype = io::from_torch_dtype(c.scalar_type(), name);
        info.shape = c.sizes().vec();
        info.begin = data.size();
        data.append(static_cast<const char*>(c.data_ptr()), c.nbytes());
        info.end = data.size();
        infos.push_back(std::move(info));
    }
    metadata["data_crc32"] = std::to_string(crc32_of(data));
    return io::build_safetensors_header(infos, metadata) + data;
}

std::vector<std::pair<std::string, at::Tensor>> parse_entry(const std::string& bytes, const std::string& file,
                                                            std::map<std::string, std::string>* metadata) {
    const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
    const io::SafetensorsHeader header = io::parse_safetensors_header(p, bytes.size(), bytes.size(), file);
    uint64_t used = 0;
    for (const auto& t : header.tensors) used = std::max(used, t.end);
    const std::string_view data(bytes.data() + header.data_offset, header.data_size);
    auto crc = header.metadata.find("data_crc32");
    if (used != header.data_size || crc == header.metadata.end() ||
        crc->second != std::to_string(crc32_of(data)))
        throw DataError(
            str(file, ": data checksum mismatch (damaged or truncated entry); it will be rebuilt"));
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& t : header.tensors) {
        at::Tensor v = at::empty(t.shape, at::TensorOptions().dtype(io::to_torch_dtype(t.dtype)));
        std::memcpy(v.data_ptr(), data.data() + t.begin, t.nbytes());
        out.emplace_back(t.name, std::move(v));
    }
    if (metadata) *metadata = header.metadata;
    return out;
}

LatentCache::LatentCache(LatentCacheSettings settings) : settings_(std::move(settings)) {
    DTUNE_CHECK_AS(UsageError, !settings_.cache_dir.empty(),
                   "the latent cache needs a directory; set cache_dir_vae in the dataset entry");
    settings_.storage = or_local(settings_.storage);
    settings_.images = or_local(settings_.images);
}

ObjectStat LatentCache::stamp_of(const std::string& image_path) const {
    std::optional<ObjectStat> st = settings_.images->stat(image_path);
    if (!st)
        throw DataError(str(image_path, ": the image is gone from ", settings_.images->location(),
                            "; restore the file or refresh the bucket index"));
    return *st;
}

std::filesystem::path LatentCache::entry_path(const std::string& image_path) const {
    return entry_path(LatentRequest{image_path, {}, false});
}

std::filesystem::path LatentCache::entry_path(const LatentRequest& request) const {
    const std::filesystem::path image(request.path);
    std::filesystem::path sub;
    if (!settings_.data_root.empty()) {
        const auto rel = image.lexically_relative(settings_.data_root);
        if (!rel.empty() && *rel.begin() != "..") sub = rel.parent_path();
    }
    std::string variant;
    if (settings_.size_in_name) variant += "-" + geometry_key(request.plan);
    if (request.flip) variant += "-flip";
    return std::filesystem::path(settings_.cache_dir) / sub /
           (sha256_hex(image.stem().string()) + variant + ".safetensors");
}

std::string LatentCache::key_text(const LatentRequest& r) const {
    return key_text(r, stamp_of(r.path));
}

std::string LatentCache::key_text(const LatentRequest& r, const ObjectStat& stamp) const {
    const SamplePlan& p = r.plan;
    std::ostringstream o;
    o << kLatentFormat << " v" << kCacheFormatVersion << "\nsource=" << r.path
      << "\nsource_size=" << stamp.size << "\n"
      << stamp.version_name << "=" << stamp.version << "\nencoder=" << settings_.encoder_identity << "\n"
      << settings_.dataset_settings << "original=" << size_text(p.original)
      << "\nintermediary=" << size_text(p.intermediary) << "\nresize=" << size_text(p.resize_size)
      << "\ntarget=" << size_text(p.target) << "\ncrop=" << p.crop_top << "," << p.crop_left
      << "\nflip=" << (r.flip ? 1 : 0) << "\n";
    return o.str();
}

std::map<std::string, std::string> LatentCache::expected_metadata(const LatentRequest& r) const {
    const ObjectStat stamp = stamp_of(r.path);
    return {{"format", kLatentFormat},
            {"format_version", std::to_string(kCacheFormatVersion)},
            {"key", sha256_hex(key_text(r, stamp))},
            {"source", r.path},
            {"source_size", std::to_string(stamp.size)},
            {stamp.version_name, stamp.version},
            {"settings_sha256", sha256_hex(settings_.dataset_settings)},
            {"encoder", settings_.encoder_identity},
            {"original_size", size_text(r.plan.original)},
            {"intermediary_size", size_text(r.plan.intermediary)},
            {"resize_size", size_text(r.plan.resize_size)},
            {"target_size", size_text(r.plan.target)},
            {"crop_coords", str(r.plan.crop_top, ",", r.plan.crop_left)},
            {"flip", r.flip ? "true" : "false"}};
}

EntryLookup LatentCache::load(const LatentRequest& r) const {
    return verify(r, settings_.storage->read_if_exists(entry_path(r).string()));
}

std::vector<EntryLookup> LatentCache::load_many(const std::vector<const LatentRequest*>& requests,
                                                ThreadPool& pool) const {
    std::vector<EntryLookup> out(requests.size());
    auto one = [&](size_t i, const std::optional<std::string>& bytes) {
        try {
            out[i] = verify(*requests[i], bytes);
        } catch (const DataError& e) {  // the image is gone: reported by whoever decodes it
            out[i] = {EntryStatus::kMissing, e.what(), {}};
        }
    };
    if (!settings_.storage->remote()) {
        pool.parallel_for(requests.size(), [&](size_t i) {
            std::optional<std::string> bytes;
            try {
                bytes = settings_.storage->read_if_exists(entry_path(*requests[i]).string());
            } catch (const std::exception& e) {
                out[i] = {EntryStatus::kCorrupt, e.what(), {}};
                return;
            }
            one(i, bytes);
        });
        return out;
    }
    constexpr size_t kChunk = 256;  // bounds the fetched bytes held at once
    for (size_t begin = 0; begin < requests.size(); begin += kChunk) {
        const size_t end = std::min(requests.size(), begin + kChunk);
        std::vector<std::string> paths;
        for (size_t i = begin; i < end; ++i) paths.push_back(entry_path(*requests[i]).string());
        const auto fetched = settings_.storage->read_many_if_exists(paths);
        pool.parallel_for(end - begin, [&](size_t k) { one(begin + k, fetched[k]); });
    }
    return out;
}

EntryLookup LatentCache::verify(const LatentRequest& r, const std::optional<std::string>& bytes) const {
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    std::map<std::string, std::string> metadata;
    const auto path = entry_path(r);
    EntryLookup result = parse_fetched(bytes, path.string(), &tensors, &metadata);
    if (result.status != EntryStatus::kValid) return result;
    result = verify_metadata(metadata, expected_metadata(r));
    if (result.status != EntryStatus::kValid) return result;
    const std::vector<int64_t> want = {settings_.latent_channels, r.plan.target.height / settings_.downsample,
                                       r.plan.target.width / settings_.downsample};
    if (tensors.size() != 1 || tensors[0].first != "latents" || tensors[0].second.sizes().vec() != want)
        return {EntryStatus::kCorrupt,
                str(path.string(), ": expected one tensor 'latents' of shape [", want[0], ", ", want[1], ", ",
                    want[2], "]"),
                {}};
    result.value = tensors[0].second;
    return result;
}

void LatentCache::store(const LatentRequest& r, const at::Tensor& latents) const {
    const std::vector<int64_t> want = {settings_.latent_channels, r.plan.target.height / settings_.downsample,
                                       r.plan.target.width / settings_.downsample};
    DTUNE_CHECK(latents.sizes().vec() == want, r.path, ": the encoder returned latents of shape ",
                latents.sizes(), ", expected [", want[0], ", ", want[1], ", ", want[2],
                "]; check the VAE's latent_channels");
    auto metadata = expected_metadata(r);
    metadata["dtype"] = c10::toString(latents.scalar_type());
    settings_.storage->write(
        entry_path(r).string(),
        compress_cache_bytes(serialize_entry({{"latents", latents}}, std::move(metadata)),
                             settings_.compression));
}

TextEmbedCache::TextEmbedCache(TextCacheSettings settings) : settings_(std::move(settings)) {
    DTUNE_CHECK_AS(UsageError, !settings_.cache_dir.empty(),
                   "the text embedding cache needs a directory; set cache_dir in the text_embeds entry");
    settings_.storage = or_local(settings_.storage);
}

std::filesystem::path TextEmbedCache::entry_path(const std::string& caption) const {
    // The encoders' identity is in the name, not only in the key: two models caching into one
    // folder keep separate entries instead of rebuilding (and overwriting) each other's.
    return std::filesystem::path(settings_.cache_dir) /
           (sha256_hex(caption).substr(0, 32) + "-" + settings_.model_family + "-" +
            sha256_hex(settings_.encoder_identity).substr(0, 12) + ".safetensors");
}

std::map<std::string, std::string> TextEmbedCache::expected_metadata(const std::string& caption) const {
    return {{"format", kTextEmbedFormat},
            {"format_version", std::to_string(kCacheFormatVersion)},
            {"key", sha256_hex(settings_.encoder_identity + '\0' + caption)},
            {"encoder", settings_.encoder_identity},
            {"caption", caption}};
}

EntryLookup TextEmbedCache::load(const std::string& caption, TextEmbedEntry* entry) const {
    return verify(caption, settings_.storage->read_if_exists(entry_path(caption).string()), entry);
}

std::vector<EntryLookup> TextEmbedCache::load_many(const std::vector<std::string>& captions,
                                                   std::vector<TextEmbedEntry>* entries) const {
    std::vector<EntryLookup> out(captions.size());
    if (entries) entries->assign(captions.size(), {});
    if (!settings_.storage->remote()) {
        for (size_t i = 0; i < captions.size(); ++i)
            out[i] = load(captions[i], entries ? &(*entries)[i] : nullptr);
        return out;
    }
    constexpr size_t kChunk = 256;  // bounds the fetched bytes held at once
    for (size_t begin = 0; begin < captions.size(); begin += kChunk) {
        const size_t end = std::min(captions.size(), begin + kChunk);
        std::vector<std::string> paths;
        for (size_t i = begin; i < end; ++i) paths.push_back(entry_path(captions[i]).string());
        const auto fetched = settings_.storage->read_many_if_exists(paths);
        for (size_t i = begin; i < end; ++i)
            out[i] = verify(captions[i], fetched[i - begin], entries ? &(*entries)[i] : nullptr);
    }
    return out;
}

EntryLookup TextEmbedCache::verify(const std::string& caption, const std::optional<std::string>& bytes,
                                   TextEmbedEntry* entry) const {
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    std::map<std::string, std::string> metadata;
    const auto path = entry_path(caption);
    EntryLookup result = parse_fetched(bytes, path.string(), &tensors, &metadata);
    if (result.status != EntryStatus::kValid) return result;
    result = verify_metadata(metadata, expected_metadata(caption));
    if (result.status != EntryStatus::kValid) return result;
    TextEmbedEntry got;
    for (auto& [name, t] : tensors) got[name] = t;
    std::vector<std::string> names;
    for (const auto& [name, t] : got) names.push_back(name);
    std::vector<std::string> want = settings_.tensor_names;
    std::sort(want.begin(), want.end());
    if (names != want || tensors.size() != want.size())
        return {EntryStatus::kCorrupt,
                str(path.string(), ": expected the tensors ", join(want, ", "), ", found ",
                    names.empty() ? std::string("none") : join(names, ", ")),
                {}};
    if (entry) *entry = std::move(got);
    return result;
}

void TextEmbedCache::store(const std::string& caption, const TextEmbedEntry& entry) const {
    std::vector<std::string> names;
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& [name, t] : entry) {
        names.push_back(name);
        tensors.emplace_back(name, t);
    }
    std::vector<std::string> want = settings_.tensor_names;
    std::sort(want.begin(), want.end());
    DTUNE_CHECK(names == want, "a text-cache entry must hold the tensors ", join(want, ", "), "; got ",
                join(names, ", "));
    settings_.storage->write(
        entry_path(caption).string(),
        compress_cache_bytes(serialize_entry(tensors, expected_metadata(caption)), settings_.compression));
}

}  // namespace dtune::data

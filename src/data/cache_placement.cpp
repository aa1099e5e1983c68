// Cache placement rules. See cache_placement.h.
#include "data/cache_placement.h"

#include <filesystem>

namespace dtune::data {

LatentCacheSettings latent_cache_placement(const DatasetConfig& d, const DataBackendConfig& all,
                                           const GlobalDataArgs& args, const std::string& vae_identity) {
    LatentCacheSettings s = latent_cache_settings(d, vae_identity);
    s.images = make_storage(d);
    const DatasetConfig* embeds = d.image_embeds.empty() ? nullptr : all.find(d.image_embeds);
    if (embeds && embeds->type == StorageType::kAws) {
        s.storage = make_storage(*embeds);
        const std::string local_default =
            (std::filesystem::path(args.output_dir) / "cache" / "vae" / args.model_family / d.id).string();
        if (d.cache_dir_vae == local_default)
            s.cache_dir =
                (std::filesystem::path(embeds->cache_dir.empty() ? "cache/vae" : embeds->cache_dir) / d.id)
                    .string();
    }
    return s;
}

std::shared_ptr<StorageBackend> text_cache_storage(const DatasetConfig* text_entry) {
    if (text_entry && text_entry->type == StorageType::kAws) return make_storage(*text_entry);
    return nullptr;
}

}  // namespace dtune::data

// Where a dataset's caches live: local disk, or an S3 bucket named by an `aws` image_embeds /
// text_embeds entry. Shared by `dtune train` and `dtune cache` so both find the same entries.
//
// Rules: latents stay on local disk in cache_dir_vae unless the dataset names an `aws`
// image_embeds entry; then they go to that entry's bucket under the dataset's cache_dir_vae, or,
// when cache_dir_vae is its local default (<output_dir>/cache/vae/<family>/<id>), under
// <image_embeds cache_dir, else "cache/vae">/<id>. Text embeddings go to the text_embeds entry's
// storage under its cache_dir. Images are always read through the dataset's own backend.
#pragma once

#include <memory>
#include <string>

#include "data/cache_store.h"
#include "data/dataset_config.h"

namespace dtune::data {

LatentCacheSettings latent_cache_placement(const DatasetConfig& dataset, const DataBackendConfig& all,
                                           const GlobalDataArgs& args, const std::string& vae_identity);

// The storage of a text_embeds entry (null: local folders).
std::shared_ptr<StorageBackend> text_cache_storage(const DatasetConfig* text_entry);

}  // namespace dtune::data

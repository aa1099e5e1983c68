// safetensors files as libtorch tensors.
//
// SafetensorsFile memory-maps the file and hands out CPU tensors that view the mapping without a
// copy; each tensor keeps the mapping alive, so tensors may outlive the SafetensorsFile object.
// The mapping is private copy-on-write: writing into a returned tensor never changes the file.
//
// save_safetensors() writes atomically (temp file, fsync, rename, fsync of the directory).
// Sharded checkpoints (`<name>.safetensors.index.json` + shards) are read by WeightSource and
// written by save_sharded_safetensors().
#pragma once

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "io/safetensors_header.h"

namespace dtune::fs {
class MappedFile;
}

namespace dtune::io {

using TensorList = std::vector<std::pair<std::string, at::Tensor>>;
using Metadata = std::map<std::string, std::string>;

c10::ScalarType to_torch_dtype(StDType dtype);
// Throws DataError for dtypes safetensors cannot hold (complex, quantised, ...).
StDType from_torch_dtype(c10::ScalarType dtype, const std::string& tensor_name);

class SafetensorsFile {
  public:
    explicit SafetensorsFile(const std::filesystem::path& path);

    const std::filesystem::path& path() const { return path_; }
    const SafetensorsHeader& header() const { return header_; }
    const Metadata& metadata() const { return header_.metadata; }
    std::vector<std::string> keys() const;  // sorted
    bool contains(const std::string& name) const { return index_.count(name) != 0; }
    const TensorInfo& info(const std::string& name) const;

    // A zero-copy CPU tensor viewing the file (a copy only when the data is misaligned for its
    // element type). Throws DataError naming the file and the missing key.
    at::Tensor get(const std::string& name) const;
    // Drops this process's resident pages behind `view` (a tensor from get(), or a view of one)
    // once its contents were copied elsewhere, so that loading a checkpoint does not keep a
    // second copy of it resident. The data stays in the page cache and is read back from the file
    // if touched again; a view that does not lie in this file's mapping is ignored. Never call it
    // on a tensor that was written to (the private copy-on-write pages would revert to the file).
    void release(const at::Tensor& view) const;

  private:
    std::filesystem::path path_;
    std::shared_ptr<fs::MappedFile> map_;
    SafetensorsHeader header_;
    std::map<std::string, std::size_t> index_;
};

// Writes tensors (any device; made contiguous on CPU) and metadata atomically. Tensor names must
// be unique.
void save_safetensors(const std::filesystem::path& path, const TensorList& tensors,
                      const Metadata& metadata = {});

// Reads every tensor of one file (zero-copy views).
TensorList load_safetensors(const std::filesystem::path& path);

// A set of weights spread over one file or several shards. Opens:
//   - a `.safetensors` file,
//   - a `.safetensors.index.json` file (its "weight_map" names the shard of every tensor),
//   - a directory holding exactly one of those (index preferred), optionally with a file-name
//     stem, e.g. WeightSource::open(dir, "diffusion_pytorch_model").
class WeightSource {
  public:
    static WeightSource open(const std::filesystem::path& path, const std::string& stem = "");

    std::vector<std::string> keys() const;  // sorted
    bool contains(const std::string& name) const { return where_.count(name) != 0; }
    const TensorInfo& info(const std::string& name) const;
    at::Tensor get(const std::string& name) const;
    // SafetensorsFile::release for whichever shard `view` lies in.
    void release(const at::Tensor& view) const;
    // Metadata of the first file (or of the index's "metadata" block for a sharded set).
    const Metadata& metadata() const { return metadata_; }
    const std::vector<std::filesystem::path>& files() const { return files_; }
    uint64_t total_bytes() const;

  private:
    std::vector<std::filesystem::path> files_;
    std::vector<std::shared_ptr<SafetensorsFile>> shards_;
    std::map<std::string, std::size_t> where_;  // tensor -> shard index
    Metadata metadata_;
};

// Writes `<dir>/<stem>.safetensors` when everything fits in one shard of `max_shard_bytes`, else
// `<dir>/<stem>-00001-of-0000N.safetensors` + `<dir>/<stem>.safetensors.index.json` (diffusers'
// and transformers' layout). Returns the files written.
std::vector<std::filesystem::path> save_sharded_safetensors(const std::filesystem::path& dir,
                                                            const std::string& stem,
                                                            const TensorList& tensors,
                                                            uint64_t max_shard_bytes,
                                                            const Metadata& metadata = {});

}  // namespace dtune::io

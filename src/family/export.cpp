// Full fine-tune exports (see export.h).
#include "family/export.h"

#include <torch/nn/module.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "io/ldm_keys.h"
#include "io/safetensors.h"
#include "models/common/pipeline_folder.h"
#include "models/common/weights.h"

namespace dtune::family {
namespace {

namespace stdfs = std::filesystem;

constexpr const char* kUNetFile = "diffusion_pytorch_model.safetensors";

io::TensorList read_all(const stdfs::path& dir, const std::string& stem) {
    const auto source = io::WeightSource::open(dir, stem);
    io::TensorList out;
    for (const auto& k : source.keys()) out.emplace_back(k, source.get(k));
    return out;
}

nlohmann::json read_json(const stdfs::path& file) {
    DTUNE_CHECK_AS(DataError, stdfs::is_regular_file(file), file.string(),
                   " is missing; the base model folder must be a complete diffusers SDXL pipeline");
    return nlohmann::json::parse(fs::read_file(file));
}

stdfs::path vae_folder(const stdfs::path& base, const std::optional<stdfs::path>& vae_dir) {
    if (vae_dir && stdfs::is_regular_file(*vae_dir / "config.json")) return *vae_dir;
    return base / "vae";
}

// The ldm numbering: SDXL has one layers_per_block for every down block and 4 VAE levels.
io::LdmLayout layout_of(const stdfs::path& base, const stdfs::path& vae) {
    io::LdmLayout layout;
    const auto unet = read_json(base / "unet" / "config.json");
    const auto& lpb = unet.at("layers_per_block");
    layout.unet_layers_per_block = lpb.is_array() ? lpb.at(0).get<int>() : lpb.get<int>();
    layout.vae_num_blocks = static_cast<int>(read_json(vae / "config.json").at("block_out_channels").size());
    return layout;
}

}  // namespace

std::size_t link_or_copy_tree(const stdfs::path& from, const stdfs::path& to) {
    std::size_t copied = 0;
    stdfs::create_directories(to);
    for (const auto& entry : stdfs::recursive_directory_iterator(from)) {
        const stdfs::path target = to / stdfs::relative(entry.path(), from);
        if (entry.is_directory()) {
            stdfs::create_directories(target);
            continue;
        }
        std::error_code ec;
        stdfs::create_hard_link(entry.path(), target, ec);
        if (ec) {  // another filesystem, or hard links of others' files not permitted
            stdfs::copy_file(entry.path(), target, stdfs::copy_options::overwrite_existing);
            ++copied;
        }
    }
    return copied;
}

void export_pipeline(const stdfs::path& base_model_dir, const torch::nn::Module& network,
                     const std::string& network_folder, const stdfs::path& out_dir,
                     const std::optional<stdfs::path>& vae_dir) {
    const auto base = models::PipelineFolder::open(base_model_dir);
    const stdfs::path tmp = out_dir.string() + ".tmp";
    stdfs::remove_all(tmp);
    stdfs::create_directories(tmp / network_folder);
    io::save_safetensors(tmp / network_folder / kUNetFile, models::state_dict(network), {{"format", "pt"}});
    fs::write_file_atomic(tmp / network_folder / "config.json",
                          fs::read_file(base_model_dir / network_folder / "config.json"));
    std::size_t copied = 0;
    for (const auto& name : base.component_names()) {
        if (name == network_folder) continue;
        const stdfs::path from =
            name == "vae" ? vae_folder(base_model_dir, vae_dir) : base.component(name).path;
        copied += link_or_copy_tree(from, tmp / name);
    }
    fs::write_file_atomic(tmp / "model_index.json", fs::read_file(base_model_dir / "model_index.json"));
    fs::sync_directory(tmp);
    stdfs::remove_all(out_dir);
    stdfs::rename(tmp, out_dir);
    log::info() << "wrote the diffusers pipeline " << out_dir.string() << " (trained " << network_folder
                << "; other components " << (copied ? "copied" : "hard-linked") << " from "
                << base_model_dir.string() << ")";
}

void export_single_file(const stdfs::path& base_model_dir, const torch::nn::Module& unet,
                        const stdfs::path& file, const std::optional<stdfs::path>& vae_dir) {
    const stdfs::path vae = vae_folder(base_model_dir, vae_dir);
    const io::LdmLayout layout = layout_of(base_model_dir, vae);
    io::TensorList all;
    auto add = [&all](io::TensorList tensors) {
        for (auto& kv : tensors) all.push_back(std::move(kv));
    };
    add(io::diffusers_to_ldm(models::state_dict(unet), io::LdmComponent::kUNet, layout));
    add(io::diffusers_to_ldm(read_all(vae, "diffusion_pytorch_model"), io::LdmComponent::kVAE, layout));
    add(io::diffusers_to_ldm(read_all(base_model_dir / "text_encoder", "model"),
                             io::LdmComponent::kTextEncoder, layout));
    add(io::diffusers_to_ldm(read_all(base_model_dir / "text_encoder_2", "model"),
                             io::LdmComponent::kTextEncoder2, layout));
    if (!file.parent_path().empty()) stdfs::create_directories(file.parent_path());
    io::save_safetensors(file, all,
                         {{"format", "pt"},
                          {"modelspec.architecture", "stable-diffusion-xl-v1-base"},
                          {"modelspec.implementation", "sgm"}});
    log::info() << "wrote the SDXL single-file checkpoint " << file.string() << " (" << all.size()
                << " tensors)";
}

}  // namespace dtune::family

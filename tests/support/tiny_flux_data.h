// The tiny Flux training workspace the Flux CLI tests and the ZeRO-3 Flux tests train on: the tiny
// FluxPipeline folder (tests/data/ref/tiny-flux-pipeline with tiny-flux-vae as its VAE, and
// tiny-sdxl's CLIP text encoder and tokenizer in the pipeline's CLIP slots), four 64² images
// captioned by their file names, and a multidatabackend.json caching their latents and text
// embeddings under `dir`. Header-only: the including test links dtune_io.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>

#include "core/fs.h"
#include "io/image.h"
#include "support/test_support.h"

namespace dtune::test {

struct TinyFluxData {
    std::filesystem::path model;     // the pipeline folder
    std::filesystem::path backends;  // multidatabackend.json
};

// `ref`: tests/data/ref (DTUNE_TEST_DATA_DIR "/ref").
inline TinyFluxData write_tiny_flux_data(const std::filesystem::path& dir, const std::filesystem::path& ref) {
    namespace stdfs = std::filesystem;
    TinyFluxData d{dir / "tiny-flux", dir / "multidatabackend.json"};
    stdfs::copy(ref / "tiny-flux-pipeline", d.model, stdfs::copy_options::recursive);
    stdfs::copy(ref / "tiny-flux-vae", d.model / "vae", stdfs::copy_options::recursive);
    for (const char* part : {"text_encoder", "tokenizer"})
        stdfs::copy(fixtures_dir() / "tiny-sdxl" / part, d.model / part, stdfs::copy_options::recursive);
    const auto images = dir / "images";
    stdfs::create_directories(images);
    for (int i = 0; i < 4; ++i) {
        io::RgbImage img(64, 64);
        for (size_t p = 0; p < img.pixels.size(); ++p)
            img.pixels[p] = static_cast<uint8_t>((p * 11 + i * 29) % 256);
        io::write_image(images / ("a flux photo " + std::to_string(i) + ".png"), img);
    }
    const nlohmann::json backends = nlohmann::json::array({{{"id", "tiny"},
                                                            {"type", "local"},
                                                            {"instance_data_dir", images.string()},
                                                            {"resolution", 64},
                                                            {"resolution_type", "pixel"},
                                                            {"caption_strategy", "filename"},
                                                            {"cache_dir_vae", (dir / "cache_vae").string()}},
                                                           {{"id", "text"},
                                                            {"type", "local"},
                                                            {"dataset_type", "text_embeds"},
                                                            {"default", true},
                                                            {"cache_dir", (dir / "cache_text").string()}}});
    fs::write_file_atomic(d.backends, backends.dump(2));
    return d;
}

}  // namespace dtune::test

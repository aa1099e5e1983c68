// Shared by the DatasetBatchSource tests: counting stand-in encoders (no model) and a workspace of
// generated PNGs with its multidatabackend.json.
#pragma once

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <memory>
#include <string>

#include "core/fs.h"
#include "data/sampler.h"
#include "family/sdxl/sdxl_family.h"
#include "io/image.h"
#include "support/test_support.h"
#include "train/dataset_source.h"

namespace dtune::train::test_util {

namespace stdfs = std::filesystem;

struct Counters {
    int64_t vae_calls = 0, vae_images = 0, text_calls = 0, text_captions = 0;
};

// VAE stand-in: 8×8 average pooling plus the channel mean → [B, 4, H/8, W/8], plus a "posterior
// sample" of 0.01 × noise seeded by the image's noise salt when it is not 0. Text stand-in: a
// caption's embedding drawn from a generator seeded by its hash.
inline DatasetEncoders fake_encoders(std::shared_ptr<Counters> c) {
    DatasetEncoders e;
    e.vae_identity = "test pool vae";
    e.text_identity = "test hashed text";
    e.vae = [c](const at::Tensor& images, const std::vector<uint64_t>& salts) {
        ++c->vae_calls;
        c->vae_images += images.size(0);
        const at::Tensor pooled = at::avg_pool2d(images, {8, 8});     // [B, 3, h, w]
        at::Tensor out = at::cat({pooled, pooled.mean(1, true)}, 1);  // [B, 4, h, w]
        for (int64_t i = 0; i < out.size(0); ++i)
            if (salts.at(size_t(i)) != 0) {
                at::Generator g = at::detail::createCPUGenerator(salts[size_t(i)] >> 1);
                out[i] += 0.01 * at::randn(out[i].sizes(), g, at::kFloat);
            }
        return out;
    };
    e.text = [c](const std::vector<std::string>& captions) {
        ++c->text_calls;
        c->text_captions += static_cast<int64_t>(captions.size());
        std::vector<at::Tensor> p, q;
        for (const auto& s : captions) {
            at::Generator g = at::detail::createCPUGenerator(data::hash64(s) >> 1);
            p.push_back(at::randn({77, 8}, g, at::kFloat));
            q.push_back(at::randn({4}, g, at::kFloat));
        }
        return data::TextEmbeds{{"prompt_embeds", at::stack(p)}, {"pooled_prompt_embeds", at::stack(q)}};
    };
    e.sample_conditioning = family::add_sdxl_time_ids;  // the SDXL family's time ids
    return e;
}

inline void write_png(const stdfs::path& path, int w, int h, int seed) {
    io::RgbImage img(w, h);
    for (size_t p = 0; p < img.pixels.size(); ++p)
        img.pixels[p] = static_cast<uint8_t>((p * 13 + seed * 71) % 251);
    io::write_image(path, img);
}

struct Workspace {
    test::TempDir dir;
    nlohmann::json entry;

    // `wide` images of 256×128 and `tall` of 64×128, resolution 64 px.
    Workspace(int wide = 8, int tall = 8) {
        const auto images = dir / "images";
        stdfs::create_directories(images);
        for (int i = 0; i < wide; ++i)
            write_png(images / ("wide " + std::to_string(i) + ".png"), 256, 128, i);
        for (int i = 0; i < tall; ++i)
            write_png(images / ("tall " + std::to_string(i) + ".png"), 64, 128, 50 + i);
        entry = {{"id", "pics"},
                 {"type", "local"},
                 {"instance_data_dir", images.string()},
                 {"resolution", 64},
                 {"resolution_type", "pixel"},
                 {"caption_strategy", "filename"},
                 {"cache_dir_vae", (dir / "vae").string()}};
    }

    DatasetSourceOptions options(int batch = 2, int prefetch = 2) const {
        const nlohmann::json backends = nlohmann::json::array({entry,
                                                               {{"id", "text"},
                                                                {"dataset_type", "text_embeds"},
                                                                {"default", true},
                                                                {"cache_dir", (dir / "text").string()}}});
        fs::write_file_atomic(dir / "multidatabackend.json", backends.dump(2));
        DatasetSourceOptions o;
        o.data_backend_config = dir / "multidatabackend.json";
        o.global.output_dir = (dir / "out").string();
        o.global.cache_dir_text = (dir / "text").string();
        o.train_batch_size = batch;
        o.global.train_batch_size = batch;
        o.seed = 42;
        o.prefetch_batches = prefetch;
        o.show_progress = false;
        o.cache_threads = 2;
        return o;
    }
};

inline at::Generator unused_generator() {
    return at::detail::createCPUGenerator(1);
}

inline int64_t count_files(const stdfs::path& dir) {
    int64_t n = 0;
    for (const auto& e : stdfs::recursive_directory_iterator(dir))
        if (e.is_regular_file() && e.path().extension() == ".safetensors") ++n;
    return n;
}

}  // namespace dtune::train::test_util

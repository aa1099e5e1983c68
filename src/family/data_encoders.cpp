// The shared data-side pieces of the model families (see data_encoders.h).
#include "family/data_encoders.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <fstream>

#include "core/dtype.h"
#include "core/error.h"
#include "core/log.h"
#include "data/cache_codec.h"
#include "data/sampler.h"
#include "models/common/component.h"
#include "models/common/pipeline_folder.h"
#include "models/common/quantize.h"
#include "models/vae/autoencoder_kl.h"

namespace dtune::family {

uint64_t tensor_content_hash(const at::Tensor& t) {
    const at::Tensor c = t.detach().to(at::kCPU).contiguous();
    const auto* bytes = static_cast<const unsigned char*>(c.data_ptr());
    const size_t n = c.nbytes();
    uint64_t h = data::mix64(n);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t word;
        std::memcpy(&word, bytes + i, 8);
        h = data::mix64(h ^ word);
    }
    for (; i < n; ++i) h = data::mix64(h ^ bytes[i]);
    return h;
}

uint64_t posterior_seed(const at::Tensor& image, uint64_t salt) {
    const uint64_t h = tensor_content_hash(image);
    return (salt == 0 ? h : data::mix64(h ^ salt)) >> 1;  // salt 0: the cache entries' seed
}

data::LatentEncodeFn make_vae_encode_fn(std::shared_ptr<models::AutoencoderKLImpl> vae, c10::Device device,
                                        c10::ScalarType dtype, VaeEncodeOptions options) {
    if (options.channels_last) models::convert_to_channels_last(*vae);
    return [vae, device, dtype, options](const at::Tensor& images, const std::vector<uint64_t>& salts) {
        at::NoGradGuard no_grad;
        DTUNE_CHECK(salts.size() == static_cast<size_t>(images.size(0)), "the VAE got ", salts.size(),
                    " noise salts for ", images.size(0), " images");
        // Upload in float32, convert on the device: an upload with a dtype change would convert on
        // the host first, into pageable memory, and wait. Same values either way (RNE rounding).
        const bool async = device.is_cuda() && images.is_pinned();
        at::Tensor x = images.to(device, /*non_blocking=*/async).to(dtype);  // [B, 3, H, W]
        if (options.channels_last) x = x.contiguous(at::MemoryFormat::ChannelsLast);
        const auto posterior = vae->encode(x);  // [B, C, h, w] each; queued, not waited for
        // The noise is drawn on the host while the device encodes: one hash per image, in parallel.
        std::vector<uint64_t> seeds(static_cast<size_t>(images.size(0)));
        at::parallel_for(0, images.size(0), 1, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i)
                seeds[size_t(i)] = posterior_seed(images[i], salts[size_t(i)]);
        });
        std::vector<at::Tensor> eps;
        for (uint64_t seed : seeds) {
            at::Generator g = at::detail::createCPUGenerator(seed);
            eps.push_back(at::randn(posterior.mean.sizes().slice(1), g, at::kFloat));  // [C, h, w]
        }
        at::Tensor noise = at::stack(eps);  // [B, C, h, w]
        if (device.is_cuda()) noise = noise.pin_memory();
        noise = noise.to(posterior.mean.device(), /*non_blocking=*/device.is_cuda())
                    .to(posterior.mean.scalar_type());
        const at::Tensor latents = vae->scale_latents(posterior.mean + posterior.std * noise).to(at::kFloat);
        return options.channels_last ? latents.contiguous() : latents;
    };
}

std::string text_encoder_identity(const std::filesystem::path& model_dir, const std::string& label) {
    namespace stdfs = std::filesystem;
    constexpr std::streamoff kSpan = 1 << 20;  // head and tail hashed: weights differ everywhere
    std::string fingerprint;
    for (const char* part : {"text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"}) {
        const stdfs::path dir = model_dir / part;
        if (!stdfs::is_directory(dir)) continue;
        std::vector<stdfs::path> files;
        for (const auto& e : stdfs::recursive_directory_iterator(dir))
            if (e.is_regular_file()) files.push_back(e.path());
        std::sort(files.begin(), files.end());
        for (const auto& f : files) {
            const auto size = static_cast<std::streamoff>(stdfs::file_size(f));
            std::ifstream in(f, std::ios::binary);
            std::string bytes(static_cast<size_t>(std::min(size, 2 * kSpan)), '\0');
            if (size <= 2 * kSpan) {
                in.read(bytes.data(), size);
            } else {
                in.read(bytes.data(), kSpan);
                in.seekg(size - kSpan);
                in.read(bytes.data() + kSpan, kSpan);
            }
            DTUNE_CHECK_AS(DataError, in.good() || in.eof(), "cannot read ", f.string());
            fingerprint += str(stdfs::relative(f, model_dir).generic_string(), " ", size, " ",
                               data::sha256_hex(bytes), "\n");
        }
    }
    return label + " " + data::sha256_hex(fingerprint);
}

std::array<std::string, 2> text_encoder_precision_from(const train::TrainConfig& config) {
    return {config.text("text_encoder_1_precision"), config.text("text_encoder_2_precision")};
}

void quantize_text_encoders(const std::vector<torch::nn::Module*>& encoders,
                            const std::array<std::string, 2>& precisions, std::string& identity) {
    for (std::size_t i = 0; i < encoders.size() && i < precisions.size(); ++i) {
        const std::string key = str("text_encoder_", i + 1, "_precision");
        const QuantPreset preset = parse_quant_preset(precisions[i], key);
        if (!preset.active()) continue;
        const models::QuantizeReport report = models::quantize_module(*encoders[i], preset);
        log::info() << "quantised text encoder " << i + 1 << " (" << models::describe(report, preset) << ")";
        identity += str(" ", key, "=", preset.name);
    }
}

std::string text_precision_identity(const std::array<std::string, 2>& precisions, std::size_t count) {
    std::string out;
    for (std::size_t i = 0; i < count && i < precisions.size(); ++i) {
        const std::string key = str("text_encoder_", i + 1, "_precision");
        const QuantPreset preset = parse_quant_preset(precisions[i], key);
        if (preset.active()) out += str(" ", key, "=", preset.name);
    }
    return out;
}

void load_vae_encoder(const std::filesystem::path& model_dir, const std::filesystem::path& vae_override,
                      c10::Device device, c10::ScalarType dtype, data::DataEncoders& e) {
    namespace stdfs = std::filesystem;
    auto folder = models::PipelineFolder::open(model_dir);
    if (!vae_override.empty()) folder.set_vae_override(vae_override);
    models::ComponentLoadOptions vo;
    vo.device = device;
    vo.dtype = dtype;
    auto vae = std::make_shared<models::AutoencoderKL>(models::load_autoencoder_kl(folder.vae_path(), vo));
    (*vae)->eval();
    const auto& config = (*vae)->config();
    const char* name = dtype == c10::kBFloat16 ? "bf16" : dtype == c10::kHalf ? "fp16" : "fp32";
    e.vae_identity = str("AutoencoderKL ", stdfs::weakly_canonical(folder.vae_path()).string(),
                         " scaling=", config.scaling_factor, " dtype=", name, " sample");
    // The shift is part of what a latent means (Flux); SDXL's VAE has none, and its identity stays
    // what earlier versions wrote.
    if (config.shift_factor != 0.0) e.vae_identity += str(" shift=", config.shift_factor);
    e.latent_channels = config.latent_channels;
    // Channels-last on CUDA: the fused inference kernels (models/common/group_norm_act.h) need it.
    e.vae = make_vae_encode_fn(vae->ptr(), device, dtype, {.channels_last = device.is_cuda()});
}

}  // namespace dtune::family

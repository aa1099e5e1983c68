// bench_load_unet: wall time and peak resident memory of loading a UNet component folder
// (config.json + diffusion_pytorch_model.safetensors) with models::load_unet, printed as JSON.
// Usage:
//   bench_load_unet <unet folder> [--dtype bf16] [--device cpu]
//   bench_load_unet --generate <config folder> <out folder> [--dtype bf16]
// --generate writes <out folder>/config.json and a random checkpoint of that config (a full-size
// SDXL UNet in bf16 is ~5.1 GB), built without the fp32 detour (models::UninitializedParameters).
// Peak RSS is the process's ru_maxrss, so run one load per process. Before timing, it reads the
// checkpoint once through a small buffer (the page cache then holds it), so the number is the
// loader's cost, not the disk's; say so when quoting it.
//
// Measured (full-size SDXL UNet, 2,567,463,684 parameters, 4.78 GiB bf16 file -> bf16 on the CPU,
// dev build, the project's shared 2-core CPU machine under a load average of ~13, so times are
// noisy; peak RSS is not):
//   before (fp32 modules with random init, then .to(bf16), then copy): 400 s, peak RSS 9.68 GiB
//   after  (UninitializedParameters + copy from the mmap + page release): 66 s, peak RSS 5.18 GiB
// The after peak is the bf16 model itself (4.78 GiB) plus the process's baseline.
#include <ATen/ATen.h>
#include <sys/resource.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/fs.h"
#include "io/safetensors.h"
#include "models/common/weights.h"
#include "models/unet/unet_2d_condition.h"
#if __has_include("models/common/layers.h")
#include "models/common/layers.h"
#define DTUNE_HAS_UNINITIALIZED_PARAMETERS 1
#endif

namespace {

double max_rss_gib() {
    rusage r{};
    getrusage(RUSAGE_SELF, &r);
    return static_cast<double>(r.ru_maxrss) / (1024.0 * 1024.0);  // ru_maxrss is in KiB
}

[[maybe_unused]] int generate_checkpoint(const std::filesystem::path& config_dir,
                                         const std::filesystem::path& out, c10::ScalarType dtype) {
#ifdef DTUNE_HAS_UNINITIALIZED_PARAMETERS
    using namespace dtune;
    const auto config_path = config_dir / "config.json";
    auto config = models::UNet2DConditionConfig::from_json(models::ConfigReader::from_file(config_path));
    std::filesystem::create_directories(out);
    std::filesystem::copy_file(config_path, out / "config.json",
                               std::filesystem::copy_options::overwrite_existing);
    models::UNet2DConditionModel unet{nullptr};
    {
        models::UninitializedParameters scope(dtype, c10::Device(c10::kCPU));
        unet = models::UNet2DConditionModel(config);
    }
    io::TensorList tensors;
    for (auto& [name, t] : models::state_dict(*unet)) {
        at::Tensor v = t.detach().to(dtype);
        if (v.is_floating_point()) v.uniform_(-0.02, 0.02);  // values only need to be finite
        tensors.emplace_back(name, v);
    }
    io::save_safetensors(out / "diffusion_pytorch_model.safetensors", tensors);
    std::cout << "{\"generated\": \"" << out.string() << "\", \"tensors\": " << tensors.size() << "}"
              << std::endl;
    return 0;
#else
    (void)config_dir, (void)out, (void)dtype;
    std::cerr << "--generate needs the UninitializedParameters loader\n";
    return 2;
#endif
}

}  // namespace

int main(int argc, char** argv) {
    using namespace dtune;
    std::string dir, dtype_name = "bf16", device_name = "cpu", gen_out;
    bool gen = false;
    for (int i = 1; i < argc; ++i) {
        const std::string s = argv[i];
        auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
        if (s == "--dtype")
            dtype_name = next();
        else if (s == "--device")
            device_name = next();
        else if (s == "--generate")
            gen = true;
        else if (dir.empty())
            dir = s;
        else
            gen_out = s;
    }
    if (dir.empty() || (gen && gen_out.empty())) {
        std::cerr << "usage: bench_load_unet <unet folder> [--dtype bf16] [--device cpu]\n"
                     "       bench_load_unet --generate <config folder> <out folder> [--dtype bf16]\n";
        return 2;
    }
    const auto dtype = parse_dtype(dtype_name);
    if (gen) return generate_checkpoint(dir, gen_out, dtype);

    // Warm the page cache (read through a small buffer, so it does not count in this process's
    // RSS) so that both loaders see the same, memory-speed source.
    const auto weights = std::filesystem::path(dir) / "diffusion_pytorch_model.safetensors";
    {
        std::ifstream in(weights, std::ios::binary);
        std::vector<char> buffer(64 << 20);
        while (in.read(buffer.data(), static_cast<std::streamsize>(buffer.size())) || in.gcount() > 0) {
        }
    }
    const double rss_before = max_rss_gib();
    const auto t0 = std::chrono::steady_clock::now();
    models::ComponentLoadOptions options;
    options.dtype = dtype;
    options.device = parse_device(device_name);
    auto unet = models::load_unet(dir, options);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    int64_t params = 0;
    for (const auto& p : unet->parameters()) params += p.numel();
    std::cout << "{\"bench\": \"load_unet\", \"params\": " << params << ", \"dtype\": \"" << dtype_name
              << "\", \"device\": \"" << device_name << "\", \"seconds\": " << seconds
              << ", \"peak_rss_gib\": " << max_rss_gib() << ", \"rss_before_load_gib\": " << rss_before
              << ", \"checkpoint_gib\": "
              << static_cast<double>(std::filesystem::file_size(weights)) / (1024.0 * 1024 * 1024) << "}"
              << std::endl;
    return 0;
}

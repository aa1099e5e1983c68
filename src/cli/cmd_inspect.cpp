// `dtune inspect <path>`: what a weights file (or sharded set, or folder) holds.
#include <cstdio>
#include <map>

#include "cli/command.h"
#include "core/error.h"
#include "io/safetensors.h"

namespace dtune::cli {
namespace {

std::string human_bytes(double bytes) {
    const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (bytes >= 1024 && u < 4) {
        bytes /= 1024;
        ++u;
    }
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f %s", bytes, units[u]);
    return buf;
}

int run_inspect(const std::vector<std::string>& args) {
    std::string path;
    bool list = false;
    for (const auto& a : args) {
        if (a == "--tensors")
            list = true;
        else if (a.rfind("--", 0) == 0)
            throw UsageError(str("unknown option '", a, "' for inspect; see dtune inspect --help"));
        else
            path = a;
    }
    if (path.empty())
        throw UsageError("inspect needs a path: dtune inspect <file.safetensors | index.json | folder>");
    io::WeightSource src = io::WeightSource::open(path);
    std::map<std::string, std::pair<uint64_t, uint64_t>> by_dtype;  // dtype -> (tensors, elements)
    uint64_t params = 0;
    for (const auto& key : src.keys()) {
        const auto& info = src.info(key);
        auto& row = by_dtype[io::st_dtype_name(info.dtype)];
        row.first++;
        row.second += info.numel();
        params += info.numel();
    }
    std::printf("%s\n", path.c_str());
    std::printf("  files:      %zu\n", src.files().size());
    std::printf("  tensors:    %zu\n", src.keys().size());
    std::printf("  parameters: %llu (%s)\n", static_cast<unsigned long long>(params),
                human_bytes(src.total_bytes()).c_str());
    for (const auto& [dtype, row] : by_dtype)
        std::printf("  dtype %-8s %llu tensors, %llu elements\n", dtype.c_str(),
                    static_cast<unsigned long long>(row.first), static_cast<unsigned long long>(row.second));
    for (const auto& [k, v] : src.metadata())
        std::printf("  metadata %s = %s\n", k.c_str(), v.substr(0, 120).c_str());
    if (list) {
        for (const auto& key : src.keys()) {
            const auto& info = src.info(key);
            std::string shape = "[";
            for (std::size_t i = 0; i < info.shape.size(); ++i)
                shape += (i ? ", " : "") + std::to_string(info.shape[i]);
            shape += "]";
            std::printf("  %-8s %-20s %s\n", io::st_dtype_name(info.dtype), shape.c_str(), key.c_str());
        }
    }
    return 0;
}

}  // namespace

DTUNE_REGISTER_COMMAND(inspect, "inspect", "describe a weights file, sharded set or folder",
                       "usage: dtune inspect <path> [--tensors]\n\n"
                       "<path> is a .safetensors file, a .safetensors.index.json of a sharded set, or a\n"
                       "folder holding one of them. Prints the number of tensors and parameters, the\n"
                       "dtypes and the file metadata; --tensors lists every tensor with dtype and shape.\n",
                       run_inspect);

}  // namespace dtune::cli

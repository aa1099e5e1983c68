// Loading without keeping the checkpoint resident: SafetensorsFile/WeightSource::release drop the
// process's pages behind a copied tensor (measured in /proc/self/smaps) while the data stays
// readable, ignore memory that is not theirs, and load_weights releases what it copied.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <fstream>
#include <sstream>

#include "io/safetensors.h"
#include "models/common/layers.h"
#include "models/common/weights.h"
#include "support/test_support.h"

namespace dtune::models {
namespace test_load_release_unit_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

// Resident KiB of the mapping that contains `address` (0 when none does).
int64_t mapping_rss_kib(const void* address) {
    std::ifstream smaps("/proc/self/smaps");
    std::string line;
    bool inside = false;
    const auto a = reinterpret_cast<uintptr_t>(address);
    while (std::getline(smaps, line)) {
        uintptr_t lo = 0, hi = 0;
        char dash = 0;
        std::istringstream head(line);
        if (head >> std::hex >> lo >> dash >> hi && dash == '-') {
            inside = lo <= a && a < hi;
            continue;
        }
        if (inside && line.rfind("Rss:", 0) == 0) return std::stoll(line.substr(4));
    }
    return 0;
}

constexpr int64_t kElements = 4 << 20;  // 16 MiB of float32

std::filesystem::path write_big(const test::TempDir& dir) {
    const auto path = dir / "big.safetensors";
    io::save_safetensors(path, {{"w", at::arange(kElements, at::kFloat)}});
    return path;
}

TEST(LoadRelease, ReleaseDropsResidentPagesButKeepsTheData) {
    test::TempDir dir;
    const io::WeightSource source = io::WeightSource::open(write_big(dir));
    const at::Tensor view = source.get("w");
    EXPECT_EQ(view.max().item<float>(), static_cast<float>(kElements - 1));  // reads every page
    const int64_t before = mapping_rss_kib(view.const_data_ptr());
    EXPECT_GE(before, 15 * 1024);
    source.release(view);
    const int64_t after = mapping_rss_kib(view.const_data_ptr());
    EXPECT_LE(after, 1024) << "resident KiB before " << before;
    // Still the file's contents: the pages come back from the page cache on access.
    EXPECT_TRUE(at::equal(view, at::arange(kElements, at::kFloat)));
}

TEST(LoadRelease, MemoryOutsideTheMappingIsLeftAlone) {
    test::TempDir dir;
    const io::WeightSource source = io::WeightSource::open(write_big(dir));
    const at::Tensor heap = at::full({kElements}, 3.0f);
    source.release(heap);  // must not be madvised away (that would zero it)
    EXPECT_EQ(heap.min().item<float>(), 3.0f);
}

struct BigImpl : torch::nn::Module {
    BigImpl() { w = register_parameter("w", at::empty({kElements})); }
    at::Tensor w;
};
TORCH_MODULE(Big);

TEST(LoadRelease, LoadWeightsReleasesWhatItCopied) {
    test::TempDir dir;
    const io::WeightSource source = io::WeightSource::open(write_big(dir));
    Big module;
    load_weights(*module, source, {}, "Big");
    EXPECT_TRUE(at::equal(module->w, at::arange(kElements, at::kFloat)));
    EXPECT_LE(mapping_rss_kib(source.get("w").const_data_ptr()), 1024);
}

}  // namespace
}  // namespace test_load_release_unit_local
}  // namespace dtune::models

// `dtune version` (also `dtune --version`).
#include <cstdio>

#include "cli/command.h"
#include "cli/version.h"
#include "core/dtype.h"

namespace dtune::cli {
namespace {

int run_version(const std::vector<std::string>&) {
    std::printf("dtune %s (commit %s, %s build)\n", kVersion, kGitCommit, kBuildType);
    std::printf("libtorch %s, CUDA %s, %d CUDA device(s) visible\n", kTorchVersion,
                kBuiltWithCuda ? "enabled" : "disabled", cuda_device_count());
    return 0;
}

}  // namespace

DTUNE_REGISTER_COMMAND(
    version, "version", "print the version, commit and libtorch/CUDA details",
    "usage: dtune version\n\nPrints dtune's version and git commit, the libtorch it was built "
    "against,\nwhether CUDA is enabled and how many CUDA devices are visible.\n",
    run_version);

}  // namespace dtune::cli

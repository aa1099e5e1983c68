// `dtune launch`: starts one rank per local GPU/slot with torchrun's variables and supervises them
// (the work is in dist/launcher.{h,cpp}; this file parses flags and the accelerate config).
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <filesystem>

#include "cli/command.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/fs.h"
#include "dist/launch_config.h"
#include "dist/launcher.h"

namespace dtune::cli {
namespace {

std::string self_executable() {
    char buf[PATH_MAX];
    ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
    if (n <= 0) throw Error("cannot find the dtune executable (/proc/self/exe); run it with a full path");
    return std::string(buf, static_cast<std::size_t>(n));
}

int run_launch(const std::vector<std::string>& args) {
    auto options = dist::parse_launch_args(args);
    std::optional<dist::AccelerateConfig> accelerate;
    if (options.accelerate_config && !std::filesystem::is_regular_file(*options.accelerate_config))
        throw UsageError(str("--accelerate_config ", *options.accelerate_config,
                             " is not a file; pass accelerate's default_config.yaml"));
    if (options.accelerate_config)
        accelerate = dist::parse_accelerate_config(fs::read_file(*options.accelerate_config),
                                                   *options.accelerate_config);
    int default_nproc = options.nproc_per_node ? 0 : cuda_device_count();
    auto config = dist::resolve_launch_config(options, accelerate, default_nproc);
    auto result = dist::run_local_ranks(config, self_executable());
    if (result.exit_code != 0) std::fprintf(stderr, "error: dtune launch: %s\n", result.message.c_str());
    return result.exit_code;
}

}  // namespace

DTUNE_REGISTER_COMMAND(
    launch, "launch", "start a multi-GPU / multi-node job (torchrun-style)",
    "usage: dtune launch [options] -- <dtune command> [args]\n"
    "       dtune launch [options] -- /path/to/program [args]\n\n"
    "Starts one process per GPU on this node with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,\n"
    "MASTER_ADDR and MASTER_PORT set (the variables torchrun sets), relays their stderr prefixed\n"
    "with the rank, forwards SIGINT/SIGTERM, and when one process fails stops the others (SIGTERM,\n"
    "then SIGKILL after the grace period) and exits with the code of the rank that failed first when\n"
    "it is 2 (configuration), 3 (input data) or 4 (stopped after saving), else 1, naming the rank and\n"
    "its last stderr lines. When any rank exits with 75 (GPU fault), the launcher exits 75, naming the\n"
    "node, rank and GPU. After forwarding SIGINT/SIGTERM it exits 4 when every rank saved and exited\n"
    "4, else 128 + the signal.\n"
    "Run it once per node, with the same options except --node_rank.\n\n"
    "options:\n"
    "  --nproc_per_node N     processes on this node (default: visible CUDA devices, at least 1)\n"
    "  --nnodes N             number of nodes (default 1); every node runs nproc_per_node processes\n"
    "  --node_rank I          this node's index, 0..nnodes-1 (default 0)\n"
    "  --master_addr HOST     node 0's address, reachable from every node (needed for nnodes > 1)\n"
    "  --master_port PORT     rendezvous TCP port on node 0 (default 29500)\n"
    "  --accelerate_config F  read accelerate's default_config.yaml: machine_rank, num_machines,\n"
    "                         num_processes (the TOTAL over all nodes), main_process_ip/port;\n"
    "                         mixed_precision, deepspeed_config.zero_stage,\n"
    "                         gradient_accumulation_steps and gradient_clipping are passed to the\n"
    "                         ranks as DTUNE_MIXED_PRECISION, DTUNE_ZERO_STAGE, ... Flags win.\n"
    "  --grace_period S       seconds between SIGTERM and SIGKILL when stopping ranks (default 10)\n\n"
    "NCCL_NVLS_ENABLE is set to 0 unless already set. See docs/multi-node.md.\n",
    run_launch);

}  // namespace dtune::cli

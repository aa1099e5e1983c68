// Starts and supervises the local ranks of a job (the process side of `dtune launch`): one child per
// local slot with the torchrun variables, stderr relayed and its tail kept per rank, SIGINT/SIGTERM
// forwarded, and the first child that fails takes the others down (SIGTERM, then SIGKILL after the
// grace period). Torch-free, POSIX only.
#pragma once

#include <string>
#include <vector>

#include "dist/launch_config.h"

namespace dtune::dist {

struct LaunchResult {
    int exit_code = 0;    // 0 when every rank exited 0
    std::string message;  // empty on success; names the failed rank and its last stderr lines
};

// The program and argv for one rank: a first command word containing '/' is run as a program
// (tests, scripts); otherwise it is a dtune subcommand run by `self_exe`.
std::vector<std::string> child_argv(const std::vector<std::string>& command, const std::string& self_exe);

// OMP_NUM_THREADS for each of `nproc_per_node` ranks sharing `cpus` CPUs: an equal share, at least
// one, so the ranks' OpenMP pools do not oversubscribe the node while host-side work (an offloaded
// optimizer's update, CPU encoders) still gets every core between them.
int omp_threads_per_rank(int cpus, int nproc_per_node);

// Runs the job's local ranks to completion. `self_exe` is the dtune binary (for subcommands).
LaunchResult run_local_ranks(const LaunchConfig& config, const std::string& self_exe);

}  // namespace dtune::dist

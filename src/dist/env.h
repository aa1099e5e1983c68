// The torchrun-compatible process environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT. Torch-free, so the launcher and the workers share one definition.
//
// Invariants: 0 <= rank < world_size, 0 <= local_rank < local_world_size <= world_size; with no
// variables set the environment is the single-process one (rank 0 of 1, launched == false).
#pragma once

#include <map>
#include <string>

namespace dtune::dist {

struct DistEnv {
    int rank = 0;
    int local_rank = 0;
    int world_size = 1;
    int local_world_size = 1;
    std::string master_addr = "127.0.0.1";
    int master_port = 29500;
    bool launched = false;  // true when started by `dtune launch` or torchrun (WORLD_SIZE set)

    bool is_main() const { return rank == 0; }
    bool is_local_main() const { return local_rank == 0; }
    bool distributed() const { return world_size > 1; }
};

// Reads the variables from `vars` (tests) or the process environment. Throws UsageError naming the
// variable and its value when one is not a number or the set is inconsistent (e.g. RANK >=
// WORLD_SIZE, WORLD_SIZE without RANK).
DistEnv read_dist_env(const std::map<std::string, std::string>& vars);
DistEnv read_dist_env();

// The environment variables a launcher sets for one child (inverse of read_dist_env).
std::map<std::string, std::string> dist_env_vars(const DistEnv& env);

// NCCL_NVLS_ENABLE=0 unless the user set it: NVLink SHARP multicast hangs or fails on the machines
// we run on (see docs/multi-node.md). Returns the value in effect.
std::string ensure_nvls_disabled();

// NCCL_GRAPH_MIXING_SUPPORT: set to 0 unless the environment sets it (returns the value in force).
// With NCCL's default (1) every collective captured in a CUDA graph is serialised against the other
// streams at replay, so ZeRO-1's parameter broadcasts ran alone at the start of each step instead of
// beside the forward (2 H200s: 110.4 ms a step against 100.8 with 0). With 0, NCCL needs a host
// synchronisation between a graph launch and a later uncaptured collective on the same
// communicator, which Group::note_graph_launch (dist/group.h) provides.
std::string ensure_graph_mixing_disabled();

}  // namespace dtune::dist

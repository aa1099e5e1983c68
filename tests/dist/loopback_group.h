// In-process multi-rank tests: one thread per rank, a real Gloo group on loopback.
#pragma once

#include <chrono>
#include <memory>

#include "dist/env.h"
#include "dist/group.h"

namespace dtune::test {

// Rank `rank` of a `world`-rank job on one host whose store listens on 127.0.0.1:`port`.
inline dist::DistEnv loopback_env(int rank, int world, int port) {
    dist::DistEnv env;
    env.rank = rank;
    env.local_rank = rank;
    env.world_size = world;
    env.local_world_size = world;
    env.master_addr = "127.0.0.1";
    env.master_port = port;
    env.launched = true;
    return env;
}

// That rank's group: a mismatched collective fails within a minute instead of hanging; the fault
// channel polls every `fault_poll` (0: none).
inline std::unique_ptr<dist::Group> loopback_group(
    int rank, int world, int port, std::chrono::milliseconds fault_poll = std::chrono::milliseconds(100)) {
    dist::GroupOptions options;
    options.fault_poll_interval = fault_poll;
    options.collective_timeout = std::chrono::seconds(60);
    return dist::init_group(loopback_env(rank, world, port), options);
}

}  // namespace dtune::test

// Parsing and checking of the torchrun-style environment (see env.h).
#include "dist/env.h"

#include <cerrno>
#include <cstdlib>
#include <optional>

#include "core/error.h"

namespace dtune::dist {
namespace {

std::optional<std::string> lookup(const std::map<std::string, std::string>& vars, const char* key) {
    auto it = vars.find(key);
    if (it == vars.end() || it->second.empty()) return std::nullopt;
    return it->second;
}

int parse_int(const std::map<std::string, std::string>& vars, const char* key, int fallback, int min_value) {
    auto text = lookup(vars, key);
    if (!text) return fallback;
    errno = 0;
    char* end = nullptr;
    long value = std::strtol(text->c_str(), &end, 10);
    if (errno != 0 || end == text->c_str() || *end != '\0' || value < min_value || value > 1 << 30)
        throw UsageError(str("environment variable ", key, "='", *text, "' is not an integer >= ", min_value,
                             "; unset it or start the job with `dtune launch` (or torchrun), which sets it"));
    return static_cast<int>(value);
}

}  // namespace

DistEnv read_dist_env(const std::map<std::string, std::string>& vars) {
    DistEnv env;
    env.launched = lookup(vars, "WORLD_SIZE").has_value();
    if (!env.launched) {
        if (lookup(vars, "RANK"))
            throw UsageError("RANK is set but WORLD_SIZE is not; set both (or neither, for one process)");
        return env;
    }
    env.world_size = parse_int(vars, "WORLD_SIZE", 1, 1);
    if (!lookup(vars, "RANK") && env.world_size > 1)
        throw UsageError(str("WORLD_SIZE=", env.world_size, " is set but RANK is not; start the job with ",
                             "`dtune launch` or torchrun, which set both"));
    env.rank = parse_int(vars, "RANK", 0, 0);
    env.local_rank = parse_int(vars, "LOCAL_RANK", env.rank, 0);
    env.local_world_size = parse_int(vars, "LOCAL_WORLD_SIZE", env.world_size, 1);
    env.master_addr = lookup(vars, "MASTER_ADDR").value_or("127.0.0.1");
    env.master_port = parse_int(vars, "MASTER_PORT", 29500, 1);
    if (env.rank >= env.world_size)
        throw UsageError(str("RANK=", env.rank, " is not below WORLD_SIZE=", env.world_size,
                             "; ranks run from 0 to WORLD_SIZE-1"));
    if (env.local_world_size > env.world_size || env.local_rank >= env.local_world_size)
        throw UsageError(str("LOCAL_RANK=", env.local_rank, " / LOCAL_WORLD_SIZE=", env.local_world_size,
                             " do not fit WORLD_SIZE=", env.world_size,
                             "; LOCAL_RANK must be below LOCAL_WORLD_SIZE, which is at most WORLD_SIZE"));
    if (env.master_port > 65535)
        throw UsageError(str("MASTER_PORT=", env.master_port, " is not a TCP port (1-65535)"));
    return env;
}

DistEnv read_dist_env() {
    std::map<std::string, std::string> vars;
    for (const char* key :
         {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
        if (const char* value = std::getenv(key)) vars[key] = value;
    return read_dist_env(vars);
}

std::map<std::string, std::string> dist_env_vars(const DistEnv& env) {
    return {{"RANK", std::to_string(env.rank)},
            {"LOCAL_RANK", std::to_string(env.local_rank)},
            {"WORLD_SIZE", std::to_string(env.world_size)},
            {"LOCAL_WORLD_SIZE", std::to_string(env.local_world_size)},
            {"MASTER_ADDR", env.master_addr},
            {"MASTER_PORT", std::to_string(env.master_port)}};
}

std::string ensure_graph_mixing_disabled() {
    if (const char* value = std::getenv("NCCL_GRAPH_MIXING_SUPPORT")) return value;
    ::setenv("NCCL_GRAPH_MIXING_SUPPORT", "0", 0);
    return "0";
}

std::string ensure_nvls_disabled() {
    if (const char* value = std::getenv("NCCL_NVLS_ENABLE")) return value;
    ::setenv("NCCL_NVLS_ENABLE", "0", 0);
    return "0";
}

}  // namespace dtune::dist

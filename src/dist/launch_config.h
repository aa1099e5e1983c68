// What `dtune launch` needs to start a job: the torchrun-style topology (processes per node, nodes,
// this node's rank, the rendezvous address) from flags or from an accelerate `default_config.yaml`,
// plus the training settings accelerate's file carries. Torch-free.
//
// Invariants after resolve_launch_config(): nproc_per_node >= 1, nnodes >= 1,
// 0 <= node_rank < nnodes, 1 <= master_port <= 65535, world size = nproc_per_node * nnodes.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dtune::dist {

// A tiny YAML subset: `key: value` lines, nested mappings by indentation, `#` comments, quoted
// scalars. Returns flattened keys ("deepspeed_config.zero_stage" -> "2"). Lists and multi-line
// scalars are skipped. Throws UsageError naming `origin`:line for a line it cannot read.
std::map<std::string, std::string> parse_simple_yaml(const std::string& text, const std::string& origin);

// The fields of accelerate's config file that dtune uses (all optional).
struct AccelerateConfig {
    std::optional<int> machine_rank;
    std::optional<int> num_machines;
    std::optional<int> num_processes;  // the TOTAL number of processes (GPUs) over all machines
    std::optional<std::string> main_process_ip;
    std::optional<int> main_process_port;
    std::optional<std::string> mixed_precision;           // no / fp16 / bf16
    std::optional<std::string> distributed_type;          // MULTI_GPU, DEEPSPEED, NO, ...
    std::optional<int> zero_stage;                        // deepspeed_config.zero_stage
    std::optional<std::string> offload_param_device;      // deepspeed_config.offload_param_device (none)
    std::optional<std::string> offload_optimizer_device;  // deepspeed_config.offload_optimizer_device
    std::optional<int> gradient_accumulation_steps;
    std::optional<double> gradient_clipping;
};

// Parses accelerate's YAML (text of `path`). Throws UsageError (a configuration error, exit code 2) naming
// the file and key when a value has the wrong type, or distributed_type is one dtune does not run (FSDP,
// TPU...: FSDP's sharding is reached through DEEPSPEED zero_stage 3 or config.json's fsdp_enable).
AccelerateConfig parse_accelerate_config(const std::string& text, const std::string& path);

// The command line of `dtune launch` before resolution (unset = not given).
struct LaunchOptions {
    std::optional<int> nproc_per_node;
    std::optional<int> nnodes;
    std::optional<int> node_rank;
    std::optional<std::string> master_addr;
    std::optional<int> master_port;
    std::optional<std::string> accelerate_config;  // path
    double grace_period_s = 10.0;                  // SIGTERM -> SIGKILL delay when stopping the other ranks
    std::vector<std::string> command;              // after `--`
};

// Parses `dtune launch` arguments. Throws UsageError naming the flag at fault.
LaunchOptions parse_launch_args(const std::vector<std::string>& args);

struct LaunchConfig {
    int nproc_per_node = 1;
    int nnodes = 1;
    int node_rank = 0;
    std::string master_addr = "127.0.0.1";
    int master_port = 29500;
    double grace_period_s = 10.0;
    std::vector<std::string> command;
    // Settings from the accelerate file passed to every rank as DTUNE_* variables.
    std::map<std::string, std::string> extra_env;

    int world_size() const { return nproc_per_node * nnodes; }
};

// Flags win over the accelerate file; `default_nproc` is used when neither gives the processes per
// node (the number of visible GPUs, at least 1). Throws UsageError explaining any inconsistency
// (num_processes not a multiple of num_machines, node_rank >= nnodes, no master_addr for several
// nodes, no command).
LaunchConfig resolve_launch_config(const LaunchOptions& options,
                                   const std::optional<AccelerateConfig>& accelerate, int default_nproc);

}  // namespace dtune::dist

// Unit tests of the torch-free launch pieces: torchrun env parsing, the YAML subset, accelerate's
// fields, `dtune launch` flags and their consistency checks. Expected values are written by hand
// from the inputs.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "core/error.h"
#include "dist/env.h"
#include "dist/launch_config.h"
#include "dist/launcher.h"

namespace dtune::dist {
namespace launch_config_test_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

TEST(DistEnv, NoVariablesIsSingleProcess) {
    auto env = read_dist_env(std::map<std::string, std::string>{});
    EXPECT_FALSE(env.launched);
    EXPECT_EQ(env.world_size, 1);
    EXPECT_EQ(env.rank, 0);
    EXPECT_FALSE(env.distributed());
}

TEST(DistEnv, ReadsTorchrunVariables) {
    auto env = read_dist_env({{"RANK", "5"},
                              {"LOCAL_RANK", "1"},
                              {"WORLD_SIZE", "8"},
                              {"LOCAL_WORLD_SIZE", "4"},
                              {"MASTER_ADDR", "10.0.0.1"},
                              {"MASTER_PORT", "1234"}});
    EXPECT_TRUE(env.launched);
    EXPECT_EQ(env.rank, 5);
    EXPECT_EQ(env.local_rank, 1);
    EXPECT_EQ(env.world_size, 8);
    EXPECT_EQ(env.local_world_size, 4);
    EXPECT_EQ(env.master_addr, "10.0.0.1");
    EXPECT_EQ(env.master_port, 1234);
    EXPECT_EQ(dist_env_vars(env).at("RANK"), "5");
    EXPECT_EQ(dist_env_vars(env).at("LOCAL_WORLD_SIZE"), "4");
}

TEST(DistEnv, RejectsInconsistentVariables) {
    EXPECT_THROW(read_dist_env({{"RANK", "2"}, {"WORLD_SIZE", "2"}}), UsageError);
    EXPECT_THROW(read_dist_env({{"RANK", "0"}}), UsageError);
    EXPECT_THROW(read_dist_env({{"WORLD_SIZE", "2"}}), UsageError);
    EXPECT_THROW(read_dist_env({{"RANK", "x"}, {"WORLD_SIZE", "2"}}), UsageError);
    EXPECT_THROW(read_dist_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}), UsageError);
    EXPECT_THROW(
        read_dist_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "2"}}),
        UsageError);
}

// NCCL's graph-mixing support is switched off unless the user chose a value (dist/env.h: the
// captured collectives then run beside the compute; dist::Group::note_graph_launch keeps it safe).
TEST(DistEnv, GraphMixingOffUnlessSet) {
    const char* before = std::getenv("NCCL_GRAPH_MIXING_SUPPORT");
    const std::string saved = before ? before : "";
    ::unsetenv("NCCL_GRAPH_MIXING_SUPPORT");
    EXPECT_EQ(ensure_graph_mixing_disabled(), "0");
    EXPECT_STREQ(std::getenv("NCCL_GRAPH_MIXING_SUPPORT"), "0");
    ::setenv("NCCL_GRAPH_MIXING_SUPPORT", "1", 1);
    EXPECT_EQ(ensure_graph_mixing_disabled(), "1");
    EXPECT_STREQ(std::getenv("NCCL_GRAPH_MIXING_SUPPORT"), "1");
    if (before)
        ::setenv("NCCL_GRAPH_MIXING_SUPPORT", saved.c_str(), 1);
    else
        ::unsetenv("NCCL_GRAPH_MIXING_SUPPORT");
}

// accelerate's file for node 1 of 4 x 8 GPUs with DeepSpeed ZeRO-2 (the layout `accelerate config`
// writes: nested deepspeed_config, comments, quoted values, a list).
constexpr const char* kAccelerateYaml = R"(compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 4
  gradient_clipping: 1.0
  offload_optimizer_device: none
  zero_stage: 2
distributed_type: DEEPSPEED   # multi-node
downcast_bf16: 'no'
machine_rank: 1
main_process_ip: "192.168.1.10"
main_process_port: 29501
main_training_function: main
mixed_precision: bf16
num_machines: 4
num_processes: 32
rdzv_backend: static
same_network: true
tpu_env: []
gpu_ids:
  - 0
  - 1
use_cpu: false
)";

TEST(AccelerateConfig, ParsesTheFieldsDtuneUses) {
    auto c = parse_accelerate_config(kAccelerateYaml, "default_config.yaml");
    EXPECT_EQ(c.machine_rank, 1);
    EXPECT_EQ(c.num_machines, 4);
    EXPECT_EQ(c.num_processes, 32);
    EXPECT_EQ(c.main_process_ip, "192.168.1.10");
    EXPECT_EQ(c.main_process_port, 29501);
    EXPECT_EQ(c.mixed_precision, "bf16");
    EXPECT_EQ(c.distributed_type, "DEEPSPEED");
    EXPECT_EQ(c.zero_stage, 2);
    EXPECT_EQ(c.gradient_accumulation_steps, 4);
    EXPECT_EQ(c.gradient_clipping, 1.0);
    EXPECT_EQ(c.offload_optimizer_device, "none");
}

TEST(AccelerateConfig, FlattensNestedKeysAndStripsComments) {
    auto kv = parse_simple_yaml("a:\n  b: 1 # c\n  d:\n    e: 'x # y'\nf: 2\n", "t.yaml");
    EXPECT_EQ(kv.at("a.b"), "1");
    EXPECT_EQ(kv.at("a.d.e"), "x # y");
    EXPECT_EQ(kv.at("f"), "2");
    EXPECT_EQ(kv.size(), 3u);
}

// A bad accelerate config is a configuration error (exit code 2), like a bad flag: FSDP, ZeRO stage
// 4, parameter offload, fp8 and bad values used to be DataErrors (exit code 3, "bad input data").
// ZeRO-3 reaches the trainer as DTUNE_ZERO_STAGE=3; offload_param_device none or cpu passes through.
TEST(AccelerateConfig, ZeroStage3IsPassedToTheRanks) {
    const auto acc =
        parse_accelerate_config("deepspeed_config:\n  zero_stage: 3\n  offload_param_device: none\n", "c");
    EXPECT_EQ(acc.zero_stage, 3);
    LaunchOptions o;
    o.command = {"train"};
    const auto c = resolve_launch_config(o, acc, 2);
    EXPECT_EQ(c.extra_env.at("DTUNE_ZERO_STAGE"), "3");
    EXPECT_EQ(c.extra_env.at("DTUNE_OFFLOAD_PARAM_DEVICE"), "none");
    // Parameter offload (ZeRO-3 only) reaches the ranks the same way.
    const auto offload = parse_accelerate_config(
        "deepspeed_config:\n  zero_stage: 3\n  offload_param_device: cpu\n  offload_optimizer_device: cpu\n",
        "c");
    const auto oc = resolve_launch_config(o, offload, 2);
    EXPECT_EQ(oc.extra_env.at("DTUNE_OFFLOAD_PARAM_DEVICE"), "cpu");
    EXPECT_EQ(oc.extra_env.at("DTUNE_OFFLOAD_OPTIMIZER_DEVICE"), "cpu");
}

TEST(AccelerateConfig, BadValuesNameTheFileAndKey) {
    try {
        parse_accelerate_config("num_machines: two\n", "cfg.yaml");
        FAIL() << "no error";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("cfg.yaml: num_machines"), std::string::npos) << e.what();
    }
    EXPECT_THROW(parse_accelerate_config("distributed_type: FSDP\n", "c"), UsageError);
    EXPECT_THROW(parse_accelerate_config("deepspeed_config:\n  zero_stage: 4\n", "c"), UsageError);
    for (const char* yaml : {"deepspeed_config:\n  offload_param_device: nvme\n  zero_stage: 3\n",
                             "deepspeed_config:\n  offload_param_device: cpu\n  zero_stage: 2\n"}) {
        try {
            parse_accelerate_config(yaml, "acc.yaml");
            FAIL() << "parameter offload accepted: " << yaml;
        } catch (const UsageError& e) {
            EXPECT_NE(std::string(e.what()).find("acc.yaml: deepspeed_config.offload_param_device"),
                      std::string::npos)
                << e.what();
        }
    }
    EXPECT_THROW(parse_accelerate_config("mixed_precision: fp8\n", "c"), UsageError);
    try {
        parse_accelerate_config("deepspeed_config:\n  offload_optimizer_device: nvme\n", "acc.yaml");
        FAIL() << "nvme offload accepted";
    } catch (const UsageError& e) {
        EXPECT_NE(std::string(e.what()).find("acc.yaml: deepspeed_config.offload_optimizer_device: 'nvme'"),
                  std::string::npos)
            << e.what();
    }
    EXPECT_THROW(parse_simple_yaml("a:\n\tb: 1\n", "c"), UsageError);
    EXPECT_THROW(parse_simple_yaml("just text\n", "c"), UsageError);
}

TEST(LaunchConfig, AccelerateFileGivesTheTopology) {
    auto opts = parse_launch_args({"--accelerate_config", "x.yaml", "--", "train", "--config", "c.json"});
    auto acc = parse_accelerate_config(kAccelerateYaml, "x.yaml");
    auto c = resolve_launch_config(opts, acc, 1);
    EXPECT_EQ(c.nproc_per_node, 8);  // 32 processes over 4 machines
    EXPECT_EQ(c.nnodes, 4);
    EXPECT_EQ(c.node_rank, 1);
    EXPECT_EQ(c.world_size(), 32);
    EXPECT_EQ(c.master_addr, "192.168.1.10");
    EXPECT_EQ(c.master_port, 29501);
    EXPECT_EQ(c.extra_env.at("DTUNE_ZERO_STAGE"), "2");
    EXPECT_EQ(c.extra_env.at("DTUNE_MIXED_PRECISION"), "bf16");
    EXPECT_EQ(c.extra_env.at("DTUNE_OFFLOAD_OPTIMIZER_DEVICE"), "none");
    EXPECT_EQ(c.command, (std::vector<std::string>{"train", "--config", "c.json"}));
    // Flags win over the file.
    auto flagged = resolve_launch_config(
        parse_launch_args({"--node_rank=3", "--master_port", "4000", "--", "x"}), acc, 1);
    EXPECT_EQ(flagged.node_rank, 3);
    EXPECT_EQ(flagged.master_port, 4000);
}

TEST(LaunchConfig, FlagsAndDefaults) {
    auto c = resolve_launch_config(parse_launch_args({"--", "version"}), std::nullopt, 3);
    EXPECT_EQ(c.nproc_per_node, 3);  // default: visible GPUs
    EXPECT_EQ(c.nnodes, 1);
    EXPECT_EQ(c.master_addr, "127.0.0.1");
    EXPECT_EQ(c.master_port, 29500);
    EXPECT_EQ(resolve_launch_config(parse_launch_args({"--", "v"}), std::nullopt, 0).nproc_per_node, 1);
}

TEST(LaunchConfig, InconsistentTopologyIsExplained) {
    auto expect_usage = [](const std::vector<std::string>& args, const std::optional<AccelerateConfig>& acc,
                           const std::string& needle) {
        try {
            resolve_launch_config(parse_launch_args(args), acc, 1);
            ADD_FAILURE() << "no error for " << needle;
        } catch (const UsageError& e) {
            EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
        }
    };
    expect_usage({"--nnodes", "2", "--", "x"}, std::nullopt, "--master_addr");
    expect_usage({"--nnodes", "2", "--node_rank", "2", "--master_addr", "h", "--", "x"}, std::nullopt,
                 "node rank 2");
    expect_usage({"--nproc_per_node", "2"}, std::nullopt, "no command");
    AccelerateConfig odd;
    odd.num_machines = 2;
    odd.num_processes = 5;
    odd.main_process_ip = "h";
    expect_usage({"--", "x"}, odd, "not a multiple");
    AccelerateConfig total;
    total.num_processes = 4;
    expect_usage({"--nproc_per_node", "2", "--", "x"}, total, "num_processes=4");
    EXPECT_THROW(parse_launch_args({"--nproc_per_node", "0", "--", "x"}), UsageError);
    EXPECT_THROW(parse_launch_args({"--bogus", "1", "--", "x"}), UsageError);
    EXPECT_THROW(parse_launch_args({"train"}), UsageError);
    EXPECT_THROW(parse_launch_args({"--master_port"}), UsageError);
}

TEST(Launcher, ChildArgvRunsSubcommandsWithDtune) {
    EXPECT_EQ(child_argv({"train", "--x"}, "/bin/dtune"),
              (std::vector<std::string>{"/bin/dtune", "train", "--x"}));
    EXPECT_EQ(child_argv({"./prog", "a"}, "/bin/dtune"), (std::vector<std::string>{"./prog", "a"}));
}

TEST(Launcher, OmpThreadsShareTheNodesCpus) {
    EXPECT_EQ(omp_threads_per_rank(32, 2), 16);
    EXPECT_EQ(omp_threads_per_rank(16, 3), 5);  // rounded down: never more threads than cores
    EXPECT_EQ(omp_threads_per_rank(2, 8), 1);   // at least one
    EXPECT_EQ(omp_threads_per_rank(8, 0), 8);
}

}  // namespace
}  // namespace launch_config_test_local
}  // namespace dtune::dist

// Multi-process tests (label dist): run the real `dtune launch` with 2 to 4 CPU ranks over Gloo on
// this machine. Correctness is judged inside `dist-selftest` against closed forms and a local
// single-process reference; here we check exit codes, messages and that failures end in bounded time.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "support/shell.h"
#include "support/test_support.h"

namespace launch_multi_test_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

struct LaunchRun {
    int exit_code = -1;
    std::string output;  // stdout and stderr
    double seconds = 0;
};

using dtune::test::free_port;

LaunchRun launch(const std::string& args, const std::string& env = "") {
    std::string cmd = env + " " + std::string(DTUNE_BIN) + " launch --master_port " +
                      std::to_string(free_port()) + " " + args + " 2>&1";
    auto start = std::chrono::steady_clock::now();
    LaunchRun r;
    FILE* pipe = ::popen(cmd.c_str(), "r");
    char buf[4096];
    std::size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) r.output.append(buf, n);
    int status = ::pclose(pipe);
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return r;
}

bool contains(const std::string& haystack, const std::string& needle) {
    return haystack.find(needle) != std::string::npos;
}

TEST(DistLaunch, TwoRanksCollectivesAndDataParallel) {
    auto r = launch("--nproc_per_node 2 -- dist-selftest --check all --steps 4");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(contains(r.output, "dist-selftest: OK (2 ranks, gloo)")) << r.output;
    EXPECT_TRUE(contains(r.output, "adamw zero1, 2 ranks")) << r.output;
    EXPECT_TRUE(contains(r.output, "adamw overlap, 2 ranks")) << r.output;
    EXPECT_TRUE(contains(r.output, "adamw zero2, 2 ranks")) << r.output;
}

TEST(DistLaunch, OneRankRunsEveryCheck) {
    // `--nproc_per_node 1` is what a single-GPU `dist-selftest --device cuda` runs: the reducer check
    // must hold for one rank too (a parameter without a gradient on every rank stays without one).
    auto r = launch("--nproc_per_node 1 -- dist-selftest --check all --steps 2");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(contains(r.output, "dist-selftest: OK (1 ranks, single)")) << r.output;
}

TEST(DistLaunch, FourRanksWithGradientAccumulation) {
    auto r = launch("--nproc_per_node 4 -- dist-selftest --check all --steps 3 --batch 2 --accumulate 2");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(contains(r.output, "dist-selftest: OK (4 ranks, gloo)")) << r.output;
    EXPECT_TRUE(contains(r.output, "4 ranks x batch 2 x accumulate 2")) << r.output;
    EXPECT_TRUE(contains(r.output, "sgd zero2, 4 ranks x batch 2 x accumulate 2")) << r.output;
}

TEST(DistLaunch, TwoNodesOnOneHost) {
    // Two launchers, one per node rank, meeting at the same rendezvous port.
    int port = free_port();
    std::string base = std::string(DTUNE_BIN) +
                       " launch --nnodes 2 --nproc_per_node 1 --master_addr 127.0.0.1 " + "--master_port " +
                       std::to_string(port) + " --node_rank ";
    dtune::test::TempDir dir;
    std::string log1 = (dir.path() / "node1.log").string();
    std::string cmd = base + "1 -- dist-selftest --check collectives > " + log1 + " 2>&1 & " + base +
                      "0 -- dist-selftest --check collectives 2>&1; rc=$?; wait $! || rc=1; exit $rc";
    LaunchRun r;
    FILE* pipe = ::popen(cmd.c_str(), "r");
    char buf[4096];
    std::size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) r.output.append(buf, n);
    int status = ::pclose(pipe);
    std::ifstream node1(log1);
    std::string other((std::istreambuf_iterator<char>(node1)), std::istreambuf_iterator<char>());
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << r.output << "\nnode 1:\n" << other;
    EXPECT_TRUE(contains(r.output, "dist-selftest: OK (2 ranks, gloo)")) << r.output;
}

TEST(DistLaunch, KilledRankEndsTheJobNamingIt) {
    auto r = launch(
        "--nproc_per_node 2 --grace_period 3 -- dist-selftest --check fail --fail_rank 1 --fail_how kill");
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_LT(r.seconds, 30.0) << r.output;
    EXPECT_TRUE(contains(r.output, "rank 1 (local rank 1")) << r.output;
    EXPECT_TRUE(contains(r.output, "killed by signal 9")) << r.output;
    EXPECT_TRUE(contains(r.output, "rank 1 failing on purpose")) << r.output;
}

TEST(DistLaunch, FailingRankExitCodeAndStderrAreReported) {
    // The rank exits 3 (bad input data): the launcher passes the code on (it used to exit 1).
    auto r = launch(
        "--nproc_per_node 3 --grace_period 3 -- dist-selftest --check fail --fail_rank 2 --fail_how exit");
    EXPECT_EQ(r.exit_code, 3) << r.output;
    EXPECT_LT(r.seconds, 30.0) << r.output;
    EXPECT_TRUE(contains(r.output, "error: dtune launch: rank 2 (local rank 2")) << r.output;
    EXPECT_TRUE(contains(r.output, "exited with code 3")) << r.output;
    EXPECT_TRUE(contains(r.output, "| dist-selftest: rank 2 failing on purpose (exit)")) << r.output;
}

// Every rank runs this script: rank $FAIL_RANK exits $CODE after $DELAY s; the others wait, and on
// SIGTERM (the launcher stopping them, or forwarding its own) exit $ON_TERM.
std::filesystem::path rank_script(const dtune::test::TempDir& dir) {
    const auto path = dir.path() / "rank.sh";
    std::ofstream(path)
        << "#!/bin/sh\n"
           "sleep 30 >/dev/null 2>&1 &\n"
           "trap 'kill $!; echo \"rank $RANK stops\" >&2; exit $ON_TERM' TERM\n"
           "if [ \"$RANK\" = \"$FAIL_RANK\" ]; then sleep $DELAY; echo \"rank $RANK fails\" >&2; "
           "kill $!; exit $CODE; fi\n"
           "wait\n";
    std::filesystem::permissions(path, std::filesystem::perms::owner_all);
    return path;
}

// The launcher exits with the code of the rank that failed first when it means something to a
// script (2 configuration, 3 input data, 4 stopped after saving), 75 when any rank reported a GPU
// fault, else 1. It used to exit 1 for all of them.
TEST(DistLaunch, RanksExitCodesArePassedOn) {
    dtune::test::TempDir dir;
    const std::string script = rank_script(dir).string();
    auto run = [&](int fail_rank, int code, int on_term) {
        return launch("--nproc_per_node 2 --grace_period 5 -- " + script,
                      "FAIL_RANK=" + std::to_string(fail_rank) + " CODE=" + std::to_string(code) +
                          " DELAY=1 ON_TERM=" + std::to_string(on_term));
    };
    for (int code : {2, 3, 4, 75}) {
        auto r = run(1, code, 0);
        EXPECT_EQ(r.exit_code, code) << r.output;
        EXPECT_TRUE(contains(r.output, "rank 1 (local rank 1")) << r.output;
        EXPECT_TRUE(contains(r.output, "exited with code " + std::to_string(code))) << r.output;
    }
    auto other = run(1, 5, 0);  // no meaning to pass on
    EXPECT_EQ(other.exit_code, 1) << other.output;
    // Ranks disagree: the first failure decides (rank 0's 3, not rank 1's 2 when it is stopped)...
    auto first = run(0, 3, 2);
    EXPECT_EQ(first.exit_code, 3) << first.output;
    EXPECT_TRUE(contains(first.output, "error: dtune launch: rank 0 (local rank 0")) << first.output;
    // ...unless a rank reports a GPU fault: 75 wins, whichever rank was first.
    auto gpu = run(0, 2, 75);
    EXPECT_EQ(gpu.exit_code, 75) << gpu.output;
    EXPECT_TRUE(contains(gpu.output, "error: dtune launch: GPU fault on node 0")) << gpu.output;
}

// SIGTERM to the launcher is forwarded; ranks that save and exit 4 make the launcher exit 4 (it
// exited 143 although every rank had stopped cleanly).
TEST(DistLaunch, SigtermWithCleanStopsExits4) {
    dtune::test::TempDir dir;
    const std::string cmd = "FAIL_RANK=-1 CODE=0 DELAY=0 ON_TERM=4 " + std::string(DTUNE_BIN) +
                            " launch --nproc_per_node 2 --grace_period 5 --master_port " +
                            std::to_string(free_port()) + " -- " + rank_script(dir).string() +
                            " 2>&1 & pid=$!; sleep 2; kill -TERM $pid; wait $pid";
    const auto r = dtune::test::run_shell(cmd);
    EXPECT_EQ(r.exit_code, 4) << r.output;
    EXPECT_TRUE(contains(r.output, "rank 0 stops")) << r.output;
    EXPECT_TRUE(contains(r.output, "rank 1 stops")) << r.output;
    EXPECT_TRUE(contains(r.output, "interrupted by signal 15; every rank saved its state")) << r.output;
}

TEST(DistLaunch, HungRankTimesOutInsteadOfHanging) {
    // Rank 1 never joins; rank 0's all-reduce times out after 3 s, then the launcher stops rank 1.
    auto r = launch(
        "--nproc_per_node 2 --grace_period 2 -- dist-selftest --check fail --fail_rank 1 "
        "--fail_how hang --timeout_s 3");
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_LT(r.seconds, 40.0) << r.output;
    EXPECT_TRUE(contains(r.output, "error: dtune launch: rank 0")) << r.output;
}

TEST(DistLaunch, SigtermIsForwardedToTheRanks) {
    // Both ranks block (rank 1 sleeps, rank 0 waits for it); SIGTERM to the launcher stops them.
    std::string cmd = std::string(DTUNE_BIN) + " launch --nproc_per_node 2 --grace_period 3 --master_port " +
                      std::to_string(free_port()) +
                      " -- dist-selftest --check fail --fail_rank 1 --fail_how hang --timeout_s 120 2>&1 & "
                      "pid=$!; sleep 4; kill -TERM $pid; wait $pid";
    auto start = std::chrono::steady_clock::now();
    LaunchRun r;
    FILE* pipe = ::popen(cmd.c_str(), "r");
    char buf[4096];
    std::size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) r.output.append(buf, n);
    int status = ::pclose(pipe);
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGTERM) << r.output;
    EXPECT_LT(seconds, 30.0) << r.output;
    EXPECT_TRUE(contains(r.output, "interrupted by signal 15")) << r.output;
}

TEST(DistLaunch, RanksShareTheCpusThroughOmpNumThreads) {
    // Unset here (ctest sets it to 1): the launcher gives each rank an equal share of the CPUs this
    // process may use; a value the user set is passed through unchanged.
    cpu_set_t set;
    CPU_ZERO(&set);
    ASSERT_EQ(::sched_getaffinity(0, sizeof set, &set), 0);
    const int share = std::max(1, CPU_COUNT(&set) / 2);
    const std::string launch = std::string(DTUNE_BIN) + " launch --nproc_per_node 2 --master_port " +
                               std::to_string(free_port()) +
                               " -- /bin/sh -c 'echo \"rank $RANK omp=$OMP_NUM_THREADS\"' 2>&1";
    const auto unset = dtune::test::run_shell("env -u OMP_NUM_THREADS " + launch);
    EXPECT_EQ(unset.exit_code, 0) << unset.output;
    EXPECT_TRUE(contains(unset.output, "rank 0 omp=" + std::to_string(share) + "\n")) << unset.output;
    EXPECT_TRUE(contains(unset.output, "rank 1 omp=" + std::to_string(share) + "\n")) << unset.output;
    const auto given = dtune::test::run_shell("OMP_NUM_THREADS=7 " + launch);
    EXPECT_TRUE(contains(given.output, "rank 1 omp=7\n")) << given.output;
}

TEST(DistLaunch, ArgumentErrorsAreExplained) {
    auto r = launch("--nnodes 2 -- version");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, "--master_addr")) << r.output;
    dtune::test::TempDir dir;
    auto yaml = dir.path() / "default_config.yaml";
    std::ofstream(yaml) << "num_machines: 2\nnum_processes: 5\nmain_process_ip: 10.0.0.1\n";
    r = launch("--accelerate_config " + yaml.string() + " -- version");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, "not a multiple of num_machines=2")) << r.output;
    // distributed_type FSDP is a configuration dtune does not run: exit 2, not 3 (bad input data).
    std::ofstream(yaml) << "distributed_type: FSDP\nnum_processes: 2\n";
    r = launch("--accelerate_config " + yaml.string() + " -- version");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(contains(r.output, "distributed_type: 'FSDP' is not supported")) << r.output;
    r = launch("--accelerate_config " + (dir.path() / "missing.yaml").string() + " -- version");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    r = launch("--nproc_per_node 2 -- /nonexistent/program");
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_TRUE(contains(r.output, "exited with code 127")) << r.output;
}

}  // namespace
}  // namespace launch_multi_test_local

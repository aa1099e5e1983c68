// A real two-node run over TCP on one machine (label dist): two network namespaces joined by a veth
// pair (10.213.x.1 and .2), one `dtune launch --nnodes 2 --node_rank i --nproc_per_node 1` in
// each, rendezvous at node 0's veth address, Gloo bound to the veth (GLOO_SOCKET_IFNAME), and one
// output_dir both see (the namespaces share the file system, as NFS would). Judged by: both nodes
// exit 0; each rank checks at the end that its weights equal rank 0's exactly
// (DTUNE_CHECK_RANK_WEIGHTS); the exported weights equal bit for bit those of the same 2-rank job
// over loopback (same ranks, same reduction order: nothing may depend on the transport); the
// gradients really crossed the veth (its byte counters exceed one step's gradients).
//
// Skipped (GTEST_SKIP, reported as skipped by ctest) only when the namespaces cannot be created
// (not root, no CAP_SYS_ADMIN, no iproute2), with the reason printed. The namespaces are removed by
// a destructor, so also when an assertion fails, and stale ones of a killed earlier run are
// removed at the start.
#include <signal.h>

#include <cerrno>
#include <cstring>

#include "dist/train_launch_util.h"

namespace dtune {
namespace netns_two_nodes_test_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

constexpr const char* kPrefix = "dtune-t-";  // namespace names: dtune-t-<pid>-<0|1>

// Namespaces of earlier test processes that are gone (killed by a ctest timeout).
void remove_stale_namespaces() {
    const auto r = run_shell("ip netns list");
    std::istringstream in(r.output);
    for (std::string line; std::getline(in, line);) {
        if (line.rfind(kPrefix, 0) != 0) continue;
        const std::string name = line.substr(0, line.find(' '));
        const long pid = std::atol(name.c_str() + std::strlen(kPrefix));
        if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)
            run_shell("ip netns del '" + name + "'");
    }
}

class NetnsPair {
  public:
    NetnsPair() {
        const std::string tag = std::to_string(::getpid());
        ns_[0] = kPrefix + tag + "-0";
        ns_[1] = kPrefix + tag + "-1";
        veth_[0] = "dtv0-" + tag;  // interface names: at most 15 characters
        veth_[1] = "dtv1-" + tag;
        const int subnet = static_cast<int>(::getpid() % 250);
        addr_[0] = "10.213." + std::to_string(subnet) + ".1";
        addr_[1] = "10.213." + std::to_string(subnet) + ".2";
        if (::geteuid() != 0) {
            skip_ = "not root (uid " + std::to_string(::geteuid()) + "): network namespaces need root";
            return;
        }
        remove_stale_namespaces();
        const auto add = run_shell("ip netns add " + ns_[0] + " && ip netns add " + ns_[1]);
        if (add.exit_code != 0) {
            std::string why = add.output;
            while (!why.empty() && why.back() == '\n') why.pop_back();
            skip_ = "cannot create network namespaces: `ip netns add` exited " +
                    std::to_string(add.exit_code) + (why.empty() ? "" : " (" + why + ")") +
                    "; it needs iproute2 and CAP_SYS_ADMIN";
            run_shell("ip netns del " + ns_[0] + "; ip netns del " + ns_[1]);  // a half-made pair
            return;
        }
        created_ = true;
        std::string setup = "ip link add " + veth_[0] + " netns " + ns_[0] + " type veth peer name " +
                            veth_[1] + " netns " + ns_[1];
        for (int i = 0; i < 2; ++i)
            setup += " && ip -n " + ns_[i] + " addr add " + addr_[i] + "/24 dev " + veth_[i] + " && ip -n " +
                     ns_[i] + " link set " + veth_[i] + " up && ip -n " + ns_[i] + " link set lo up";
        setup_ = run_shell(setup);
    }
    ~NetnsPair() {
        if (created_) run_shell("ip netns del " + ns_[0] + "; ip netns del " + ns_[1]);
    }
    NetnsPair(const NetnsPair&) = delete;
    NetnsPair& operator=(const NetnsPair&) = delete;

    const std::string& skip_reason() const { return skip_; }
    const ShellRun& setup() const { return setup_; }
    const std::string& ns(int i) const { return ns_[i]; }
    const std::string& veth(int i) const { return veth_[i]; }
    const std::string& addr(int i) const { return addr_[i]; }

    // Bytes the node's veth sent and received.
    long long veth_bytes(int i) const {
        const auto r = run_shell("ip -n " + ns_[i] + " -s -j link show dev " + veth_[i]);
        const auto j = nlohmann::json::parse(r.output, nullptr, false);
        if (j.is_discarded() || j.empty()) return -1;
        const auto& s = j[0]["stats64"];
        return s["rx"]["bytes"].get<long long>() + s["tx"]["bytes"].get<long long>();
    }

  private:
    std::string ns_[2], veth_[2], addr_[2], skip_;
    ShellRun setup_;
    bool created_ = false;
};

TEST(DistNetns, TwoNodesInNetworkNamespacesTrainLikeOneHost) {
    NetnsPair net;
    if (!net.skip_reason().empty()) {
        std::printf("SKIP: %s\n", net.skip_reason().c_str());
        GTEST_SKIP() << net.skip_reason();
    }
    ASSERT_EQ(net.setup().exit_code, 0) << "veth set-up failed: " << net.setup().output;

    Workspace w;
    // ZeRO-2 with accumulation: every kind of collective the trainer issues crosses the veth.
    const std::string train_args = "train --config '" + w.config.string() + "' --output_dir '" +
                                   w.out("nodes").string() +
                                   "' --train_batch_size 1 --gradient_accumulation_steps 2 "
                                   "--max_train_steps 3 --zero_stage 2";
    auto node = [&](int i) {
        // One thread per process, as the launcher gives each of 2 local processes in the loopback
        // run (CPU kernels' summation order depends on the thread count).
        return "ip netns exec " + net.ns(i) + " env GLOO_SOCKET_IFNAME=" + net.veth(i) +
               " OMP_NUM_THREADS=1 DTUNE_CHECK_RANK_WEIGHTS=1 " + DTUNE_BIN +
               " launch --grace_period 3 --nnodes 2 --nproc_per_node 1 --node_rank " + std::to_string(i) +
               " --master_addr " + net.addr(0) + " --master_port 29500 -- " + train_args;
    };
    const auto log1 = w.out("node1.log");
    // Node 1 in the background, node 0 in the foreground; the exit status is node 0's, or 1 when
    // node 1 failed.
    const auto r = run_shell(node(1) + " > '" + log1.string() + "' 2>&1 & " + node(0) + " 2>&1" +
                             "; rc=$?; wait $! || rc=1; exit $rc");
    const std::string node1 = fs::read_file(log1);
    ASSERT_EQ(r.exit_code, 0) << "node 0:\n" << r.output << "\nnode 1:\n" << node1;
    EXPECT_TRUE(contains(r.output, "2 ranks over gloo, rendezvous " + net.addr(0))) << r.output;
    EXPECT_TRUE(contains(r.output, "ZeRO stage 2")) << r.output;

    // The same job over loopback on this host.
    const auto local = run_shell(w.train(2, "loopback",
                                         "--train_batch_size 1 --gradient_accumulation_steps 2 "
                                         "--max_train_steps 3 --zero_stage 2"));
    ASSERT_EQ(local.exit_code, 0) << local.output;
    const double diff = max_difference(final_weights(w.out("loopback")), final_weights(w.out("nodes")));
    std::printf("two nodes over veth vs two ranks over loopback: max |dw| = %.3g\n", diff);
    EXPECT_EQ(diff, 0.0);

    // Each step moves the gradients once (every parameter's, reduced to its owner) and the
    // weights back (broadcast from the owner): well over 4 bytes per parameter in all.
    long long params = 0;
    for (const auto& [k, v] : final_weights(w.out("nodes"))) params += v.numel();
    const long long bytes = net.veth_bytes(0);
    std::printf("veth bytes (rx + tx) on node 0: %lld for %lld parameters\n", bytes, params);
    EXPECT_GT(bytes, 4 * params);
}

}  // namespace
}  // namespace netns_two_nodes_test_local
}  // namespace dtune

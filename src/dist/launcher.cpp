// Local-rank supervisor (see launcher.h). One poll() loop watches every child's stderr pipe and a
// self-pipe written by the signal handler; waitpid(WNOHANG) reaps children between polls. Children
// get PR_SET_PDEATHSIG so a launcher killed with SIGKILL does not leave orphans holding GPUs.
#include "dist/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "core/error.h"
#include "core/log.h"
#include "core/thread_pool.h"
#include "dist/env.h"
#include "dist/fault.h"
#include "dist/fault_channel.h"

extern char** environ;

namespace dtune::dist {
namespace {

constexpr std::size_t kTailLines = 20;
int g_signal_pipe[2] = {-1, -1};

// Writes {signal, pid} to the self-pipe. For SIGCHLD the pid is the child that died: SIGCHLDs that
// arrive together coalesce into the first one's siginfo, so the first death is always known even
// when the loop reaps several children at once (a failing rank takes its peers down milliseconds
// later, and the message must name the one that failed first).
void on_signal(int sig, siginfo_t* info, void*) {
    std::int32_t record[2] = {sig, sig == SIGCHLD && info ? static_cast<std::int32_t>(info->si_pid) : 0};
    [[maybe_unused]] auto n = ::write(g_signal_pipe[1], record, sizeof record);
}

struct Child {
    int rank = 0;
    int local_rank = 0;
    pid_t pid = -1;
    int err_fd = -1;  // read end of the child's stderr; -1 once closed
    std::string partial;
    std::deque<std::string> tail;
    bool exited = false;
    int status = 0;
    int death_order = 0;  // from SIGCHLD: 1 for the first child seen dying; 0 unknown
    int reap_order = 0;   // 1 for the first child reaped, 2 for the next...
};
int g_deaths = 0;
int g_reaped = 0;

// Whether `a` failed before `b`, by SIGCHLD order where known, else by reap order.
bool died_before(const Child& a, const Child& b) {
    int ka = a.death_order ? a.death_order : 1 << 30, kb = b.death_order ? b.death_order : 1 << 30;
    return ka != kb ? ka < kb : a.reap_order < b.reap_order;
}

std::string describe_status(int status) {
    if (WIFEXITED(status)) return str("exited with code ", WEXITSTATUS(status));
    if (WIFSIGNALED(status)) {
        int sig = WTERMSIG(status);
        const char* name = sigabbrev_np(sig);
        return str("was killed by signal ", sig, name ? str(" (SIG", name, ")") : std::string());
    }
    return "ended abnormally";
}

bool failed(int status) {
    return !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

// The current environment with `overrides` applied, as KEY=VALUE strings.
std::vector<std::string> child_environment(const std::map<std::string, std::string>& overrides) {
    std::vector<std::string> out;
    for (char** e = environ; *e; ++e) {
        std::string entry = *e;
        if (!overrides.count(entry.substr(0, entry.find('=')))) out.push_back(entry);
    }
    for (const auto& [k, v] : overrides) out.push_back(k + "=" + v);
    return out;
}

pid_t spawn(const std::vector<std::string>& argv, const std::vector<std::string>& envp, int err_write) {
    // Everything the child needs is built before fork: after it, only async-signal-safe calls.
    std::vector<char*> args, envs;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    for (const auto& e : envp) envs.push_back(const_cast<char*>(e.c_str()));
    envs.push_back(nullptr);
    pid_t parent = ::getpid();
    pid_t pid = ::fork();
    if (pid < 0) throw Error(str("fork failed: ", std::strerror(errno)));
    if (pid > 0) return pid;
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::dup2(err_write, STDERR_FILENO);
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    ::signal(SIGCHLD, SIG_DFL);
    ::signal(SIGPIPE, SIG_DFL);  // (ignored in dtune's own process; a dtune worker ignores it again)
    ::execvpe(args[0], args.data(), envs.data());
    const char* msg = "dtune launch: cannot execute the command (not found or not executable)\n";
    [[maybe_unused]] auto n = ::write(STDERR_FILENO, msg, std::strlen(msg));
    ::_exit(127);
}

// Reads what is available on a child's stderr: relays it to ours with a rank prefix, keeps a tail.
void drain(Child& c) {
    char buf[4096];
    ssize_t n = ::read(c.err_fd, buf, sizeof buf);
    if (n <= 0) {
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
        if (!c.partial.empty()) c.tail.push_back(c.partial), c.partial.clear();
        ::close(c.err_fd);
        c.err_fd = -1;
        return;
    }
    c.partial.append(buf, static_cast<std::size_t>(n));
    std::size_t nl;
    while ((nl = c.partial.find('\n')) != std::string::npos) {
        std::string line = c.partial.substr(0, nl);
        c.partial.erase(0, nl + 1);
        std::fprintf(stderr, "[rank %d] %s\n", c.rank, line.c_str());
        c.tail.push_back(line);
        if (c.tail.size() > kTailLines) c.tail.pop_front();
    }
}

// With `failed_rank` >= 0 the signal carries failed_rank + 1 (sigqueue), so a rank told to stop
// because another one failed can say so (train/signals.cpp) instead of reporting a stop request.
void signal_all(std::vector<Child>& children, int sig, int failed_rank = -1) {
    for (auto& c : children) {
        if (c.exited) continue;
        if (failed_rank >= 0 && sig != SIGKILL) {
            sigval value{};
            value.sival_int = failed_rank + 1;
            ::sigqueue(c.pid, sig, value);
        } else {
            ::kill(c.pid, sig);
        }
    }
}

// Polls stderr pipes and the signal pipe for up to `ms`, reaps exited children.
// Returns a forwarded signal number, or 0.
int pump(std::vector<Child>& children, int ms) {
    std::vector<pollfd> fds{{g_signal_pipe[0], POLLIN, 0}};
    for (auto& c : children)
        if (c.err_fd >= 0) fds.push_back({c.err_fd, POLLIN, 0});
    int got_signal = 0;
    if (::poll(fds.data(), fds.size(), ms) > 0) {
        std::int32_t record[2];
        // SIGCHLD records the order of deaths; other signals are forwarded by the caller.
        while ((fds[0].revents & POLLIN) &&
               ::read(g_signal_pipe[0], record, sizeof record) == sizeof record) {
            if (record[0] != SIGCHLD) {
                got_signal = record[0];
                continue;
            }
            for (auto& c : children)
                if (c.pid == record[1] && c.death_order == 0) c.death_order = ++g_deaths;
        }
        for (auto& c : children)
            for (std::size_t i = 1; i < fds.size(); ++i)
                if (c.err_fd >= 0 && fds[i].fd == c.err_fd && fds[i].revents) drain(c);
    }
    for (auto& c : children) {
        if (c.exited) continue;
        int status = 0;
        if (::waitpid(c.pid, &status, WNOHANG) == c.pid) {
            c.exited = true;
            c.status = status;
            c.reap_order = ++g_reaped;
        }
    }
    return got_signal;
}

bool all_exited(const std::vector<Child>& children) {
    for (const auto& c : children)
        if (!c.exited) return false;
    return true;
}

// SIGTERM (or `first_signal`) to the survivors, SIGKILL after the grace period; drains stderr.
// `failed_rank`: the rank whose failure ends the job (-1: a signal to the launcher).
void stop_all(std::vector<Child>& children, int first_signal, double grace_s, int failed_rank = -1) {
    signal_all(children, first_signal, failed_rank);
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(grace_s);
    while (!all_exited(children) && std::chrono::steady_clock::now() < deadline) pump(children, 50);
    if (!all_exited(children)) {
        log::warn() << "dtune launch: ranks still running " << grace_s << " s after SIGTERM; sending SIGKILL";
        signal_all(children, SIGKILL);
        while (!all_exited(children)) pump(children, 50);
    }
    for (int i = 0; i < 20; ++i) pump(children, 0);  // flush what is left in the pipes
}

// A rank's exit code for a GPU fault: the launcher exits with it too.
constexpr int kGpuFaultExit = static_cast<int>(ExitCode::kGpuFault);

// The "GPU fault on node ..." line a rank printed (the one whose monitor or step saw the fault),
// else the line saying which rank reported it, else a peer's "rank X stops because rank R failed
// on node N (GPU g): ..." (the failing rank ran on another node).
std::string fault_line(const std::vector<Child>& children) {
    for (const char* needle : {"GPU fault on node ", "GPU fault reported by rank "})
        for (const auto& c : children)
            for (const auto& line : c.tail)
                if (auto at = line.find(needle); at != std::string::npos) return line.substr(at);
    for (const auto& c : children)
        for (const auto& line : c.tail)
            if (origin_rank_in(line) >= 0) {
                const auto at = line.find(str("rank ", c.rank, " stops"));
                return line.substr(at == std::string::npos ? 0 : at);
            }
    return "a rank exited with code 75 (GPU fault) without saying which GPU";
}

// Reads a child's stderr to the end (bounded: a grandchild may hold the pipe open).
void drain_to_end(Child& c) {
    for (int i = 0; i < 200 && c.err_fd >= 0; ++i) {
        pollfd p{c.err_fd, POLLIN, 0};
        if (::poll(&p, 1, 10) <= 0) break;
        drain(c);
    }
}

// The local child that `c` says failed first ("rank X stops because rank R failed", through the
// fault channel), once it has exited with a failure within `grace_s`; else `c`. A peer stopped by
// the channel often exits before the failing rank (which is still flushing webhooks), and the
// report must name the rank that failed, not the one it took down.
int origin_rank(const Child& c) {
    int origin = -1;
    for (const auto& line : c.tail)
        if (int r = origin_rank_in(line); r >= 0) origin = r;
    return origin;
}

Child& origin_of(std::vector<Child>& children, Child& c, double grace_s) {
    const int origin = origin_rank(c);
    Child* o = nullptr;
    for (auto& other : children)
        if (other.rank == origin && &other != &c) o = &other;
    if (!o) return c;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(grace_s);
    while (!o->exited && std::chrono::steady_clock::now() < deadline) pump(children, 50);
    if (!o->exited || !failed(o->status)) return c;
    drain_to_end(*o);
    return *o;
}

std::string failure_message(const Child& c) {
    std::string msg = str("rank ", c.rank, " (local rank ", c.local_rank, ", pid ", c.pid, ") ",
                          describe_status(c.status), "; the other ranks were stopped.");
    if (c.tail.empty()) return msg + " It wrote nothing to stderr.";
    msg += " Its last stderr lines:";
    for (const auto& line : c.tail) msg += "\n  | " + line;
    return msg;
}

// The code a rank's exit passes on to the launcher's: dtune's meaningful codes (2 configuration,
// 3 input data, 4 stopped after saving, 75 GPU fault) as they are, anything else (1, a crash, a
// signal, 127 for a missing program) as 1.
int passed_on(int status) {
    if (!WIFEXITED(status)) return 1;
    const int code = WEXITSTATUS(status);
    return code == 2 || code == 3 || code == 4 || code == kGpuFaultExit ? code : 1;
}

// A rank that exited with 75: a GPU fault anywhere in the job decides the launcher's code.
const Child* gpu_fault_child(const std::vector<Child>& children, const Child* first) {
    if (first && WIFEXITED(first->status) && WEXITSTATUS(first->status) == kGpuFaultExit) return first;
    for (const auto& c : children)
        if (c.exited && WIFEXITED(c.status) && WEXITSTATUS(c.status) == kGpuFaultExit) return &c;
    return nullptr;
}

// Exit 75 naming the node, rank and GPU of the fault that child `c` reported.
LaunchResult gpu_fault_result(const std::vector<Child>& children, const Child& c, int node_rank) {
    const int origin = origin_rank(c);
    bool origin_here = false;
    for (const auto& other : children) origin_here = origin_here || other.rank == origin;
    // Keep the orchestrator's signal (75: replace this machine) and say which GPU.
    const std::string where = origin >= 0 && origin != c.rank && !origin_here
                                  ? str("GPU fault on rank ", origin, " (another node): ")
                                  : str("GPU fault on node ", node_rank, ": ");
    return {kGpuFaultExit, where + fault_line(children) + "\n" + failure_message(c)};
}

// The launcher's result after child `c` failed first (the others are stopped): 75 when any rank
// reported a GPU fault, else what `c`'s exit passes on (passed_on).
LaunchResult failure_result(const std::vector<Child>& children, const Child& c, int node_rank) {
    if (const Child* gpu = gpu_fault_child(children, &c)) return gpu_fault_result(children, *gpu, node_rank);
    // A rank the fault channel stopped names the rank that failed first; when that one
    // does not run here (another node), say so before this rank's report.
    const int origin = origin_rank(c);
    bool origin_here = false;
    for (const auto& other : children) origin_here = origin_here || other.rank == origin;
    std::string cause;
    if (origin >= 0 && origin != c.rank)
        cause = str("rank ", origin, origin_here ? " failed first" : " failed (on another node)", "; ");
    return {passed_on(c.status), cause + failure_message(c)};
}

// The launcher's result after it forwarded signal `sig` and every rank has ended: 4 when the ranks
// stopped cleanly after saving (each exited 4, or 0 having finished anyway), 75 when one reported
// a GPU fault, else 128 + sig naming a rank that did not stop cleanly.
LaunchResult interrupted_result(const std::vector<Child>& children, int sig, int node_rank) {
    if (const Child* gpu = gpu_fault_child(children, nullptr))
        return gpu_fault_result(children, *gpu, node_rank);
    const Child* unclean = nullptr;
    bool saved = false;
    for (const auto& c : children) {
        const int code = WIFEXITED(c.status) ? WEXITSTATUS(c.status) : -1;
        saved = saved || code == static_cast<int>(ExitCode::kInterrupted);
        if (code != 0 && code != static_cast<int>(ExitCode::kInterrupted) && !unclean) unclean = &c;
    }
    if (!unclean && saved)
        return {static_cast<int>(ExitCode::kInterrupted),
                str("interrupted by signal ", sig, "; every rank saved its state and stopped (exit code 4)")};
    if (!unclean) return {};  // the ranks had finished: the job is complete
    return {128 + sig, str("interrupted by signal ", sig, "; all ranks stopped (rank ", unclean->rank, " ",
                           describe_status(unclean->status), ")")};
}

// A rank died here without a chance to say so (SIGKILL, the OOM killer, a crash): publish its
// failure in the job's fault channel on its behalf, so that the other ranks, possibly blocked in a
// collective, stop within a poll interval naming it, instead of reporting the backend's bare error
// ("Connection closed by peer") or, on other nodes, waiting for the collective timeout. On one node
// only deaths by a signal need it: a rank that exits with a code published its own record, or had
// not joined the group yet. Rank 0 hosts the store (its death is seen as a lost store) and a rank
// that published its own record wins (the first record stays). Bounded: a store that does not
// answer within a few seconds is logged and skipped.
void publish_for_dead_rank(const LaunchConfig& config, const Child& c) {
    if (c.rank == 0 || (config.nnodes < 2 && !WIFSIGNALED(c.status))) return;
    FaultRecord record;
    record.rank = c.rank;
    record.exit_code = WIFEXITED(c.status) ? WEXITSTATUS(c.status) : 128 + WTERMSIG(c.status);
    record.kind = "error";
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    record.node = host;
    record.message =
        str("rank ", c.rank, " (local rank ", c.local_rank, ", pid ", c.pid, ") ", describe_status(c.status),
            " (reported by dtune launch on node ", config.node_rank, ")");
    try {
        c10d::TCPStoreOptions opts;
        opts.port = static_cast<std::uint16_t>(config.master_port);
        opts.isServer = false;
        opts.waitWorkers = false;
        opts.timeout = std::chrono::seconds(5);
        auto store = c10::make_intrusive<c10d::TCPStore>(config.master_addr, opts);
        const FaultRecord now = publish_fault_record(*store, record);
        if (now.rank == record.rank)
            log::info() << "dtune launch: told the other " << (config.nnodes > 1 ? "nodes" : "ranks")
                        << " that rank " << c.rank << " failed";
    } catch (const std::exception& e) {
        log::warn() << "dtune launch: could not tell the other ranks that rank " << c.rank
                    << " failed (store at " << config.master_addr << ":" << config.master_port
                    << " unreachable: " << e.what() << ")";
    }
}

}  // namespace

int omp_threads_per_rank(int cpus, int nproc_per_node) {
    return std::max(1, cpus / std::max(1, nproc_per_node));
}

std::vector<std::string> child_argv(const std::vector<std::string>& command, const std::string& self_exe) {
    if (!command.empty() && command[0].find('/') != std::string::npos) return command;
    std::vector<std::string> argv{self_exe};
    argv.insert(argv.end(), command.begin(), command.end());
    return argv;
}

LaunchResult run_local_ranks(const LaunchConfig& config, const std::string& self_exe) {
    if (::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) throw Error("pipe failed");
    struct sigaction sa {};
    sa.sa_sigaction = on_signal;
    sa.sa_flags = SA_SIGINFO;
    ::sigaction(SIGINT, &sa, nullptr);
    ::sigaction(SIGTERM, &sa, nullptr);
    sa.sa_flags = SA_SIGINFO | SA_NOCLDSTOP;
    ::sigaction(SIGCHLD, &sa, nullptr);

    std::string nvls = ensure_nvls_disabled();
    log::info() << "dtune launch: node " << config.node_rank << "/" << config.nnodes << ", "
                << config.nproc_per_node << " process(es) here, world size " << config.world_size()
                << ", rendezvous " << config.master_addr << ":" << config.master_port
                << ", NCCL_NVLS_ENABLE=" << nvls;
    auto argv = child_argv(config.command, self_exe);
    std::vector<Child> children(static_cast<std::size_t>(config.nproc_per_node));
    for (int local = 0; local < config.nproc_per_node; ++local) {
        DistEnv env;
        env.local_rank = local;
        env.rank = config.node_rank * config.nproc_per_node + local;
        env.world_size = config.world_size();
        env.local_world_size = config.nproc_per_node;
        env.master_addr = config.master_addr;
        env.master_port = config.master_port;
        auto vars = dist_env_vars(env);
        vars["GROUP_RANK"] = vars["NODE_RANK"] = std::to_string(config.node_rank);
        vars.insert(config.extra_env.begin(), config.extra_env.end());
        // Several ranks on one node would oversubscribe the cores with one full OpenMP pool each.
        if (!std::getenv("OMP_NUM_THREADS") && config.nproc_per_node > 1)
            vars["OMP_NUM_THREADS"] =
                std::to_string(omp_threads_per_rank(usable_cpus(), config.nproc_per_node));
        int fds[2];
        if (::pipe2(fds, O_CLOEXEC) != 0) throw Error("pipe failed");
        Child& c = children[static_cast<std::size_t>(local)];
        c.rank = env.rank;
        c.local_rank = local;
        c.pid = spawn(argv, child_environment(vars), fds[1]);
        ::close(fds[1]);
        ::fcntl(fds[0], F_SETFL, O_NONBLOCK);
        c.err_fd = fds[0];
    }

    LaunchResult result;
    while (!all_exited(children)) {
        if (int sig = pump(children, 200)) {
            log::warn() << "dtune launch: got signal " << sig << "; forwarding it to the ranks";
            stop_all(children, sig, config.grace_period_s);
            return interrupted_result(children, sig, config.node_rank);
        }
        Child* first = nullptr;
        for (auto& c : children)
            if (c.exited && failed(c.status) && (!first || died_before(c, *first))) first = &c;
        if (first) {
            drain_to_end(*first);  // the child is gone: its last lines are in the pipe
            publish_for_dead_rank(config, *first);
            Child& c = origin_of(children, *first, config.grace_period_s);
            stop_all(children, SIGTERM, config.grace_period_s, c.rank);
            return failure_result(children, c, config.node_rank);
        }
    }
    for (int i = 0; i < 20; ++i) pump(children, 0);
    return result;
}

}  // namespace dtune::dist

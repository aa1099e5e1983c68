// Stop-request flag set by SIGINT/SIGTERM (see signals.h).
#include "train/signals.h"

#include <algorithm>
#include <atomic>
#include <csignal>

#include <unistd.h>

namespace dtune::train {
namespace {

std::atomic<int> g_requests{0};
std::atomic<int> g_signal{0};
std::atomic<int> g_gpu_fault{0};  // faulty GPU index + 1 (unknown: 1), 0 when none
std::atomic<int> g_shutdown{0};   // 1 after begin_shutdown(), +1 per signal received since
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free atomic");

void write_stderr(const char* text, size_t n) {
    const ssize_t ignored = write(STDERR_FILENO, text, n);
    (void)ignored;
}

// `dtune launch` stopping this rank because rank `failed` failed (a SIGTERM from the parent that
// carries failed + 1): there is nothing to save, since the job cannot finish a step without that
// rank. Async-signal-safe: the number is formatted by hand.
void report_peer_failure(int failed) {
    char digits[16];
    int n = 0;
    do digits[n++] = static_cast<char>('0' + failed % 10);
    while ((failed /= 10) > 0 && n < 15);
    char line[160] = "\ndtune: rank ";
    size_t len = sizeof "\ndtune: rank " - 1;
    while (n > 0) line[len++] = digits[--n];
    static const char kRest[] =
        " failed, so dtune launch is stopping this rank; nothing is saved (the last complete "
        "checkpoint, if any, is intact)\n";
    for (const char* p = kRest; *p && len < sizeof line; ++p) line[len++] = *p;
    write_stderr(line, len);
}

extern "C" void on_stop_signal(int signo, siginfo_t* info, void*) {
    if (g_shutdown.load() > 0) {
        // Nothing is left to save: stop waiting (webhooks); a second signal leaves at once.
        if (g_shutdown.fetch_add(1) >= 2) _exit(128 + signo);
        static const char kLeaving[] =
            "\ndtune: stop requested; the run is over, leaving without waiting for webhooks\n";
        write_stderr(kLeaving, sizeof kLeaving - 1);
        return;
    }
    if (g_requests.fetch_add(1) >= 1) _exit(128 + signo);  // second signal: leave now
    g_signal.store(signo);
    if (info && info->si_code == SI_QUEUE && info->si_pid == getppid() && info->si_value.sival_int > 0) {
        report_peer_failure(info->si_value.sival_int - 1);
        return;
    }
    static const char kMessage[] =
        "\ndtune: stop requested; saving a checkpoint at the end of this step (press again to exit at "
        "once)\n";
    write_stderr(kMessage, sizeof kMessage - 1);
}

}  // namespace

void install_stop_signal_handlers() {
    clear_stop_request();
    struct sigaction action {};
    action.sa_sigaction = on_stop_signal;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, nullptr);
    sigaction(SIGTERM, &action, nullptr);
}

bool stop_requested() {
    return g_requests.load() > 0;
}

int stop_signal() {
    return g_signal.load();
}

void request_stop() {
    g_requests.fetch_add(1);
}

void clear_stop_request() {
    g_requests.store(0);
    g_signal.store(0);
    g_gpu_fault.store(0);
    g_shutdown.store(0);
}

void begin_shutdown() {
    int expected = 0;
    g_shutdown.compare_exchange_strong(expected, 1);
}

bool shutdown_signal_received() {
    return g_shutdown.load() > 1;
}

void request_gpu_fault_stop(int gpu_index) {
    // The first request wins (it names the GPU that tripped the breaker first).
    int expected = 0;
    g_gpu_fault.compare_exchange_strong(expected, 1 + std::max(0, gpu_index));
}

int gpu_fault_request() {
    return g_gpu_fault.load();
}

}  // namespace dtune::train

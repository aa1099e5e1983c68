// Ctrl-C / SIGTERM handling for training: the first signal asks the loop to save a checkpoint and
// stop at the next step boundary; a second one exits the process at once (exit code 128 + signal).
// Once the run has ended and its state is saved (begin_shutdown), a signal means "do not wait":
// the webhook flush stops at once and the process exits with the run's own code.
// A SIGTERM that `dtune launch` sends because another rank failed carries that rank (sigqueue):
// the handler then says "rank R failed … nothing is saved" instead of announcing a checkpoint.
// Async-signal-safe: the handler only touches lock-free atomics, write() and _exit.
#pragma once

namespace dtune::train {

// Installs the SIGINT/SIGTERM handlers (idempotent) and clears any earlier request.
void install_stop_signal_handlers();
// True once a stop was requested (by a signal or request_stop()).
bool stop_requested();
// The signal that asked to stop (0 when none or request_stop()).
int stop_signal();
// Asks the loop to stop as a first signal would (tests, the GPU circuit breaker).
void request_stop();
void clear_stop_request();

// The run is over and everything is saved: from now on a signal cuts the remaining waits short
// (shutdown_signal_received) instead of asking for a checkpoint; a second one exits at once.
void begin_shutdown();
bool shutdown_signal_received();

// The GPU circuit breaker's stop: training ends on every rank at the next step boundary without a
// checkpoint, and the process exits with ExitCode::kGpuFault. `gpu_index` is the faulty GPU on
// this node (-1 when unknown). Thread-safe (called from the health monitor thread).
void request_gpu_fault_stop(int gpu_index);
// The GPU index + 1 of a requested fault stop, 0 when none.
int gpu_fault_request();

}  // namespace dtune::train

// Test hooks that make one rank fail at a chosen point, so that the tests can check what the other
// ranks, the launcher and the files on disk do then. Unset: nothing happens.
//
// DTUNE_INJECT_STEP_ERROR=<kind>:<rank>:<step> makes that rank fail inside that training step
// (1-based), before its forward, so the other ranks are left waiting in the gradient all-reduce,
// the case the fault channel exists for. DTUNE_INJECT_SAVE_ERROR=<kind>:<rank>:<step> makes it fail
// while the checkpoint of that step is saved, right after the rank has written its own files of it
// (its optimizer shard, its RNG states; rank 0 also the weights) into checkpoint-<step>-tmp and
// before the checkpoint is complete: the other ranks wait for it to finish writing, and the
// previous checkpoint must survive. Kinds: "cuda" throws what libtorch throws for an illegal memory
// access (c10::AcceleratorError, classified as a GPU fault: exit 75); "error" throws a plain
// std::runtime_error (exit 1); "kill" prints one line and raises SIGKILL on the process, a death
// it cannot report itself (`dtune launch` does).
#pragma once

#include <cstdint>

namespace dtune::train {

// Throws as DTUNE_INJECT_STEP_ERROR asks when (rank, step) match; UsageError for a malformed value.
void inject_step_error(int rank, int64_t step);

// The same for DTUNE_INJECT_SAVE_ERROR, called by the save of `step`'s checkpoint.
void inject_save_error(int rank, int64_t step);

// Where the failure is injected, from DTUNE_INJECT_POINT (read once at the start of training):
// kStep (unset or "step") before the step's forward; kZero3Gather ("zero3_gather") instead of the
// step's start, just before that rank's 3rd ZeRO-3 all-gather of the step (mid-forward), so the
// other ranks wait inside the all-gather. UsageError for another value.
enum class InjectPoint { kStep, kZero3Gather };
InjectPoint inject_point();

}  // namespace dtune::train

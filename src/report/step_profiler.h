// DTUNE_PROFILE_STEPS=A:B: a Kineto trace (GPU kernels, or CPU operators without CUDA) of optimizer
// steps A..B of a real `dtune train` run, written by each rank to
// <output_dir>/profile/trace_rank<R>.json (bench/summarize_trace.py --steps <B-A+1> reads it).
// add_observers reads the variable once and passes its value here.
#pragma once

#include <memory>

#include "train/callbacks.h"

namespace dtune::report {

// `spec` is the variable's value: null or empty gives null; "A:B" or "A" (1-based optimizer steps)
// an observer; anything else is a UsageError naming DTUNE_PROFILE_STEPS and the form.
std::shared_ptr<train::TrainCallback> make_step_profiler(const char* spec);

}  // namespace dtune::report

// Peak GPU memory of this process on a CUDA device (what metrics.jsonl and the report show).
// Invariant: nullopt for CPU devices and for builds without CUDA; never initialises CUDA itself.
#pragma once

#include <c10/core/Device.h>

#include <optional>

namespace dtune {

// Peak bytes allocated by the caching allocator on `device` since start (or the last reset), in GiB.
std::optional<double> peak_gpu_memory_gib(c10::Device device);

// Starts a new peak from what is allocated now (the trainer: after loading and caching, so that
// metrics.jsonl reports the training steps' peak). No-op where peak_gpu_memory_gib is nullopt.
void reset_peak_gpu_memory(c10::Device device);

}  // namespace dtune

// Peak GPU memory of this process on a CUDA device (what metrics.jsonl and the report show).
// Invariant: nullopt for CPU devices and for builds without CUDA; never initialises CUDA itself.
#pragma once

#include <c10/core/Device.h>

#include <optional>

namespace dtune {

// Peak bytes allocated by the caching allocator on `device` since start, in GiB.
std::optional<double> peak_gpu_memory_gib(c10::Device device);

}  // namespace dtune

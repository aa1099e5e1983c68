// Peak GPU memory (see gpu_memory.h).
#include "core/gpu_memory.h"

#if defined(DTUNE_WITH_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace dtune {

std::optional<double> peak_gpu_memory_gib(c10::Device device) {
#if defined(DTUNE_WITH_CUDA)
    if (!device.is_cuda()) return std::nullopt;
    const auto stats =
        c10::cuda::CUDACachingAllocator::getDeviceStats(device.has_index() ? device.index() : 0);
    constexpr size_t kAggregate = 0;  // StatType::AGGREGATE
    return static_cast<double>(stats.allocated_bytes[kAggregate].peak) / (1024.0 * 1024.0 * 1024.0);
#else
    (void)device;
    return std::nullopt;
#endif
}

void reset_peak_gpu_memory(c10::Device device) {
#if defined(DTUNE_WITH_CUDA)
    if (!device.is_cuda()) return;
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.has_index() ? device.index() : 0);
#else
    (void)device;
#endif
}

}  // namespace dtune

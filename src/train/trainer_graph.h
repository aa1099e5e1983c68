// `cuda_graph: true` for `dtune train`: which runs may train through train::GraphedStep (the whole
// optimizer step as one CUDA graph per batch shape). The trainer's side lives in trainer_graph.cpp.
//
// Invariant: a run that any condition rules out trains exactly as with cuda_graph false (same
// code path, same weights); the first unmet condition is logged once, with the fix.
#pragma once

#include <c10/core/Device.h>

#include <string>

namespace dtune::train {

class TrainConfig;

// Empty when a run on `device` with `world_size` processes (ZeRO stage `zero_stage`) can use the
// graphed step; otherwise the first unmet condition, phrased for the log ("... ; set X to train
// with CUDA graphs").
std::string cuda_graph_blocker(const TrainConfig& config, c10::Device device, int world_size,
                               int zero_stage = 0);

}  // namespace dtune::train

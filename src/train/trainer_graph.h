// `cuda_graph: true` for `dtune train`: which runs may train through train::GraphedStep (the whole
// optimizer step as one CUDA graph per batch shape; with gradient_accumulation_steps above 1, two:
// one replayed for each micro-step before the last, one for the last with the reduction, clipping
// and update). The trainer's side lives in trainer_graph.cpp.
//
// Invariant: a run that any condition rules out trains exactly as with cuda_graph false (same
// code path, same weights); the first unmet condition is logged once, with the fix.
#pragma once

#include <c10/core/Device.h>

#include <string>

namespace dtune::family {
struct TrainingObjective;
}  // namespace dtune::family

namespace dtune::train {

class TrainConfig;

// Empty when a run on `device` with `world_size` processes (ZeRO stage `zero_stage`) can use the
// graphed step; otherwise the first unmet condition, phrased for the log ("... ; set X to train
// with CUDA graphs"). `objective` (when given) would add the objective's own conditions: none today,
// since every flow-matching sigma schedule is drawn on the device (diffusion::draw_flow_sigmas).
std::string cuda_graph_blocker(const TrainConfig& config, c10::Device device, int world_size,
                               int zero_stage = 0, const family::TrainingObjective* objective = nullptr);

// Why the run trains eagerly under the config's cuda_graph (auto | true), as Trainer::graph_status()
// reports it on `device`; empty when it uses graphs. cuda_graph_blocker's conditions first, then
// the objectives graphed only on request: with cuda_graph auto, flow matching stays eager until its
// graphed step has been checked on a GPU.
std::string cuda_graph_fallback(const TrainConfig& config, const family::TrainingObjective& objective,
                                c10::Device device, int world_size, int zero_stage = 0);

}  // namespace dtune::train

// SDXL as a model family (family/model_family.h; implementation notes in sdxl_family.cpp).
#pragma once

#include <vector>

#include "family/model_family.h"

namespace dtune::family {

// The sdxl family (one instance; family_named("sdxl") returns it).
const ModelFamily& sdxl_family();

// SDXL time ids of one sample from its bucket metadata: [intermediary h, intermediary w, crop top,
// crop left, target h, target w] (SIMPLETUNER.md §1.3). For a mirrored draw the crop left is the
// crop's left edge in the mirrored image (data::mirrored_crop_left).
std::vector<double> sdxl_time_ids(const data::SamplePlan& plan, bool flipped = false);
// The batch's time_ids [B, 6] (the family's per-sample conditioning).
void add_sdxl_time_ids(Conditioning& batch, const std::vector<data::SamplePlan>& plans,
                       const std::vector<bool>& flips);

}  // namespace dtune::family

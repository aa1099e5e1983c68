// Flux.1 [dev]/[schnell] as a model family (family/model_family.h; notes in flux_family.cpp).
#pragma once

#include "family/model_family.h"

namespace dtune::family {

// The flux family (one instance; family_named("flux") returns it).
const ModelFamily& flux_family();

}  // namespace dtune::family

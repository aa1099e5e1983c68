// Small helpers shared by the model tests: reading fixture tensors and comparing them.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "io/safetensors.h"

namespace dtune::test {

inline double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
    return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// A fixture tensor copied out of the mapping (tests mutate nothing, but keep lifetimes simple).
inline at::Tensor fixture_tensor(const io::SafetensorsFile& file, const std::string& name) {
    return file.get(name).clone();
}

}  // namespace dtune::test

// Small helpers shared by the model tests: reading fixture tensors and comparing them.
#pragma once

#include <ATen/ATen.h>

#include <iostream>
#include <string>

#include "io/safetensors.h"

namespace dtune::test {

inline double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
    return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// max_abs_diff, also printed so parity logs show the margin left under the tolerance.
inline double reported_diff(const std::string& what, const at::Tensor& a, const at::Tensor& b) {
    const double d = max_abs_diff(a, b);
    std::cout << "  max abs error " << what << ": " << d << std::endl;
    return d;
}

// A fixture tensor copied out of the mapping (tests mutate nothing, but keep lifetimes simple).
inline at::Tensor fixture_tensor(const io::SafetensorsFile& file, const std::string& name) {
    return file.get(name).clone();
}

}  // namespace dtune::test

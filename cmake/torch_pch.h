// Precompiled header: ATen (tensors, ops, autograd-aware) and nlohmann/json, which most
// translation units with tensor code include. Deliberately small: loading a PCH costs time in
// every TU that uses it (measured on 2 cores, -O1: ATen-only PCH ~2.4 s per TU; adding the
// torch/nn module headers ~8.7 s per TU, more than most files take to compile without it).
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

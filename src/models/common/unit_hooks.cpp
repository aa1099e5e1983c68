// The unit hook registry (see unit_hooks.h).
#include "models/common/unit_hooks.h"

#include <atomic>
#include <map>
#include <mutex>
#include <shared_mutex>

namespace dtune::models {
namespace {

std::atomic<int> g_registered{0};  // fast path: no lookup while nothing is registered

std::shared_mutex& registry_mutex() {
    static std::shared_mutex m;
    return m;
}

std::map<const torch::nn::Module*, UnitHooks*>& registry() {
    static std::map<const torch::nn::Module*, UnitHooks*> r;
    return r;
}

thread_local bool t_recompute = false;
thread_local uint64_t t_checkpoint_call = 0;

}  // namespace

void set_unit_hooks(const torch::nn::Module& unit, UnitHooks* hooks) {
    std::unique_lock lock(registry_mutex());
    auto& r = registry();
    if (hooks)
        r[&unit] = hooks;
    else
        r.erase(&unit);
    g_registered.store(static_cast<int>(r.size()), std::memory_order_release);
}

UnitHooks* unit_hooks_of(const torch::nn::Module& unit) {
    if (g_registered.load(std::memory_order_acquire) == 0) return nullptr;
    std::shared_lock lock(registry_mutex());
    const auto it = registry().find(&unit);
    return it == registry().end() ? nullptr : it->second;
}

bool in_recompute() {
    return t_recompute;
}

RecomputeScope::RecomputeScope() : previous_(t_recompute) {
    t_recompute = true;
}

RecomputeScope::~RecomputeScope() {
    t_recompute = previous_;
}

uint64_t checkpoint_call() {
    return t_checkpoint_call;
}

CheckpointCallScope::CheckpointCallScope(uint64_t call) : previous_(t_checkpoint_call) {
    t_checkpoint_call = call;
}

CheckpointCallScope::~CheckpointCallScope() {
    t_checkpoint_call = previous_;
}

namespace {

void collect(const std::string& prefix, const std::shared_ptr<torch::nn::Module>& module,
             std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>& out) {
    for (const auto& child : module->named_children()) {
        const std::string name = prefix.empty() ? child.key() : prefix + "." + child.key();
        if (dynamic_cast<const HookableUnit*>(child.value().get()))
            out.emplace_back(name, child.value());
        else
            collect(name, child.value(), out);
    }
}

}  // namespace

std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> find_units(torch::nn::Module& root) {
    std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> out;
    for (const auto& child : root.named_children()) {
        if (dynamic_cast<const HookableUnit*>(child.value().get()))
            out.emplace_back(child.key(), child.value());
        else
            collect(child.key(), child.value(), out);
    }
    return out;
}

at::Tensor run_unit(const torch::nn::Module& unit, const std::function<at::Tensor()>& body) {
    UnitHooks* hooks = unit_hooks_of(unit);
    if (!hooks) return body();
    const bool recompute = in_recompute();
    hooks->before_unit(unit, recompute);
    at::Tensor out = body();
    hooks->after_unit(unit, recompute, {out});
    return out;
}

std::pair<at::Tensor, at::Tensor> run_unit_pair(
    const torch::nn::Module& unit, const std::function<std::pair<at::Tensor, at::Tensor>()>& body) {
    UnitHooks* hooks = unit_hooks_of(unit);
    if (!hooks) return body();
    const bool recompute = in_recompute();
    hooks->before_unit(unit, recompute);
    auto out = body();
    hooks->after_unit(unit, recompute, {out.first, out.second});
    return out;
}

}  // namespace dtune::models

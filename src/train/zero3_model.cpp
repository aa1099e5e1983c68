// Units of a model for the ZeRO-3 engine (see zero3_model.h).
#include "train/zero3_model.h"

#include <ATen/SequenceNumber.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include <atomic>
#include <functional>
#include <set>

#include "core/error.h"
#include "core/log.h"

namespace dtune::train {

ShardedModel::ShardedModel(dist::Group& group, torch::nn::Module& model,
                           const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                           dist::Zero3Options options, bool frozen)
    : frozen_(frozen) {
    DTUNE_CHECK(names.size() == params.size(), "ZeRO-3: ", names.size(), " names for ", params.size(),
                " parameters");
    std::map<std::string, std::size_t> by_name;
    for (std::size_t i = 0; i < names.size(); ++i) by_name[names[i]] = i;
    std::vector<bool> taken(params.size(), false);
    std::vector<dist::Zero3Unit> units;
    std::vector<std::shared_ptr<torch::nn::Module>> unit_modules;
    for (const auto& [unit_name, module] : models::find_units(model)) {
        dist::Zero3Unit unit;
        unit.name = unit_name;
        unit.frozen = frozen;
        for (const auto& item : module->named_parameters(/*recurse=*/true)) {
            const auto it = by_name.find(unit_name + "." + item.key());
            if (it == by_name.end()) continue;  // not sharded (frozen, or a LoRA's adapter)
            DTUNE_CHECK(!taken[it->second], "ZeRO-3: parameter ", it->first, " is in two units");
            taken[it->second] = true;
            unit.names.push_back(it->first);
            unit.params.push_back(params[it->second]);
        }
        if (unit.params.empty()) continue;
        units.push_back(std::move(unit));
        unit_modules.push_back(module);
    }
    dist::Zero3Unit root;
    root.name = "root";
    root.whole_step = true;
    root.frozen = frozen;
    for (std::size_t i = 0; i < params.size(); ++i)
        if (!taken[i]) {
            root.names.push_back(names[i]);
            root.params.push_back(params[i]);
        }
    const std::size_t blocks = units.size();
    if (!root.params.empty()) units.push_back(std::move(root));
    engine_ = std::make_unique<dist::Zero3Engine>(group, std::move(units), options);
    modules_ = std::move(unit_modules);
    start_.assign(modules_.size(), 0);
    for (std::size_t u = 0; u < modules_.size(); ++u) {
        index_[modules_[u].get()] = u;
        models::set_unit_hooks(*modules_[u], this);
    }
    if (group.rank() == 0)
        log::info() << "ZeRO-3: " << blocks << " blocks + a root unit, "
                    << engine_->full_parameter_bytes() / (1 << 20) << " MiB of "
                    << (frozen ? "frozen base weights" : "parameters") << ", "
                    << engine_->shard_bytes() / (1 << 20) << " MiB kept per rank (world size "
                    << group.world_size() << ")";
}

ShardedModel::~ShardedModel() {
    for (const auto& m : modules_) models::set_unit_hooks(*m, nullptr);
}

void ShardedModel::before_unit(const torch::nn::Module& unit, bool recompute) {
    const auto it = index_.find(&unit);
    if (it == index_.end()) return;
    // Nodes recorded from here on (on this thread) belong to this run of the unit.
    if (frozen_) start_[it->second] = at::sequence_number::peek();
    engine_->before_unit(it->second, recompute);
}

void ShardedModel::after_unit(const torch::nn::Module& unit, bool recompute,
                              const std::vector<at::Tensor>& outputs) {
    const auto it = index_.find(&unit);
    if (it == index_.end()) return;
    engine_->after_unit(it->second, recompute, outputs);
    if (frozen_ && at::GradMode::is_enabled()) watch_backward(it->second, start_[it->second], outputs);
}

namespace {

// Counts down the recorded nodes of one run of a frozen unit as backward runs them.
struct Countdown {
    std::atomic<std::size_t> left{0};
    std::function<void()> done;
};

struct CountdownHook final : torch::autograd::FunctionPostHook {
    explicit CountdownHook(std::shared_ptr<Countdown> c) : countdown(std::move(c)) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
        if (countdown->left.fetch_sub(1) == 1) countdown->done();
        return outputs;
    }
    std::shared_ptr<Countdown> countdown;
};

}  // namespace

void ShardedModel::watch_backward(std::size_t u, uint64_t start, const std::vector<at::Tensor>& outputs) {
    const uint64_t end = at::sequence_number::peek();
    // Nodes point only at nodes recorded before them, so the unit's nodes are exactly those
    // reachable from its outputs without leaving [start, end) (AccumulateGrad nodes, numbered
    // UINT64_MAX, and nodes of earlier units fall outside).
    const auto inside = [&](const torch::autograd::Node* n) {
        return n && n->sequence_nr() >= start && n->sequence_nr() < end;
    };
    std::vector<torch::autograd::Node*> nodes, stack;
    std::set<const torch::autograd::Node*> seen;
    for (const at::Tensor& out : outputs)
        if (out.defined() && inside(out.grad_fn().get()) && seen.insert(out.grad_fn().get()).second)
            stack.push_back(out.grad_fn().get());
    while (!stack.empty()) {
        torch::autograd::Node* n = stack.back();
        stack.pop_back();
        nodes.push_back(n);
        for (const auto& edge : n->next_edges())
            if (inside(edge.function.get()) && seen.insert(edge.function.get()).second)
                stack.push_back(edge.function.get());
    }
    if (nodes.empty()) {  // its backward reads none of its weights
        engine_->backward_done(u);
        return;
    }
    auto countdown = std::make_shared<Countdown>();
    countdown->left = nodes.size();
    countdown->done = [this, u] { engine_->backward_done(u); };
    for (torch::autograd::Node* n : nodes) n->add_post_hook(std::make_unique<CountdownHook>(countdown));
}

}  // namespace dtune::train

namespace dtune::train {
namespace {

// "<parameter>@<begin>.<state>" -> (parameter, begin, state); false for other keys.
bool parse_sliced_key(const std::string& key, std::string& name, int64_t& begin, std::string& state) {
    const auto at = key.rfind('@');
    if (at == std::string::npos) return false;
    const auto dot = key.find('.', at);
    if (dot == std::string::npos) return false;
    name = key.substr(0, at);
    state = key.substr(dot + 1);
    try {
        begin = std::stoll(key.substr(at + 1, dot - at - 1));
    } catch (const std::exception&) {
        return false;
    }
    return true;
}

}  // namespace

StateMap sliced_state_for_save(const StateMap& state, const std::vector<dist::Zero3Slice>& slices) {
    std::map<std::string, int64_t> begin_of;
    for (const auto& s : slices) begin_of[s.name] = s.begin;
    StateMap out;
    for (const auto& [key, value] : state) {
        const auto dot = key.rfind('.');
        const std::string name = dot == std::string::npos ? key : key.substr(0, dot);
        const auto it = begin_of.find(name);
        DTUNE_CHECK(it != begin_of.end() && dot != std::string::npos, "ZeRO-3: optimizer state ", key,
                    " belongs to no slice of this rank");
        out[str(name, "@", it->second, key.substr(dot))] = value;
    }
    return out;
}

StateMap merge_sliced_state(const StateMap& state,
                            const std::map<std::string, std::vector<int64_t>>& shapes) {
    StateMap out;
    // (parameter, state) -> begin -> slice
    std::map<std::pair<std::string, std::string>, std::map<int64_t, at::Tensor>> pieces;
    for (const auto& [key, value] : state) {
        std::string name, st;
        int64_t begin = 0;
        if (!parse_sliced_key(key, name, begin, st)) {
            out[key] = value;
            continue;
        }
        pieces[{name, st}][begin] = value;
    }
    for (const auto& [id, by_begin] : pieces) {
        const auto& [name, st] = id;
        const std::string key = name + "." + st;
        const auto shape = shapes.find(name);
        if (shape == shapes.end()) {  // unknown: load_state_dict names it
            out[key] = by_begin.begin()->second;
            continue;
        }
        if (by_begin.begin()->second.dim() == 0) {  // a per-parameter scalar (step count)
            out[key] = by_begin.begin()->second;
            continue;
        }
        int64_t numel = 1;
        for (int64_t d : shape->second) numel *= d;
        std::vector<at::Tensor> parts;
        int64_t next = 0;
        for (const auto& [begin, t] : by_begin) {
            DTUNE_CHECK_AS(DataError, begin == next, "optimizer state of ", name, " (", st,
                           "): the ZeRO-3 shard files cover elements up to ", next,
                           " but the next slice starts at ", begin,
                           "; a shard file is missing or damaged: resume from another checkpoint");
            parts.push_back(t.reshape({-1}));
            next = begin + t.numel();
        }
        DTUNE_CHECK_AS(DataError, next == numel, "optimizer state of ", name, " (", st,
                       "): the ZeRO-3 shard ", "files cover ", next, " of its ", numel,
                       " elements; a shard file is missing: resume from another checkpoint");
        out[key] = at::cat(parts).view(shape->second);
    }
    return out;
}

StateMap state_for_slices(const StateMap& whole, const std::vector<dist::Zero3Slice>& slices) {
    std::map<std::string, const dist::Zero3Slice*> slice_of;
    for (const auto& s : slices) slice_of[s.name] = &s;
    StateMap out;
    for (const auto& [key, value] : whole) {
        const auto dot = key.rfind('.');
        const std::string name = dot == std::string::npos ? key : key.substr(0, dot);
        const auto it = slice_of.find(name);
        if (it == slice_of.end()) {
            out[key] = value;  // not this rank's (filtered by the caller) or unknown
            continue;
        }
        const dist::Zero3Slice& s = *it->second;
        out[key] = value.dim() == 0 ? value : value.reshape({-1}).slice(0, s.begin, s.end).clone();
    }
    return out;
}

}  // namespace dtune::train

// Name-for-name weight loading with a listing error for mismatches.
#include "models/common/weights.h"

#include <torch/torch.h>

#include <map>
#include <set>

#include "core/error.h"

namespace dtune::models {
namespace {

std::string listing(const std::vector<std::string>& names) {
    std::string out;
    const std::size_t shown = std::min<std::size_t>(names.size(), 20);
    for (std::size_t i = 0; i < shown; ++i) out += "\n    " + names[i];
    if (names.size() > shown) out += str("\n    ... and ", names.size() - shown, " more");
    return out;
}

// The shared body: `keys` are the checkpoint's names, `get` reads one, `from` names the origin.
LoadReport load_named(torch::nn::Module& module, const std::vector<std::string>& keys,
                      const std::function<at::Tensor(const std::string&)>& get, const LoadOptions& options,
                      const std::string& what, const std::string& from, const io::WeightSource* backing) {
    std::map<std::string, at::Tensor> targets;
    for (auto& item : module.named_parameters(/*recurse=*/true)) targets[item.key()] = item.value();
    for (auto& item : module.named_buffers(/*recurse=*/true)) targets[item.key()] = item.value();

    LoadReport report;
    std::set<std::string> seen;
    std::vector<std::string> shape_errors;
    std::vector<std::pair<std::string, at::Tensor>> loaded;  // checkpoint key -> the module's copy
    torch::NoGradGuard no_grad;
    for (const std::string& key : keys) {
        if (key.rfind(options.prefix, 0) != 0) continue;
        std::string name = key.substr(options.prefix.size());
        if (options.rename) name = options.rename(name);
        if (name.empty()) continue;
        auto it = targets.find(name);
        if (it == targets.end()) {
            report.unexpected.push_back(key);
            continue;
        }
        at::Tensor src = get(key);
        at::Tensor& dst = it->second;
        if (src.sizes() != dst.sizes()) {
            shape_errors.push_back(str(key, ": checkpoint ", src.sizes(), " vs model ", dst.sizes()));
            continue;
        }
        dst.copy_(src);  // converts dtype and device in one step
        if (backing) backing->release(src);
        loaded.emplace_back(key, dst);
        seen.insert(name);
        ++report.loaded;
    }
    for (const auto& [name, _] : targets)
        if (!seen.count(name)) report.missing.push_back(name);

    if (!shape_errors.empty())
        throw DataError(str(what, ": ", shape_errors.size(), " tensor(s) in '", from,
                            "' have the wrong shape for this model config:", listing(shape_errors),
                            "\n  the weights belong to a different model or config.json; check both"));
    if (options.strict && (!report.missing.empty() || !report.unexpected.empty()))
        throw DataError(str(what, ": the weights in '", from,
                            "' do not match the model built from its config (", report.missing.size(),
                            " missing, ", report.unexpected.size(), " unexpected).",
                            report.missing.empty() ? "" : "\n  missing:", listing(report.missing),
                            report.unexpected.empty() ? "" : "\n  unexpected:", listing(report.unexpected),
                            "\n  check that config.json and the weights come from the same model"));
    std::vector<at::Tensor> copies;
    for (const auto& [_, t] : loaded) copies.push_back(t);
    if (const int64_t bad = first_non_finite(copies); bad >= 0)
        throw DataError(str(what, ": tensor '", loaded[static_cast<std::size_t>(bad)].first, "' in '", from,
                            "' holds NaN or infinite values; the weights are damaged (a diverged training "
                            "run or a broken conversion): use another copy of the model"));
    if (options.dtype || options.device) {
        module.to(options.device.value_or(module.parameters().empty() ? c10::Device(c10::kCPU)
                                                                      : module.parameters()[0].device()),
                  options.dtype.value_or(module.parameters().empty() ? c10::kFloat
                                                                     : module.parameters()[0].scalar_type()));
    }
    return report;
}

}  // namespace

LoadReport load_weights(torch::nn::Module& module, const io::WeightSource& source, const LoadOptions& options,
                        const std::string& what) {
    return load_named(
        module, source.keys(), [&](const std::string& key) { return source.get(key); }, options, what,
        source.files().empty() ? "" : source.files()[0].string(), &source);
}

LoadReport load_weights(torch::nn::Module& module, const io::TensorList& tensors, const LoadOptions& options,
                        const std::string& what, const std::string& from, const io::WeightSource* backing) {
    std::map<std::string, at::Tensor> by_name(tensors.begin(), tensors.end());
    std::vector<std::string> keys;
    for (const auto& [k, _] : by_name) keys.push_back(k);
    return load_named(
        module, keys, [&](const std::string& key) { return by_name.at(key); }, options, what, from, backing);
}

int64_t first_non_finite(const std::vector<at::Tensor>& tensors) {
    std::vector<at::Tensor> flags;  // per tensor: all finite (one bool on the tensor's device)
    std::vector<std::size_t> index;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
        const at::Tensor& t = tensors[i];
        if (!t.defined() || !at::isFloatingType(t.scalar_type()) || t.numel() == 0) continue;
        at::Tensor flag = at::isfinite(t).all();
        if (!flags.empty()) flag = flag.to(flags[0].device());  // no-op when on the same device
        flags.push_back(flag);
        index.push_back(i);
    }
    if (flags.empty()) return -1;
    const at::Tensor ok = at::stack(flags).cpu();  // [n] bool, the one read-back
    const bool* all_finite = ok.const_data_ptr<bool>();
    for (std::size_t i = 0; i < index.size(); ++i)
        if (!all_finite[i]) return static_cast<int64_t>(index[i]);
    return -1;
}

io::TensorList state_dict(const torch::nn::Module& module) {
    io::TensorList out;
    for (const auto& item : module.named_parameters(true)) out.emplace_back(item.key(), item.value());
    for (const auto& item : module.named_buffers(true)) out.emplace_back(item.key(), item.value());
    return out;
}

}  // namespace dtune::models

// Checkpoint save / validate / resolve / load / rotate (see checkpoint.h).
#include "train/checkpoint.h"

#include <ATen/detail/CUDAHooksInterface.h>

#include <algorithm>
#include <regex>
#include <set>

#include "core/dtype.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"

namespace dtune::train {
namespace {

constexpr const char* kGuard = ".guard";
constexpr const char* kManifest = "checkpoint_manifest.json";
constexpr const char* kRandomStates = "random_states.safetensors";

std::optional<int64_t> checkpoint_step(const stdfs::path& dir) {
    static const std::regex pattern("checkpoint-([0-9]+)");
    std::smatch m;
    const std::string name = dir.filename().string();
    if (!std::regex_match(name, m, pattern)) return std::nullopt;
    return std::stoll(m[1].str());
}

void write_json(const stdfs::path& path, const nlohmann::json& j) {
    stdfs::create_directories(path.parent_path());
    fs::write_file_atomic(path, j.dump(2) + "\n");
}

// Deletes a checkpoint directory guard first: a removal cut short (a kill, a power cut) leaves a
// directory without a guard, which resume skips and the next rotation deletes, never one whose
// guard says complete while its weights are gone.
void remove_checkpoint_dir(const stdfs::path& dir) {
    std::error_code ec;
    if (stdfs::remove(dir / kGuard, ec)) fs::sync_directory(dir);
    stdfs::remove_all(dir);
}

// The tensor names of every .safetensors file of the checkpoint, read back from the files just
// written (this rank's, the other ranks' shards, the adapter files): the manifest's record of what
// a complete checkpoint holds, so that a resume finds a tensor that went missing afterwards.
nlohmann::json tensor_names(const stdfs::path& dir, const std::vector<std::string>& files) {
    nlohmann::json out = nlohmann::json::object();
    for (const auto& rel : files)
        if (stdfs::path(rel).extension() == ".safetensors") out[rel] = io::SafetensorsFile(dir / rel).keys();
    return out;
}

// Every tensor the manifest lists for `rel` is in `loaded` (checkpoints written before the manifest
// listed tensors have no list and pass).
void check_listed_tensors(const stdfs::path& dir, const nlohmann::json& manifest, const std::string& rel,
                          const io::TensorList& loaded) {
    if (!manifest.contains("tensors") || !manifest["tensors"].is_object() ||
        !manifest["tensors"].contains(rel))
        return;
    const nlohmann::json& names = manifest["tensors"][rel];
    if (!names.is_array()) return;
    std::set<std::string> have;
    for (const auto& [name, _] : loaded) have.insert(name);
    for (const auto& name : names)
        if (name.is_string() && !have.count(name.get<std::string>()))
            throw DataError(str("checkpoint ", dir.string(), ": ", rel, " has no tensor '",
                                name.get<std::string>(), "' although the save wrote it (", names.size(),
                                " tensors, ", have.size(),
                                " left): the file was altered or damaged after the save; resume from an ",
                                "earlier checkpoint (resume_from_checkpoint=<its folder>)"));
}

}  // namespace

stdfs::path checkpoint_tmp_dir(const stdfs::path& output_dir, int64_t global_step) {
    return output_dir / ("checkpoint-" + std::to_string(global_step) + "-tmp");
}

stdfs::path save_checkpoint(const stdfs::path& output_dir, const CheckpointContents& c) {
    const stdfs::path final_dir = output_dir / ("checkpoint-" + std::to_string(c.global_step));
    const stdfs::path tmp = checkpoint_tmp_dir(output_dir, c.global_step);
    stdfs::remove_all(tmp);
    stdfs::create_directories(tmp);
    std::vector<std::string> files;
    for (const auto& [rel, tensors] : c.tensor_files) {
        stdfs::create_directories((tmp / rel).parent_path());
        io::save_safetensors(tmp / rel, tensors);
        files.push_back(rel);
    }
    for (const auto& [rel, j] : c.json_files) {
        write_json(tmp / rel, j);
        files.push_back(rel);
    }
    for (const auto& [rel, write] : c.file_writers) {
        stdfs::create_directories((tmp / rel).parent_path());
        write(tmp / rel);
        files.push_back(rel);
    }
    io::TensorList rng;
    for (const auto& [name, t] : c.rng_states) rng.emplace_back(name, t);
    io::save_safetensors(tmp / kRandomStates, rng);
    files.push_back(kRandomStates);
    if (c.write_shards) c.write_shards(tmp);
    for (const auto& rel : c.shard_files) {
        DTUNE_CHECK(stdfs::exists(tmp / rel), "checkpoint shard ", rel, " was not written into ",
                    tmp.string(), "; another rank failed while saving (see its log)");
        files.push_back(rel);
    }
    write_json(tmp / kManifest, {{"version", 1},
                                 {"checkpoint", final_dir.filename().string()},
                                 {"global_step", c.global_step},
                                 {"files", files},
                                 {"tensors", tensor_names(tmp, files)},
                                 {"metadata", c.metadata}});
    fs::sync_directory(tmp);
    // Replace an older copy of the same step (e.g. an interrupted save, or the final save).
    remove_checkpoint_dir(final_dir);
    stdfs::rename(tmp, final_dir);
    fs::sync_directory(output_dir);
    fs::write_file_atomic(final_dir / kGuard, "complete");
    return final_dir;
}

std::string checkpoint_problem(const stdfs::path& dir) {
    std::error_code ec;
    if (!stdfs::is_directory(dir, ec)) return "it is not a directory";
    if (!stdfs::exists(dir / kGuard)) return "it has no .guard file (the save was interrupted)";
    if (fs::read_file(dir / kGuard) != "complete") return ".guard does not say complete";
    if (!stdfs::exists(dir / kManifest)) return str("it has no ", kManifest);
    const auto manifest = nlohmann::json::parse(fs::read_file(dir / kManifest), nullptr, false);
    if (manifest.is_discarded() || !manifest.contains("files")) return str(kManifest, " is not valid");
    for (const auto& f : manifest.at("files"))
        if (!stdfs::exists(dir / f.get<std::string>()))
            return str("the file ", f.get<std::string>(), " is missing");
    return "";
}

std::vector<std::pair<int64_t, stdfs::path>> list_checkpoints(const stdfs::path& output_dir) {
    std::vector<std::pair<int64_t, stdfs::path>> out;
    std::error_code ec;
    if (!stdfs::is_directory(output_dir, ec)) return out;
    for (const auto& entry : stdfs::directory_iterator(output_dir))
        if (entry.is_directory())
            if (auto step = checkpoint_step(entry.path())) out.emplace_back(*step, entry.path());
    std::sort(out.begin(), out.end());
    return out;
}

std::optional<stdfs::path> resolve_resume_checkpoint(const stdfs::path& output_dir, const std::string& spec) {
    if (spec.empty() || spec == "none" || spec == "None") return std::nullopt;
    const auto all = list_checkpoints(output_dir);
    std::optional<int64_t> below;  // search only checkpoints older than this step
    if (spec != "latest") {
        const stdfs::path dir =
            stdfs::path(spec).is_absolute() || stdfs::exists(spec) ? stdfs::path(spec) : output_dir / spec;
        std::error_code ec;
        if (!stdfs::exists(dir, ec)) {
            // A typo (checkpoint-30 for checkpoint-300) must not quietly resume an older checkpoint,
            // whose later saves would then replace the newer checkpoints of the same steps.
            std::string names;
            for (const auto& [step, path] : all)
                names += (names.empty() ? "" : ", ") + path.filename().string();
            throw UsageError(str("resume_from_checkpoint ", spec, " does not exist (checkpoints in ",
                                 output_dir.string(), ": ", names.empty() ? "none" : names,
                                 "); pass one of them, \"latest\" or \"none\""));
        }
        const std::string problem = checkpoint_problem(dir);
        if (problem.empty()) return dir;
        const auto step = checkpoint_step(dir);
        if (!step)
            throw UsageError(str("resume_from_checkpoint ", spec, " cannot be used: ", problem,
                                 "; pass a checkpoint-<step> directory or \"latest\""));
        log::warn() << "resume_from_checkpoint " << dir.string() << " is incomplete (" << problem
                    << "); falling back to the previous complete checkpoint";
        below = *step;
    }
    for (auto it = all.rbegin(); it != all.rend(); ++it) {
        if (below && it->first >= *below) continue;
        const std::string problem = checkpoint_problem(it->second);
        if (problem.empty()) return it->second;
        log::warn() << "skipping " << it->second.string() << ": " << problem << "; delete it";
    }
    if (below)
        throw UsageError(str("resume_from_checkpoint ", spec,
                             " is incomplete and no complete checkpoint precedes it", " in ",
                             output_dir.string(), "; set resume_from_checkpoint to none to start afresh"));
    return std::nullopt;
}

LoadedCheckpoint load_checkpoint(const stdfs::path& dir) {
    const std::string problem = checkpoint_problem(dir);
    if (!problem.empty())
        throw DataError(str("checkpoint ", dir.string(), " cannot be loaded: ", problem,
                            "; resume from another checkpoint (resume_from_checkpoint)"));
    LoadedCheckpoint out;
    out.dir = dir;
    const auto manifest = nlohmann::json::parse(fs::read_file(dir / kManifest));
    out.global_step = json_integer(manifest, "global_step", dir / kManifest);
    for (const auto& f : manifest.at("files")) {
        const std::string rel = f.get<std::string>();
        const bool tensors = stdfs::path(rel).extension() == ".safetensors";
        io::TensorList list;
        try {
            if (tensors) {
                // Cloned: the mapped views die with the file.
                for (auto& [name, t] : io::load_safetensors(dir / rel)) list.emplace_back(name, t.clone());
            } else if (stdfs::path(rel).extension() == ".json") {
                out.json_files[rel] = nlohmann::json::parse(fs::read_file(dir / rel));
            }
        } catch (const std::exception& e) {
            // The file's own message ("re-download or re-export it") does not fit a checkpoint:
            // name the damaged checkpoint and how to resume from another one.
            throw DataError(
                str("checkpoint ", dir.string(), " is damaged: ", rel, ": ", e.what(),
                    "; resume from an earlier checkpoint (resume_from_checkpoint=<its folder>) or "
                    "move this one out of output_dir and resume from latest"));
        }
        if (!tensors) continue;
        check_listed_tensors(dir, manifest, rel, list);
        if (rel == kRandomStates)
            out.rng_states.insert(list.begin(), list.end());
        else
            out.tensor_files[rel] = std::move(list);
    }
    return out;
}

const nlohmann::json& json_field(const nlohmann::json& j, const std::string& field, const stdfs::path& file) {
    if (!j.is_object() || !j.contains(field))
        throw DataError(
            str(file.string(), " has no field \"", field,
                "\"; the file is damaged or from another program: resume from an earlier checkpoint"));
    return j.at(field);
}

int64_t json_integer(const nlohmann::json& j, const std::string& field, const stdfs::path& file) {
    const nlohmann::json& v = json_field(j, field, file);
    if (!v.is_number_integer())
        throw DataError(str(file.string(), ": field \"", field, "\" is ", v.dump(), " (a ", v.type_name(),
                            "), not an integer; the file is damaged: restore it or resume from an earlier "
                            "checkpoint"));
    return v.get<int64_t>();
}

void check_resumed_tensor(const stdfs::path& file, const std::string& name, const at::Tensor& saved,
                          const at::Tensor& model) {
    if (saved.sizes() == model.sizes() && saved.scalar_type() == model.scalar_type()) return;
    throw DataError(str(file.string(), ": tensor '", name, "' is ", saved.sizes(), " ",
                        dtype_name(saved.scalar_type()), " but the model's is ", model.sizes(), " ",
                        dtype_name(model.scalar_type()),
                        "; the checkpoint was written for another model, model config or precision "
                        "(resume with the settings it was saved with) or the file was altered: resume "
                        "from an earlier checkpoint"));
}

void rotate_checkpoints(const stdfs::path& output_dir, int64_t limit) {
    const auto all = list_checkpoints(output_dir);
    std::vector<stdfs::path> complete;
    std::vector<std::pair<int64_t, stdfs::path>> incomplete;
    for (const auto& [step, dir] : all) {
        if (checkpoint_problem(dir).empty())
            complete.push_back(dir);
        else
            incomplete.emplace_back(step, dir);
    }
    // Leftovers of saves or removals that were cut short: incomplete checkpoints older than the
    // newest complete one (resume never picks them) and assembly folders (checkpoint-<N>-tmp; this
    // process's own save is renamed by now, and only rank 0 calls this).
    std::optional<int64_t> newest;
    if (!complete.empty()) newest = checkpoint_step(complete.back());
    for (const auto& [step, dir] : incomplete) {
        if (!newest || step >= *newest) continue;
        log::info() << "removing incomplete checkpoint " << dir.string() << " (" << checkpoint_problem(dir)
                    << "; " << complete.back().filename().string() << " is newer and complete)";
        remove_checkpoint_dir(dir);
    }
    static const std::regex tmp_pattern("checkpoint-[0-9]+-tmp");
    std::error_code ec;
    for (const auto& entry : stdfs::directory_iterator(output_dir, ec))
        if (entry.is_directory() && std::regex_match(entry.path().filename().string(), tmp_pattern)) {
            log::info() << "removing " << entry.path().string() << " (an interrupted checkpoint save)";
            stdfs::remove_all(entry.path());
        }
    if (limit <= 0) return;
    const int64_t excess = static_cast<int64_t>(complete.size()) - limit;
    for (int64_t i = 0; i < excess; ++i) {
        log::info() << "removing old checkpoint " << complete[static_cast<size_t>(i)].string()
                    << " (checkpoints_total_limit " << limit << ")";
        remove_checkpoint_dir(complete[static_cast<size_t>(i)]);
    }
}

std::map<std::string, at::Tensor> capture_rng_states(const at::Generator& cpu_generator) {
    std::map<std::string, at::Tensor> out;
    out["cpu"] = cpu_generator.get_state();
    const auto& cuda = at::detail::getCUDAHooks();
    if (cuda.hasCUDA())
        for (int i = 0; i < cuda.getNumGPUs(); ++i) {
            at::Generator g = cuda.getDefaultGenerator(static_cast<c10::DeviceIndex>(i));
            out["cuda:" + std::to_string(i)] = g.get_state();
        }
    return out;
}

void restore_rng_states(const std::map<std::string, at::Tensor>& states, at::Generator& cpu_generator) {
    auto it = states.find("cpu");
    DTUNE_CHECK_AS(DataError, it != states.end(), "checkpoint random_states has no cpu generator state");
    cpu_generator.set_state(it->second);
    const auto& cuda = at::detail::getCUDAHooks();
    if (!cuda.hasCUDA()) return;
    for (int i = 0; i < cuda.getNumGPUs(); ++i) {
        auto s = states.find("cuda:" + std::to_string(i));
        if (s == states.end()) continue;
        at::Generator g = cuda.getDefaultGenerator(static_cast<c10::DeviceIndex>(i));
        g.set_state(s->second);
    }
}

}  // namespace dtune::train

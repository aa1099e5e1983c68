// Data-parallel training glue between the trainer and src/dist (see data_parallel.h).
#include "train/data_parallel.h"

#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <exception>
#include <random>
#include <thread>

#include "core/dtype.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "dist/group.h"
#include "dist/reducer.h"
#include "health/breaker.h"
#include "train/config.h"
#include "train/zero3_model.h"  // ShardedModel (the destructor)
#include "train/zero_sync.h"

namespace dtune::train {

int resolve_zero_stage(const TrainConfig& config) {
    std::string origin = "zero_stage in the config";
    std::optional<int64_t> stage = config.opt_integer("zero_stage");
    if (!stage && config.flag("fsdp_enable")) {
        stage = 3;  // SimpleTuner's FSDP (version 1 or 2): full sharding of parameters
        origin = "fsdp_enable true";
    }
    if (!stage) {
        const char* env = std::getenv("DTUNE_ZERO_STAGE");
        DTUNE_CHECK_AS(UsageError, (env && *env) || !config.flag("fsdp_cpu_offload"),
                       "fsdp_cpu_offload is true (FSDP's sharded parameters in host memory) but FSDP is ",
                       "off; set fsdp_enable true (or zero_stage 3), or fsdp_cpu_offload false");
        if (!env || !*env) return 0;
        origin = str("DTUNE_ZERO_STAGE='", env, "' (from deepspeed_config.zero_stage)");
        char* end = nullptr;
        stage = std::strtol(env, &end, 10);
        DTUNE_CHECK_AS(UsageError, end && *end == '\0', origin, " is not a number; use 0, 1 or 2");
    }
    DTUNE_CHECK_AS(UsageError, *stage >= 0 && *stage <= 3, origin, " is ", *stage,
                   "; dtune implements ZeRO stage 0 (plain data parallel), 1 (sharded optimizer ",
                   "state), 2 (sharded optimizer state and gradients) and 3 (also sharded parameters); ",
                   "use the lowest that fits");
    DTUNE_CHECK_AS(UsageError, *stage == 3 || !config.flag("fsdp_enable"),
                   "fsdp_enable is true (FSDP: sharded parameters, dtune's ZeRO stage 3) but ", origin,
                   " is ", *stage, "; drop one of them, or set zero_stage 3");
    // Parameters are offloaded by the ZeRO-3 engine only (resolve_zero3_options reads the key there).
    const std::string param_device = config.text("offload_param_device");
    DTUNE_CHECK_AS(UsageError, *stage == 3 || param_device.empty() || param_device == "none",
                   "offload_param_device is '", param_device, "' but ", origin, " is ", *stage,
                   "; parameters are offloaded only when they are sharded: set zero_stage 3, or ",
                   "offload_param_device none");
    DTUNE_CHECK_AS(UsageError, *stage == 3 || !config.flag("fsdp_cpu_offload"),
                   "fsdp_cpu_offload is true (FSDP's sharded parameters in host memory) but ", origin, " is ",
                   *stage, "; parameters are offloaded only when they are sharded: set fsdp_enable true ",
                   "(or zero_stage 3), or fsdp_cpu_offload false");
    return static_cast<int>(*stage);
}

OffloadDevice resolve_offload_device(const TrainConfig& config, const char* key, const char* env) {
    OffloadDevice d;
    if (!config.is_null(key) && !config.text(key).empty()) {
        d.value = config.text(key);
        d.origin = str(key, " in the config");
    } else {
        const char* from_env = std::getenv(env);
        d.value = from_env ? from_env : "";
        d.origin = str(env, " (from deepspeed_config.", key, ")");
    }
    // SimpleTuner's FSDP CPU offload: the parameters (resolve_zero3_options) and the optimizer
    // state and update in host memory, as offload_param_device and offload_optimizer_device cpu.
    if (config.flag("fsdp_cpu_offload")) {
        DTUNE_CHECK_AS(UsageError, d.value.empty() || d.value == "cpu",
                       "fsdp_cpu_offload is true (parameters and optimizer state in host memory) but ",
                       d.origin, " is '", d.value, "'; drop one of them, or set it to cpu");
        d.value = "cpu";
    }
    return d;
}

std::size_t gradient_bucket_bytes(GradientHandoff handoff) {
    const char* mb = std::getenv("DTUNE_BUCKET_MB");
    if (!mb || !*mb)
        return handoff == GradientHandoff::kDirect ? std::size_t{100} << 20
                                                   : dist::ReducerOptions{}.bucket_bytes;
    char* end = nullptr;
    const double value = std::strtod(mb, &end);
    DTUNE_CHECK_AS(UsageError, end && *end == '\0' && value > 0 && value <= 4096, "DTUNE_BUCKET_MB is '", mb,
                   "'; give the gradient bucket size in MiB, e.g. 100 (the default) or 25");
    return static_cast<std::size_t>(value * (1u << 20));
}

std::size_t zero2_staging_slots() {
    const char* v = std::getenv("DTUNE_ZERO2_SLOTS");
    if (!v || !*v) return dist::ReducerOptions{}.staging_slots;
    char* end = nullptr;
    const long slots = std::strtol(v, &end, 10);
    DTUNE_CHECK_AS(UsageError, end && *end == '\0' && slots >= 1 && slots <= 64, "DTUNE_ZERO2_SLOTS is '", v,
                   "'; give how many of other ranks' gradient buckets to stage at once, 1 to 64 (default 4)");
    return static_cast<std::size_t>(slots);
}

GradientHandoff gradient_handoff_requested() {
    const char* v = std::getenv("DTUNE_DDP_GRAD_COPY");
    if (!v || !*v) return GradientHandoff::kDirect;
    const std::string s = v;
    DTUNE_CHECK_AS(UsageError, s == "0" || s == "1" || s == "direct", "DTUNE_DDP_GRAD_COPY is '", s,
                   "'; set it to direct (all-reduce the gradients where backward left them, the default), 1 "
                   "(copy backward's gradients into the reducer's buckets) or 0 (zero the buckets and add "
                   "them in place)");
    return s == "1"   ? GradientHandoff::kCopyIn
           : s == "0" ? GradientHandoff::kInPlace
                      : GradientHandoff::kDirect;
}

ZeroSync zero_sync_requested() {
    const char* v = std::getenv("DTUNE_ZERO_SYNC");
    if (!v || !*v) return ZeroSync::kForward;
    const std::string s = v;
    if (s == "forward") return ZeroSync::kForward;
    if (s == "forward-params") return ZeroSync::kForwardParams;
    DTUNE_CHECK_AS(UsageError, s == "step", "DTUNE_ZERO_SYNC is '", s,
                   "'; set it to forward (ZeRO-1/2 ranks receive each other's updated parameters during the "
                   "next forward, one broadcast per block and owner: the default), forward-params (the same, "
                   "one broadcast per parameter) or step (right after the optimizer step)");
    return ZeroSync::kStep;
}

bool zero1_layout_greedy() {
    const char* v = std::getenv("DTUNE_ZERO1_LAYOUT");
    if (!v || !*v) return false;
    const std::string s = v;
    DTUNE_CHECK_AS(UsageError, s == "contiguous" || s == "greedy", "DTUNE_ZERO1_LAYOUT is '", s,
                   "'; set it to contiguous (each rank owns a run of consecutive parameters, so a block "
                   "has one or two owners: the default) or greedy (largest parameter first to the "
                   "least-loaded rank)");
    return s == "greedy";
}

bool graph_reducer_disabled() {
    const char* v = std::getenv("DTUNE_GRAPH_REDUCER");
    return v && std::string(v) == "0";
}

bool gradient_handoff_named() {
    const char* v = std::getenv("DTUNE_DDP_GRAD_COPY");
    return v && *v;
}

bool resolve_offload_optimizer(const TrainConfig& config) {
    const OffloadDevice d =
        resolve_offload_device(config, "offload_optimizer_device", "DTUNE_OFFLOAD_OPTIMIZER_DEVICE");
    if (d.value.empty()) return false;
    DTUNE_CHECK_AS(UsageError, d.value == "none" || d.value == "cpu", d.origin, " is '", d.value,
                   "'; use none (optimizer state on the training device) or cpu (in host memory; "
                   "nvme offload is not implemented)");
    return d.value == "cpu";
}

namespace {

// A duration in seconds from the environment (e.g. "0.5"), else `fallback`.
std::chrono::milliseconds env_milliseconds(const char* name, std::chrono::milliseconds fallback) {
    const char* value = std::getenv(name);
    if (!value || !*value) return fallback;
    char* end = nullptr;
    const double seconds = std::strtod(value, &end);
    DTUNE_CHECK_AS(UsageError, end && *end == '\0' && seconds >= 0, name, "='", value,
                   "' is not a number of seconds; use e.g. 0.5");
    return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

}  // namespace

c10::Device DataParallel::pick_device(const std::string& text, const dist::DistEnv& env, int cuda_devices) {
    std::string t = text;
    for (auto& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    const bool wants_cuda = t == "cuda" || (t == "auto" && cuda_devices > 0);
    if (!env.launched || !wants_cuda) {
        const c10::Device parsed = parse_device(text);
        DTUNE_CHECK_AS(
            UsageError, !env.launched || !parsed.is_cuda() || env.local_world_size <= 1, "device '", text,
            "' names one GPU, but ", env.local_world_size,
            " processes run on this node and would all use it; use --device cuda so that each ",
            "rank takes the GPU of its LOCAL_RANK (or restrict each process with CUDA_VISIBLE_DEVICES)");
        return parsed;
    }
    DTUNE_CHECK_AS(UsageError, cuda_devices > 0, "device '", text,
                   "' asked for CUDA but this process sees no ", "CUDA device; use --device cpu");
    if (env.local_rank < cuda_devices)
        return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
    DTUNE_CHECK_AS(UsageError, cuda_devices == 1, "local rank ", env.local_rank,
                   " has no GPU of its own: this ", "process sees ", cuda_devices, " GPUs but ",
                   env.local_world_size,
                   " processes run on this node; start at most one process per GPU (--nproc_per_node ",
                   cuda_devices, ")");
    return c10::Device(c10::kCUDA, 0);  // the launcher shows each process only its own GPU
}

DataParallel::DataParallel(const dist::DistEnv& env, c10::Device device, int zero_stage,
                           std::chrono::seconds collective_timeout)
    : env_(env), device_(device), zero_stage_(env.world_size > 1 ? zero_stage : 0) {
    dist::GroupOptions options;
    options.device = device;
    options.collective_timeout = collective_timeout;
    options.fault_poll_interval = env_milliseconds("DTUNE_FAULT_POLL_S", options.fault_poll_interval);
    options.fault_exit_grace = env_milliseconds("DTUNE_FAULT_EXIT_GRACE_S", options.fault_exit_grace);
    group_ = dist::init_group(env_, options);
    graph_reducer_allowed_ = !graph_reducer_disabled();  // read once: asked every step
    if (env_.world_size > 1 && env_.rank == 0)
        log::info() << "data parallel: " << env_.world_size << " ranks, ZeRO stage " << zero_stage_;
}

DataParallel::~DataParallel() {
    deferred_.reset();
    reducer_.reset();
    zero3_.reset();
    if (!group_) return;
    if (std::uncaught_exceptions() > 0) {
        // An error outside the training loop (data setup, checkpoint load...): its message is on
        // this rank's stderr; the others only need to stop instead of waiting in a collective.
        if (!failed_ && !group_->peer_fault())  // (a peer's failure needs no report of ours)
            report_failure(Error(str("rank ", env_.rank, " exited with an error outside the training loop; ",
                                     "its log (above) has the message")));
        group_->abort();
    } else if (failed_ || group_->peer_fault()) {
        group_->abort();
    } else {
        group_->shutdown();
    }
}

void DataParallel::report_failure(const std::exception& error) {
    if (env_.world_size <= 1 || dist::is_peer_failure(error)) return;
    failed_ = true;
    dist::FaultRecord record;
    record.rank = env_.rank;
    // libtorch's errors carry a C++ backtrace in what(); peers and the launcher need the message.
    const auto* torch_error = dynamic_cast<const c10::Error*>(&error);
    record.message = torch_error ? torch_error->what_without_backtrace() : error.what();
    if (health::is_cuda_error(record.message)) {
        record.kind = "gpu_fault";
        record.exit_code = static_cast<int>(ExitCode::kGpuFault);
        record.message = "CUDA error in training: " + record.message;
    } else {
        record.kind = "error";
        const auto* known = dynamic_cast<const Error*>(&error);
        record.exit_code = static_cast<int>(known ? known->code() : ExitCode::kError);
    }
    record.message = record.message.substr(0, dist::FaultRecord::kMaxMessage);
    char host[256] = "unknown";
    ::gethostname(host, sizeof host - 1);
    record.node = host;
    record.gpu = device_.is_cuda() ? device_.index() : -1;
    group_->publish_fault(record);
}

void DataParallel::barrier() {
    group_->barrier();
}

std::function<void()> DataParallel::barrier_function() {
    return [this] { group_->barrier(); };
}

void DataParallel::attach(std::vector<at::Tensor> params, GradientHandoff handoff) {
    params_ = std::move(params);
    dist::broadcast_parameters(*group_, params_, 0);
    // Contiguous runs: ZeRO-2's gradient buckets then each have one owner to reduce to, and every
    // block one or two owners to broadcast from (DeferredParameterSync).
    if (zero_stage_ >= 1)
        partition_ = std::make_unique<dist::ZeroPartition>(params_, env_.world_size,
                                                           zero_stage_ == 1 && zero1_layout_greedy()
                                                               ? dist::ZeroLayout::kGreedy
                                                               : dist::ZeroLayout::kContiguous);
    const bool talk = env_.world_size > 1 && env_.rank == 0;
    if (zero_stage_ > 1 && handoff == GradientHandoff::kCopyIn) {
        if (talk && gradient_handoff_named())
            log::info() << "DTUNE_DDP_GRAD_COPY=1 is for zero_stage 0 and 1; zero_stage " << zero_stage_
                        << " reduces each bucket to the rank that owns it";
        handoff = GradientHandoff::kInPlace;
    }
    dist::ReducerOptions reducer_options;
    if (zero_stage_ == 2) {
        reducer_options.owners = partition_->owners();
        reducer_options.staging_slots = zero2_staging_slots();
    }
    // ZeRO-2 keeps 25 MiB buckets: other ranks' buckets are staged in a few slots of that size.
    reducer_options.bucket_bytes =
        gradient_bucket_bytes(zero_stage_ > 1 ? GradientHandoff::kInPlace : handoff);
    reducer_ = std::make_unique<dist::GradReducer>(*group_, params_, reducer_options);
    if (partition_ && talk)
        log::info() << "ZeRO-" << zero_stage_ << ": " << reducer_->buckets().size() << " gradient buckets; "
                    << params_.size() << " parameters, each updated by one rank";
    const char* overlap = std::getenv("DTUNE_DDP_OVERLAP");
    if (!(overlap && std::string(overlap) == "0")) reducer_->enable_overlap();
    reducer_->set_copy_in(handoff == GradientHandoff::kCopyIn);
    reducer_->set_direct(handoff == GradientHandoff::kDirect);
    if (handoff != GradientHandoff::kDirect || !talk) return;
    if (zero_stage_ > 1)
        log::info()
            << "data parallel: ZeRO-2 reduces each of " << reducer_->buckets().size()
            << " buckets to its owner in one grouped collective, the owner's gradients where backward "
               "left them and the other ranks' from staging slots; no gradient buckets "
               "(DTUNE_DDP_GRAD_COPY=0 keeps the owner's in buckets)";
    else
        log::info() << "data parallel: gradients are all-reduced where backward left them, grouped in "
                    << reducer_->buckets().size() << " collectives of up to "
                    << static_cast<double>(reducer_options.bucket_bytes) / (1u << 20)
                    << " MiB; no gradient buckets (DTUNE_DDP_GRAD_COPY=1 copies them into buckets)";
}

bool DataParallel::updates(std::size_t index) const {
    return !partition_ || partition_->owner(index) == env_.rank;
}

void DataParallel::arm_reduction() {
    if (reducer_) reducer_->arm();
}

void DataParallel::reduce_gradients() {
    if (deferred_) deferred_->wait_all();  // before the optimizer writes any parameter
    if (reducer_) reducer_->reduce();
    if (reducer_ && !overlap_reported_ && env_.rank == 0 && reducer_->owns_gradients()) {
        overlap_reported_ = true;
        log::info() << "data parallel: " << reducer_->overlapped_buckets() << " of "
                    << reducer_->buckets().size()
                    << " gradient buckets started their reduction during the backward";
    }
    if (zero_stage_ == 2 && !shard_reported_) report_gradient_shard();
}

void DataParallel::all_reduce_gradients_capturable(const std::vector<at::Tensor>& params) {
    // The graphed step keeps its gradients at the graph's static addresses: the reducer's buckets
    // would only double the gradient memory, so they go on first use.
    if (reducer_) reducer_->release_gradients();
    if (deferred_) deferred_->wait_all();  // before the optimizer writes any parameter
    dist::all_reduce_gradients_flat(*group_, params);
}

bool DataParallel::graph_reduces_in_buckets() const {
    return graph_reducer_allowed_ && reducer_ && reducer_->owns_gradients() && zero_stage_ <= 2;
}

void DataParallel::zero_gradients_in_step() {
    if (!reducer_) return;
    reducer_->zero_grad();
    step_clears_gradients_ = true;
}

void DataParallel::note_graph_launch() {
    if (env_.world_size > 1) group_->note_graph_launch();
}

void DataParallel::abandon_reduction() {
    if (reducer_) reducer_->abandon_round();
}

void DataParallel::defer_parameter_sync(torch::nn::Module& model, bool coalesce) {
    if (!partition_ || env_.world_size <= 1 || deferred_) return;
    deferred_ =
        std::make_unique<DeferredParameterSync>(*group_, model, params_, partition_->owners(), coalesce);
    if (env_.rank == 0)
        log::info() << "ZeRO-" << zero_stage_ << ": each rank's updated parameters reach the others at the "
                    << "start of the next forward, " << deferred_->broadcasts() << " broadcasts in "
                    << deferred_->groups() << " groups (one per block, one for the rest) overlapping it"
                    << (coalesce ? ", each block's parameters of one owner in one flat buffer" : "")
                    << " (DTUNE_ZERO_SYNC=step broadcasts them right after the step)";
}

void DataParallel::flush_parameters() {
    if (deferred_) deferred_->flush();
}

void DataParallel::after_step() {
    if (zero3_) zero3_after_step();
    if (partition_ && !deferred_) {
        if (!sync_reported_ && env_.rank == 0 && env_.world_size > 1)
            log::info() << "ZeRO-" << zero_stage_ << ": parameters synchronised right after each step in "
                        << partition_->sync_buckets(params_).size() << " broadcasts";
        sync_reported_ = true;
        partition_->sync_parameters(*group_, params_);  // few flat broadcasts
    }
    if (step_clears_gradients_) return;  // the graphed step zeroed its buckets already
    // Buckets zeroed in place, every grad a view of its bucket again (the optimizer's zero_grad
    // dropped them); without the reducer's buckets (one process, graphed step) grads are dropped.
    if (reducer_ && reducer_->owns_gradients())
        reducer_->zero_grad();
    else
        for (auto& p : params_) p.mutable_grad() = at::Tensor();
}

StepAgreement DataParallel::agree(double loss, bool stop, int fault_gpu) {
    StepAgreement out;
    out.mean_loss = loss;
    out.stop = stop;
    if (env_.world_size <= 1) {
        if (fault_gpu > 0) out.fault_rank = 0, out.fault_gpu = fault_gpu - 1;
        return out;
    }
    PendingAgreement pending = agree_async(
        at::full({1}, loss, at::TensorOptions().dtype(at::kDouble).device(device_)), stop, fault_gpu);
    pending.reduce->wait();
    const at::Tensor flags = pending.flags.cpu().contiguous();
    return read_agreement(flags.data_ptr<double>());
}

DataParallel::PendingAgreement DataParallel::agree_async(const at::Tensor& loss, bool stop, int fault_gpu) {
    // [2 + W] float64: stop count, loss sum, then each rank's faulty GPU index + 1 (0: none). Built
    // where the collective runs by fills and a device copy: no host memory to stage or to wait for.
    PendingAgreement out;
    out.flags = at::zeros({agreement_size()}, at::TensorOptions().dtype(at::kDouble).device(device_));
    if (stop) out.flags.narrow(0, 0, 1).fill_(1.0);
    out.flags.narrow(0, 1, 1).copy_(loss.reshape({1}));
    if (fault_gpu > 0) out.flags.narrow(0, 2 + env_.rank, 1).fill_(static_cast<double>(fault_gpu));
    // On the side communicator: issued right after a graph replay, it needs no host wait for it.
    out.reduce = group_->all_reduce_sum_side_async(out.flags);
    return out;
}

StepAgreement DataParallel::read_agreement(const double* a) const {
    group_->throw_if_peer_failed();  // NCCL: an aborted all-reduce leaves garbage behind
    StepAgreement out;
    out.stop = a[0] > 0;
    out.mean_loss = a[1] / env_.world_size;
    for (int r = 0; r < env_.world_size; ++r)
        if (a[2 + r] > 0) {
            out.fault_rank = r;
            out.fault_gpu = static_cast<int>(a[2 + r]) - 1;
            break;
        }
    return out;
}

void DataParallel::check_identical(const std::vector<std::string>& names, double tolerance) {
    flush_parameters();
    dist::check_parameters_identical(*group_, params_, names, tolerance);
}

void DataParallel::check_shared_output_dir(const std::filesystem::path& dir) {
    if (env_.world_size <= 1) return;
    const char* wait_env = std::getenv("DTUNE_SHARED_DIR_WAIT_S");
    const auto wait = std::chrono::duration<double>(wait_env && *wait_env ? std::atof(wait_env) : 60.0);
    auto token = at::zeros({1}, at::TensorOptions().dtype(at::kLong));
    if (env_.rank == 0)
        token.fill_(static_cast<int64_t>(std::random_device{}() >> 1) << 20 | env_.world_size);
    at::Tensor on_device = token.to(device_);
    group_->broadcast_(on_device, 0);
    const std::string expected = std::to_string(on_device.cpu().item<int64_t>());
    const auto file = dir / ".dtune-shared-output-check";
    if (env_.rank == 0) fs::write_file_atomic(file, expected);
    group_->barrier();
    // NFS clients may cache a directory listing for a few seconds: poll until `wait` passes.
    bool seen = false;
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::milliseconds>(wait);
    for (;;) {
        std::error_code ec;
        if (std::filesystem::exists(file, ec) && fs::read_file(file) == expected) {
            seen = true;
            break;
        }
        if (std::chrono::steady_clock::now() >= deadline) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    auto missing = at::full({1}, seen ? 0.0 : 1.0, at::TensorOptions().dtype(at::kDouble)).to(device_);
    group_->all_reduce_sum_(missing);
    const int n_missing = static_cast<int>(missing.cpu().item<double>());
    group_->barrier();
    if (env_.rank == 0) std::filesystem::remove(file);
    if (n_missing > 0)
        throw UsageError(str(
            "output_dir ", dir.string(), " is not shared by every rank: ", n_missing, " of ", env_.world_size,
            " ranks", seen ? "" : str(" (this one, rank ", env_.rank, ", among them)"),
            " could not read the check file rank 0 wrote there. Put output_dir on storage ",
            "every node mounts at the same path (NFS or similar, same UID/GID), see ", "docs/multi-node.md"));
}

void DataParallel::write_shards(const std::filesystem::path& tmp_dir,
                                const std::function<void(const std::filesystem::path&)>& write) {
    if (env_.world_size <= 1) {
        write(tmp_dir);
        return;
    }
    group_->barrier();  // rank 0 has created tmp_dir
    write(tmp_dir);
    group_->barrier();  // every rank's files are in place
}

std::string rank_rng_file(int rank) {
    return str("random_states_rank", rank, ".safetensors");
}

std::string optimizer_shard_file(int rank, int world) {
    return str("optimizer-shard-", rank, "-of-", world, ".safetensors");
}

bool is_optimizer_shard_file(const std::string& relative_path) {
    return relative_path.rfind("optimizer-shard-", 0) == 0;
}

}  // namespace dtune::train

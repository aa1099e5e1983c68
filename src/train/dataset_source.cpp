// DatasetBatchSource serving (see dataset_source.h): the planner (dataset choice, global bucket
// samplers, rank slices, epochs), the prefetch thread and collation into TrainBatch.
#include <random>

#include "core/error.h"
#include "core/log.h"
#include "data/captions.h"
#include "train/dataset_loader.h"

namespace dtune::train {
namespace detail {

// ---- planner ----------------------------------------------------------------------------------

EpochLayout layout_for_epoch(const RebucketInputs& in, int64_t epoch) {
    // The same rules as the start-up pass (plan_dataset judged epoch 1's draw with them):
    // out-of-range buckets dropped by rebucket_epoch, then pruning and the batch-size check.
    const data::EpochBuckets eb =
        data::rebucket_epoch(in.settings, in.indexed, in.seed, in.check.dataset_id, epoch, in.pins);
    if (!eb.dropped.empty()) {
        size_t n = 0;
        std::string keys;
        for (const auto& [key, paths] : eb.dropped) {
            n += paths.size();
            keys += (keys.empty() ? "" : ", ") + key;
        }
        log::info()
            << "dataset '" << in.check.dataset_id << "', epoch " << epoch + 1 << ": " << n
            << " image(s) drawn into bucket(s) " << keys
            << " outside minimum/maximum_aspect_ratio sit this epoch out (they draw again next epoch)";
    }
    std::map<std::string, int64_t> sizes;
    for (const auto& [key, paths] : eb.buckets) sizes[key] = static_cast<int64_t>(paths.size());
    data::EpochPlan plan;
    try {
        plan = data::plan_epoch(in.check, sizes);
    } catch (const UsageError& e) {
        // This epoch's random buckets fail the batch-size check that epoch 1's passed at start:
        // rather than stop the run, oversubscribe (automatic repeats) this epoch and say so. This
        // holds whatever allow_dataset_oversubscription and a hand-set repeats say, which only
        // decide what the start-up check accepts.
        log::warn() << "dataset '" << in.check.dataset_id << "', epoch " << epoch + 1
                    << ": the crop_aspect random buckets fail the batch-size check; this epoch "
                    << "repeats the short buckets (allow_dataset_oversubscription); "
                    << std::string(e.what()).substr(0, std::string(e.what()).find('\n'));
        auto check = in.check;
        check.allow_oversubscription = true;
        check.repeats_set_by_user = false;
        plan = data::plan_epoch(check, sizes);
    }
    EpochLayout out;
    for (int r = 0; r < in.world_size; ++r)
        for (auto& [key, list] : data::rank_bucket_lists(eb.buckets, plan, in.check.dataset_id, in.seed,
                                                         in.world_size, r, in.check.apply_padding))
            out.global[key].insert(out.global[key].end(), list.begin(), list.end());
    for (const auto& [key, list] : out.global) out.samples += static_cast<int64_t>(list.size());
    if (out.samples == 0)
        log::warn() << "dataset '" << in.check.dataset_id << "', epoch " << epoch + 1
                    << ": crop_aspect random left no usable bucket (every image drawn outside "
                    << "minimum/maximum_aspect_ratio or into a bucket pruned below train_batch_size); "
                    << "the dataset sits this epoch out\n"
                    << plan.report();
    out.plans = eb.plans;
    return out;
}

Planner::Planner(const std::vector<LoadedDataset>& datasets, uint64_t seed, int world_size, int rank)
    : seed_(seed), world_size_(world_size), rank_(rank) {
    for (const auto& d : datasets) {
        samplers_.emplace_back(d.global, d.batch_size * world_size, d.config.repeats, seed, d.config.id);
        data::DatasetWeight w;
        w.id = d.config.id;
        w.probability = d.config.probability;
        w.length = d.report.samples;
        w.start_epoch = d.config.start_epoch;
        w.start_step = d.config.start_step;
        w.end_epoch = d.config.end_epoch;
        w.end_step = d.config.end_step;
        weights_.push_back(w);
        ids_.push_back(d.config.id);
        batch_sizes_.push_back(d.batch_size);
        rebucket_.push_back(d.rebucket);
        epoch_plans_.emplace_back();
        repeats_.push_back(d.config.repeats);
    }
    begin_epoch(0);
}

void Planner::layout_epoch(int64_t epoch) {
    for (size_t i = 0; i < samplers_.size(); ++i) {
        if (!rebucket_[i]) continue;
        EpochLayout layout = layout_for_epoch(*rebucket_[i], epoch);
        samplers_[i] = data::BucketSampler(std::move(layout.global), batch_sizes_[i] * world_size_,
                                           repeats_[i], seed_, ids_[i]);
        weights_[i].length = layout.samples;
        epoch_plans_[i] =
            std::make_shared<const std::map<std::string, data::SamplePlan>>(std::move(layout.plans));
    }
}

void Planner::begin_epoch(int64_t epoch) {
    epoch_ = epoch;
    in_epoch_ = 0;
    done_.assign(samplers_.size(), false);
    layout_epoch(epoch);
    for (auto& s : samplers_) s.begin_epoch(epoch);
}

PlannedBatch Planner::next() {
    for (;;) {
        auto weights = weights_;
        for (size_t i = 0; i < weights.size(); ++i)
            if (done_[i]) weights[i].probability = 0;
        // Steps and epochs as SimpleTuner counts them for start/end windows: epochs from 1.
        const auto pick = data::choose_dataset(weights, served_, epoch_ + 1, seed_);
        if (!pick) {
            DTUNE_CHECK_AS(UsageError, in_epoch_ > 0, "no dataset is active in epoch ", epoch_ + 1,
                           " at step ", served_,
                           "; check the datasets' start_epoch/end_epoch/start_step/end_step and probability",
                           " (a crop_aspect random dataset whose draw left no usable bucket sits the epoch "
                           "out, see the warning above: widen minimum/maximum_aspect_ratio or add images)");
            begin_epoch(epoch_ + 1);
            continue;
        }
        auto& sampler = samplers_[*pick];
        auto batch = sampler.next();
        while (!batch && sampler.next_pass()) batch = sampler.next();
        if (!batch) {
            done_[*pick] = true;
            continue;
        }
        PlannedBatch p;
        p.dataset = *pick;
        p.bucket = batch->bucket;
        const size_t bs = static_cast<size_t>(batch_sizes_[*pick]);
        p.first_position = static_cast<int64_t>(bs) * rank_;
        p.samples.assign(batch->samples.begin() + long(bs * size_t(rank_)),
                         batch->samples.begin() + long(bs * size_t(rank_ + 1)));
        if (epoch_plans_[*pick])
            for (const auto& path : p.samples) p.plans.push_back(epoch_plans_[*pick]->at(path));
        p.epoch = epoch_;
        p.batch_in_epoch = in_epoch_;
        ++served_;
        ++in_epoch_;
        return p;
    }
}

int64_t Planner::batches_per_epoch() const {
    int64_t n = 0;
    for (const auto& s : samplers_) n += s.batches_per_epoch();
    return n;
}

nlohmann::json Planner::state() const {
    nlohmann::json samplers = nlohmann::json::array();
    for (const auto& s : samplers_) samplers.push_back(s.state().to_json());
    return {{"kind", "datasets"},        {"datasets", ids_}, {"batch_sizes", batch_sizes_},
            {"world_size", world_size_}, {"epoch", epoch_},  {"served", served_},
            {"in_epoch", in_epoch_},     {"done", done_},    {"samplers", samplers}};
}

void Planner::load_state(const nlohmann::json& s) {
    DTUNE_CHECK_AS(UsageError, s.value("kind", "") == "datasets",
                   "the checkpoint's batch state was written by another kind of data source (",
                   s.value("kind", "?"), "); resume with the multidatabackend.json it was written with");
    DTUNE_CHECK_AS(UsageError, s.at("datasets").get<std::vector<std::string>>() == ids_,
                   "the checkpoint was written with datasets ", s.at("datasets").dump(),
                   " but the config has ", nlohmann::json(ids_).dump(),
                   "; resume with the same multidatabackend.json");
    // The samplers serve global batches (per-rank batch x world size), so a resume on another
    // number of ranks is exact when every dataset's global batch is unchanged.
    const auto saved_sizes = s.at("batch_sizes").get<std::vector<int>>();
    const int saved_world = s.at("world_size").get<int>();
    bool same_global = saved_sizes.size() == batch_sizes_.size();
    for (std::size_t i = 0; same_global && i < saved_sizes.size(); ++i)
        same_global = saved_sizes[i] * saved_world == batch_sizes_[i] * world_size_;
    auto global = [](const std::vector<int>& sizes, int world) {
        nlohmann::json g = nlohmann::json::array();
        for (int b : sizes) g.push_back(b * world);
        return g.size() == 1 ? g[0].dump() : g.dump();
    };
    DTUNE_CHECK_AS(UsageError, same_global, "the checkpoint was written with a global batch of ",
                   global(saved_sizes, saved_world), " (train_batch_size ", s.at("batch_sizes").dump(),
                   " on ", saved_world, " rank(s)), now ", global(batch_sizes_, world_size_), " (",
                   nlohmann::json(batch_sizes_).dump(), " on ", world_size_,
                   "); resume with the same train_batch_size x number of processes");
    epoch_ = s.at("epoch").get<int64_t>();
    served_ = s.at("served").get<int64_t>();
    in_epoch_ = s.at("in_epoch").get<int64_t>();
    done_ = s.at("done").get<std::vector<bool>>();
    layout_epoch(epoch_);  // the saved sampler states belong to that epoch's buckets
    for (size_t i = 0; i < samplers_.size(); ++i)
        samplers_[i].restore(data::SamplerState::from_json(s.at("samplers").at(i)));
}

// ---- preparation --------------------------------------------------------------------------------

namespace {

// The per-sample generator: a pure function of where the sample sits, not of thread timing.
std::mt19937_64 sample_rng(uint64_t seed, const std::string& dataset, const PlannedBatch& p,
                           int64_t position) {
    uint64_t s = data::mix64(seed ^ data::hash64(dataset));
    s = data::mix64(s ^ static_cast<uint64_t>(p.epoch));
    s = data::mix64(s ^ static_cast<uint64_t>(p.batch_in_epoch));
    return std::mt19937_64(data::mix64(s ^ static_cast<uint64_t>(position)));
}

}  // namespace
}  // namespace detail

detail::PreparedBatch DatasetBatchSource::Impl::prepare(const detail::PlannedBatch& p) {
    auto& d = datasets.at(p.dataset);
    detail::PreparedBatch out;
    TrainBatch& b = out.batch;
    std::vector<data::LatentRequest> requests;
    std::vector<data::SamplePlan> plans;
    std::vector<bool> flips;
    for (size_t i = 0; i < p.samples.size(); ++i) {
        const std::string& path = p.samples[i];
        const data::SamplePlan& plan = p.plans.empty() ? d.plans.at(path) : p.plans[i];
        auto rng = detail::sample_rng(options.seed, d.config.id, p, p.first_position + int64_t(i));
        b.captions.push_back(data::pick_caption(d.captions.at(path), rng));
        // Drawn after the caption so captions are what they were without flips.
        const bool flip = d.config.random_flip && (rng() >> 63) != 0;
        data::LatentRequest request{path, plan, flip};
        if (d.config.vae_cache_disable) request.noise_salt = rng() | 1;  // a fresh posterior sample per draw
        requests.push_back(request);
        plans.push_back(plan);
        flips.push_back(flip);
        b.paths.push_back(path);
    }
    b.regularisation = d.config.is_regularisation_data;
    b.latents = d.latents->get(requests).to(at::kFloat);  // [B, C, h, w]
    data::TextEncodeFn encode = text;
    if (!encode)
        encode = [&d](const std::vector<std::string>& captions) -> data::TextEmbeds {
            throw DataError(
                str("a text-embedding entry for \"", captions.front(), "\" in ",
                    d.text_cache->settings().cache_dir,
                    " became unreadable during training and the text encoders were released after "
                    "caching; restart the run (the entry is rebuilt at start-up)"));
        };
    b.cond = data::text_embeds_for(*d.text_cache, b.captions, encode);  // name → [B, ...]
    for (auto& [name, t] : b.cond)
        if (at::isFloatingType(t.scalar_type())) t = t.to(at::kFloat);
    if (sample_conditioning) sample_conditioning(b.cond, plans, flips);
    if (options.device.is_cuda()) {
        b.latents = b.latents.pin_memory();
        for (auto& [name, t] : b.cond) t = t.pin_memory();
    }
    out.epoch = p.epoch;
    return out;
}

void DatasetBatchSource::Impl::producer(detail::Planner local) {
    for (;;) {
        {
            std::unique_lock lock(mutex);
            cv.wait(lock, [&] { return stop || queue.size() < size_t(options.prefetch_batches); });
            if (stop) return;
        }
        detail::PreparedBatch item;
        try {
            item = prepare(local.next());
            item.state_after = local.state();
        } catch (...) {
            item.error = std::current_exception();
        }
        const bool failed = static_cast<bool>(item.error);
        {
            std::lock_guard lock(mutex);
            queue.push_back(std::move(item));
        }
        cv.notify_all();
        if (failed) return;
    }
}

void DatasetBatchSource::Impl::start() {
    stop = false;
    running = true;
    thread = std::thread([this, local = planner] { producer(local); });
}

void DatasetBatchSource::Impl::halt() {
    if (!running) return;
    {
        std::lock_guard lock(mutex);
        stop = true;
    }
    cv.notify_all();
    thread.join();
    running = false;
    queue.clear();
    planner.load_state(consumed);  // the thread ran ahead; the consumed position is what counts
}

// ---- public -----------------------------------------------------------------------------------

DatasetBatchSource::DatasetBatchSource(DatasetSourceOptions options, DatasetEncoders encoders)
    : impl_(std::make_unique<Impl>()) {
    auto& m = *impl_;
    DTUNE_CHECK_AS(UsageError,
                   options.world_size >= 1 && options.rank >= 0 && options.rank < options.world_size, "rank ",
                   options.rank, " is outside world_size ", options.world_size);
    m.options = std::move(options);
    m.pool = std::make_unique<ThreadPool>(static_cast<size_t>(std::max(0, m.options.cache_threads)));
    auto setup = detail::setup_datasets(m.options, std::move(encoders), *m.pool);
    m.datasets = std::move(setup.datasets);
    m.empty = setup.empty_prompt;
    m.vae_released = setup.vae_released;
    m.text_released = setup.text_released;
    m.text = std::move(setup.text);
    m.sample_conditioning = std::move(setup.sample_conditioning);
    for (const auto& d : m.datasets) m.reports.push_back(d.report);
    m.planner = detail::Planner(m.datasets, m.options.seed, m.options.world_size, m.options.rank);
    m.consumed = m.planner.state();
}

DatasetBatchSource::~DatasetBatchSource() {
    if (impl_) impl_->halt();
}

TrainBatch DatasetBatchSource::next(at::Generator&) {
    auto& m = *impl_;
    detail::PreparedBatch item;
    if (m.options.prefetch_batches <= 0) {
        item = m.prepare(m.planner.next());
        item.state_after = m.planner.state();
    } else {
        if (!m.running) m.start();
        std::unique_lock lock(m.mutex);
        m.cv.wait(lock, [&] { return !m.queue.empty(); });
        item = std::move(m.queue.front());
        m.queue.pop_front();
        lock.unlock();
        m.cv.notify_all();
    }
    if (item.error) {
        m.halt();
        std::rethrow_exception(item.error);
    }
    m.consumed = std::move(item.state_after);
    m.consumed_epoch = item.epoch;
    TrainBatch b = std::move(item.batch);
    const bool async = m.options.device.is_cuda();
    b.latents = b.latents.to(m.options.device, /*non_blocking=*/async);
    for (auto& [name, t] : b.cond) t = t.to(m.options.device, /*non_blocking=*/async);
    return b;
}

int64_t DatasetBatchSource::batches_per_epoch() const {
    return impl_->planner.batches_per_epoch();
}

int64_t DatasetBatchSource::epoch() const {
    return impl_->consumed_epoch;
}

PromptEmbedding DatasetBatchSource::empty_prompt() {
    return impl_->empty;
}

nlohmann::json DatasetBatchSource::state() const {
    return impl_->consumed;
}

void DatasetBatchSource::load_state(const nlohmann::json& state) {
    auto& m = *impl_;
    m.halt();
    m.planner.load_state(state);
    m.consumed = m.planner.state();
    m.consumed_epoch = m.planner.epoch();
}

const std::vector<DatasetCacheReport>& DatasetBatchSource::cache_reports() const {
    return impl_->reports;
}

bool DatasetBatchSource::vae_released() const {
    return impl_->vae_released;
}

bool DatasetBatchSource::has_regularisation_data() const {
    for (const auto& d : impl_->datasets)
        if (d.config.is_regularisation_data) return true;
    return false;
}

bool DatasetBatchSource::text_encoder_released() const {
    return impl_->text_released;
}

}  // namespace dtune::train

// Dataset choice, rank bucket lists and the resumable bucket sampler.
#include "data/sampler.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <random>

#include "core/error.h"

namespace dtune::data {

using nlohmann::json;

uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

uint64_t hash64(const std::string& text) {
    uint64_t h = 0xCBF29CE484222325ull;
    for (unsigned char c : text) h = (h ^ c) * 0x100000001B3ull;
    return h;
}

namespace {

// Uniform in [0, n) from a 64-bit engine, by rejection (no implementation-defined distribution).
uint64_t below(std::mt19937_64& rng, uint64_t n) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t r;
    do r = rng();
    while (r >= limit);
    return r % n;
}

template <typename T>
void shuffle(std::vector<T>& v, std::mt19937_64& rng) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[below(rng, i)]);
}

bool in_window(const DatasetWeight& d, int64_t step, int64_t epoch) {
    if (epoch < d.start_epoch || step < d.start_step) return false;
    if (d.end_epoch && epoch > *d.end_epoch) return false;
    if (d.end_step && step > *d.end_step) return false;
    return true;
}

}  // namespace

std::optional<size_t> choose_dataset(const std::vector<DatasetWeight>& datasets, int64_t step, int64_t epoch,
                                     uint64_t seed, bool auto_weighting) {
    int64_t total = 0;
    for (const auto& d : datasets) total += d.length;
    std::vector<double> weights;
    double sum = 0;
    for (const auto& d : datasets) {
        double w = in_window(d, step, epoch) ? d.probability : 0.0;
        if (auto_weighting && total > 0) w *= static_cast<double>(d.length) / static_cast<double>(total);
        weights.push_back(w);
        sum += w;
    }
    if (!(sum > 0)) return std::nullopt;
    // 53 random bits → [0, 1): the same on every rank because it depends on seed+step only.
    const double u = static_cast<double>(mix64(seed + static_cast<uint64_t>(step)) >> 11) * 0x1.0p-53 * sum;
    double acc = 0;
    size_t last = 0;
    for (size_t i = 0; i < weights.size(); ++i) {
        if (weights[i] <= 0) continue;
        acc += weights[i];
        last = i;
        if (u < acc) return i;
    }
    return last;  // u rounding up to sum
}

std::map<std::string, std::vector<std::string>> rank_bucket_lists(
    const std::map<std::string, std::vector<std::string>>& buckets, const EpochPlan& plan,
    const std::string& id, uint64_t seed, int world_size, int rank, bool apply_padding) {
    std::map<std::string, std::vector<std::string>> out;
    for (const auto& b : plan.buckets) {
        auto it = buckets.find(b.key);
        if (it == buckets.end() || b.excluded > 0) continue;
        DTUNE_CHECK(static_cast<int64_t>(it->second.size()) == b.samples, "bucket ", b.key, " of dataset '",
                    id, "' changed size between planning and sharding");
        std::vector<std::string> list = it->second;
        std::sort(list.begin(), list.end());
        std::mt19937_64 rng(mix64(seed ^ hash64(id + ":" + b.key)));
        shuffle(list, rng);
        std::vector<std::string> local;
        for (int64_t i : rank_indices(b, world_size, rank, apply_padding)) local.push_back(list[i]);
        if (!local.empty()) out[b.key] = std::move(local);
    }
    return out;
}

json SamplerState::to_json() const {
    return {{"epoch", epoch},   {"pass", pass},           {"current", current},
            {"cursor", cursor}, {"exhausted", exhausted}, {"batches", batches}};
}

SamplerState SamplerState::from_json(const json& j) {
    SamplerState s;
    s.epoch = j.at("epoch").get<int64_t>();
    s.pass = j.at("pass").get<int64_t>();
    s.current = j.at("current").get<size_t>();
    s.cursor = j.at("cursor").get<std::vector<int64_t>>();
    s.exhausted = j.at("exhausted").get<std::vector<bool>>();
    s.batches = j.at("batches").get<int64_t>();
    return s;
}

BucketSampler::BucketSampler(std::map<std::string, std::vector<std::string>> buckets, int batch_size,
                             int repeats, uint64_t seed, std::string dataset_id)
    : batch_size_(batch_size), repeats_(repeats), seed_(seed), id_(std::move(dataset_id)) {
    DTUNE_CHECK_AS(UsageError, batch_size >= 1, "dataset '", id_, "': batch size must be >= 1");
    for (auto& [key, list] : buckets) {
        if (list.empty()) continue;
        keys_.push_back(key);
        lists_.push_back(std::move(list));
    }
    begin_epoch(0);
}

void BucketSampler::begin_epoch(int64_t epoch) {
    order_cache_.clear();
    state_ = SamplerState{};
    state_.epoch = epoch;
    state_.cursor.assign(keys_.size(), 0);
    state_.exhausted.assign(keys_.size(), false);
}

bool BucketSampler::next_pass() {
    if (state_.pass >= repeats_) return false;
    const int64_t epoch = state_.epoch, pass = state_.pass + 1;
    begin_epoch(epoch);
    state_.pass = pass;
    return true;
}

const std::vector<size_t>& BucketSampler::order_of(size_t b) {
    // The pass order of a bucket is a pure function of (seed, id, epoch, pass, bucket), so a
    // resumed sampler only needs the cursor.
    order_cache_.resize(keys_.size());
    std::vector<size_t>& order = order_cache_[b];
    if (order.empty()) {
        order.resize(lists_[b].size());
        for (size_t i = 0; i < order.size(); ++i) order[i] = i;
        std::mt19937_64 rng(mix64(seed_ ^ hash64(id_ + ":" + keys_[b]) ^
                                  mix64(static_cast<uint64_t>(state_.epoch * 1009 + state_.pass))));
        shuffle(order, rng);
    }
    return order;
}

std::optional<SamplerBatch> BucketSampler::next() {
    const size_t n = keys_.size();
    for (size_t tried = 0; tried < n; ++tried) {
        const size_t b = (state_.current + tried) % n;
        if (state_.exhausted[b]) continue;
        const std::vector<size_t>& order = order_of(b);
        const std::vector<std::string>& list = lists_[b];
        const int64_t start = state_.cursor[b];
        const int64_t take = std::min<int64_t>(batch_size_, static_cast<int64_t>(order.size()) - start);
        SamplerBatch batch;
        batch.bucket = keys_[b];
        for (int64_t i = start; i < start + take; ++i) batch.samples.push_back(list[order[i]]);
        state_.cursor[b] += take;
        if (state_.cursor[b] >= static_cast<int64_t>(order.size())) {
            // Fill a short batch with already-seen samples of the same bucket, then retire it.
            std::mt19937_64 fill(mix64(seed_ ^ hash64(id_) ^ static_cast<uint64_t>(state_.batches)));
            while (static_cast<int>(batch.samples.size()) < batch_size_)
                batch.samples.push_back(list[order[below(fill, order.size())]]);
            state_.exhausted[b] = true;
        }
        state_.current = (b + 1) % n;
        ++state_.batches;
        return batch;
    }
    return std::nullopt;
}

int64_t BucketSampler::batches_per_epoch() const {
    int64_t n = 0;
    for (const auto& l : lists_) n += (static_cast<int64_t>(l.size()) + batch_size_ - 1) / batch_size_;
    return n * (repeats_ + 1);
}

void BucketSampler::restore(const SamplerState& s) {
    if (s.cursor.size() != keys_.size() || s.exhausted.size() != keys_.size() ||
        (keys_.size() > 0 && s.current >= keys_.size()))
        throw UsageError(str("dataset '", id_, "': the saved sampler state has ", s.cursor.size(),
                             " buckets but the dataset now has ", keys_.size(),
                             "; the dataset changed since the checkpoint — resume from a fresh epoch"));
    for (size_t b = 0; b < keys_.size(); ++b)
        if (s.cursor[b] > static_cast<int64_t>(lists_[b].size()))
            throw UsageError(str("dataset '", id_, "': saved position in bucket ", keys_[b],
                                 " is past its end; the dataset changed since the checkpoint"));
    state_ = s;
    order_cache_.clear();
}

}  // namespace dtune::data

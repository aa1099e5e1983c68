// Effective-batch-size check, oversubscription and the per-epoch bucket plan.
#include "data/batch_plan.h"

#include <algorithm>
#include <sstream>

#include "core/error.h"
#include "core/log.h"

namespace dtune::data {

namespace {

int64_t ceil_div(int64_t a, int64_t b) {
    return (a + b - 1) / b;
}

std::string zero_batches_message(const BatchCheckInput& in, int64_t ebs, int world, int64_t total,
                                 const std::map<std::string, int64_t>& failing) {
    std::ostringstream m;
    int64_t max_needed = 0;
    for (const auto& [key, n] : failing) max_needed = std::max(max_needed, ceil_div(ebs, n) - 1);
    m << "Dataset configuration will produce zero usable batches.\n"
      << "\nCurrent configuration:\n"
      << "  - Dataset ID: " << in.dataset_id << "\n"
      << "  - Total samples: " << total << "\n"
      << "  - Repeats: " << in.repeats << "\n"
      << "  - Batch size: " << in.train_batch_size << "\n"
      << "  - Number of GPUs: " << world << "\n"
      << "  - Gradient accumulation steps: " << in.gradient_accumulation_steps << "\n"
      << "  - Effective batch size: " << ebs << "\n"
      << "\nProblem: " << failing.size() << " bucket(s) have insufficient samples:\n";
    for (const auto& [key, n] : failing) {
        m << "  - Bucket " << key << ": " << n << " samples × " << in.repeats + 1
          << " (with repeats) = " << n * (in.repeats + 1) << " samples\n"
          << "    Need at least " << ebs << " samples to form one batch\n"
          << "    Minimum repeats required: " << ceil_div(ebs, n) - 1 << "\n";
    }
    m << "\nSolutions:\n"
      << "  1. Reduce batch_size (current: " << in.train_batch_size << ")\n"
      << "  2. Reduce gradient_accumulation_steps (current: " << in.gradient_accumulation_steps << ")\n"
      << "  3. Use fewer GPUs (current: " << world << ")\n"
      << "  4. Increase repeats to at least " << max_needed << " (current: " << in.repeats << ")\n"
      << "  5. Add more samples to the dataset\n"
      << "  6. Enable --allow_dataset_oversubscription to automatically adjust repeats\n";
    if (in.repeats_set_by_user) {
        m << "\nNote: You have manually set repeats=" << in.repeats << " in your dataset config.\n"
          << "--allow_dataset_oversubscription will not override manual repeats settings.\n"
          << "Either increase your repeats value or remove it from the config to allow auto-adjustment.\n";
    }
    return m.str();
}

// Fills per-rank counts, batches and the per-epoch contribution of a bucket that passed.
void fill_split(BucketEpochPlan& b, int world, int batch_size, bool padding) {
    b.per_rank.assign(world, 0);
    if (b.oversubscribed) {
        for (auto& c : b.per_rank) c = b.scheduled / world;
    } else {
        const int64_t base = b.samples / world, rem = b.samples % world;
        for (int r = 0; r < world; ++r) b.per_rank[r] = base + (r < rem ? 1 : 0);
        if (padding && rem > 0) {
            b.padded = (base + 1) * world - b.samples;
            for (auto& c : b.per_rank) c = base + 1;
        }
    }
    // Oversubscribed indices already hold the duplicates, so they make one pass; otherwise the
    // sampler makes repeats+1 passes, each ceil(n / batch) batches, and fills the short last batch
    // of a pass with already-seen samples of the bucket (§3.5). Those fills are not samples of the
    // epoch: they are counted apart.
    const int64_t passes = b.oversubscribed ? 1 : b.repeats + 1;
    int64_t scheduled = 0;
    for (int64_t n : b.per_rank) {
        b.batches_per_rank = std::max(b.batches_per_rank, n == 0 ? 0 : passes * ceil_div(n, batch_size));
        scheduled += n * passes;
    }
    b.samples_per_epoch = scheduled;
    b.filled = b.batches_per_rank * batch_size * world - scheduled;
    const int64_t empty_ranks = std::count(b.per_rank.begin(), b.per_rank.end(), 0);
    if (empty_ranks > 0 && b.excluded_reason.empty())
        b.excluded_reason = std::to_string(empty_ranks) + " rank(s) hold no sample of this bucket";
}

}  // namespace

int64_t EpochPlan::samples_per_epoch() const {
    int64_t n = 0;
    for (const auto& b : buckets) n += b.samples_per_epoch;
    return n;
}

int64_t EpochPlan::excluded() const {
    int64_t n = 0;
    for (const auto& b : buckets) n += b.excluded;
    for (const auto& [reason, count] : excluded_before_bucketing) n += count;
    return n;
}

EpochPlan plan_epoch(const BatchCheckInput& in, const std::map<std::string, int64_t>& bucket_sizes) {
    DTUNE_CHECK_AS(UsageError,
                   in.train_batch_size >= 1 && in.world_size >= 1 && in.gradient_accumulation_steps >= 1,
                   "dataset '", in.dataset_id,
                   "': train_batch_size, world size and gradient_accumulation_steps must "
                   "all be >= 1");
    const int world = in.is_eval ? 1 : in.world_size;
    EpochPlan plan;
    plan.dataset_id = in.dataset_id;
    plan.effective_batch_size =
        static_cast<int64_t>(in.train_batch_size) * world * in.gradient_accumulation_steps;
    const int64_t ebs = plan.effective_batch_size;
    const bool oversubscribe_allowed = in.allow_oversubscription && !in.repeats_set_by_user;
    std::map<std::string, int64_t> kept, failing;
    for (const auto& [key, n] : bucket_sizes) {
        plan.total_samples += n;
        BucketEpochPlan b;
        b.key = key;
        b.samples = n;
        b.repeats = in.repeats;
        if (n == 0) continue;
        // §3.3 pruning runs before the split: buckets that cannot fill one micro-batch go, unless
        // oversubscription will repeat them up to the effective batch size (which it checks first).
        if (!in.disable_bucket_pruning && !oversubscribe_allowed &&
            n * (in.repeats + 1) < in.train_batch_size) {
            b.excluded = n;
            b.excluded_reason = "pruned: " + std::to_string(n) + " samples × " +
                                std::to_string(in.repeats + 1) + " < train_batch_size " +
                                std::to_string(in.train_batch_size);
            plan.buckets.push_back(b);
            continue;
        }
        kept[key] = n;
        if (n * (in.repeats + 1) < ebs) failing[key] = n;
        plan.buckets.push_back(b);
    }
    const bool oversubscribe = !failing.empty() && oversubscribe_allowed;
    if (!failing.empty() && !oversubscribe)
        throw UsageError(zero_batches_message(in, ebs, world, plan.total_samples, failing));
    for (auto& b : plan.buckets) {
        if (b.excluded > 0) continue;
        if (failing.count(b.key)) {
            b.oversubscribed = true;
            b.repeats = static_cast<int>(ceil_div(ebs, b.samples) - 1);
            const int64_t logical = b.samples * (b.repeats + 1);
            b.scheduled = ceil_div(logical, ebs) * ebs;
            plan.max_auto_repeat = std::max(plan.max_auto_repeat, b.repeats);
        }
        fill_split(b, world, in.train_batch_size, in.apply_padding || b.oversubscribed);
    }
    if (plan.max_auto_repeat > 0) {
        plan.warnings.push_back(str("(id=", in.dataset_id,
                                    ") Dataset oversubscription enabled: undersized buckets "
                                    "repeat up to ",
                                    plan.max_auto_repeat + 1, "× per epoch (effective batch size ", ebs, ", ",
                                    world, " GPUs)"));
    }
    for (const auto& w : plan.warnings) log::warn() << w;
    return plan;
}

std::vector<int64_t> rank_indices(const BucketEpochPlan& b, int world, int rank, bool apply_padding) {
    DTUNE_CHECK(world >= 1 && rank >= 0 && rank < world, "rank ", rank, " is outside world size ", world);
    std::vector<int64_t> out;
    if (b.samples == 0 || b.excluded > 0) return out;
    if (b.oversubscribed) {
        const int64_t local = b.scheduled / world;
        for (int64_t k = 0; k < local; ++k) out.push_back((rank * local + k) % b.samples);
        return out;
    }
    const int64_t base = b.samples / world, rem = b.samples % world;
    const int64_t start = rank * base + std::min<int64_t>(rank, rem);
    const int64_t count = base + (rank < rem ? 1 : 0);
    for (int64_t k = 0; k < count; ++k) out.push_back(start + k);
    if (apply_padding && rem > 0 && count == base) out.push_back(b.samples - 1);
    return out;
}

std::string EpochPlan::report() const {
    std::ostringstream m;
    m << "dataset '" << dataset_id << "': " << total_samples << " samples, effective batch size "
      << effective_batch_size << ", " << samples_per_epoch() << " samples per epoch, " << excluded()
      << " excluded\n";
    for (const auto& b : buckets) {
        m << "  bucket " << b.key << ": " << b.samples << " samples, repeats " << b.repeats
          << (b.oversubscribed ? " (auto)" : "") << ", " << b.samples_per_epoch << " per epoch";
        if (!b.per_rank.empty()) {
            m << " (" << b.per_rank.front() << " per rank, " << b.batches_per_rank << " batches";
            if (b.filled > 0) m << "; " << b.filled << " batch slot(s) filled with already-seen samples";
            m << ")";
        }
        if (b.padded > 0) m << ", " << b.padded << " padded";
        if (!b.excluded_reason.empty()) m << "; excluded " << b.excluded << ": " << b.excluded_reason;
        m << "\n";
    }
    for (const auto& [reason, count] : excluded_before_bucketing)
        m << "  not bucketed: " << count << " file(s) " << reason << "\n";
    return m.str();
}

}  // namespace dtune::data

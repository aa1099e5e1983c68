// The ZeRO-3 engine (dist/zero3.h) bound to a model through its unit hooks (train/zero3_model.h),
// on a small stack of Linear blocks: 2 and 3 real Gloo ranks on loopback, one thread each. Judged
// against the same stack trained unsharded in one process on the union of the ranks' batches:
//  - each rank's slice gradients equal the matching elements of the unsharded gradients, with and
//    without gradient checkpointing, resharding after forward or not, over 2 accumulated
//    micro-steps;
//  - an SGD step on the slices, gathered back, equals the unsharded step;
//  - parameter bytes resident per rank: the shards only (~1/N, padding < N elements per unit)
//    between steps, and after the forward only the root unit gathered on top (blocks released);
//    computed from the engine's storages, not hard-coded;
//  - prefetch (the next units' gathers issued ahead of use): the same gradients and step, bit for
//    bit, as gathering each unit when it is needed, with every block but the first of each pass
//    prefetched, no gather wasted, and at most `prefetch` units gathered ahead at once; with the
//    blocks run out of the predicted order (permuted, one skipped) still the unsharded results;
//  - parameter offload: shards in host memory, nothing resident on the device between steps, the
//    same results bit for bit;
//  - reduce-scatters retired during backward (at most `reduce_in_flight` units' full-size gradients
//    alive at once) give the same results bit for bit as waiting for all of them at the end.
// Also ZeRO-1/2's deferred parameter sync (train/zero_sync.h), which uses the same unit hooks.
#include <gtest/gtest.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include <future>
#include <map>

#include "dist/group.h"
#include "dist/loopback_group.h"
#include "dist/zero3.h"
#include "models/common/checkpoint.h"
#include "models/common/unit_hooks.h"
#include "support/shell.h"
#include "support/test_support.h"
#include "train/zero3_model.h"
#include "train/zero_sync.h"

namespace dtune {
namespace zero3_engine_test_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

constexpr int64_t kDim = 8;
constexpr int kBlocks = 4;

struct BlockImpl : torch::nn::Module, models::HookableUnit {
    BlockImpl() {
        a = register_module("a", torch::nn::Linear(kDim, 2 * kDim));
        b = register_module("b", torch::nn::Linear(2 * kDim, kDim));
    }
    at::Tensor forward(const at::Tensor& x) { return x + b(at::gelu(a(x))); }  // [B, D]
    torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Block);

struct StackImpl : torch::nn::Module {
    StackImpl() {
        proj_in = register_module("proj_in", torch::nn::Linear(kDim, kDim));
        auto list = register_module("blocks", torch::nn::ModuleList());
        for (int i = 0; i < kBlocks; ++i) {
            blocks.push_back(Block());
            list->push_back(blocks.back());
        }
        proj_out = register_module("proj_out", torch::nn::Linear(kDim, 1));
        // Deterministic weights (the RNG is shared by the rank threads).
        at::NoGradGuard no_grad;
        int64_t k = 0;
        for (auto& p : parameters()) {
            p.copy_(
                at::sin(at::arange(p.numel(), at::kFloat) * 0.37 + static_cast<double>(++k)).view(p.sizes()) *
                0.3);
        }
    }
    // `order`: the blocks to run, in this order (empty: all, in registration order).
    at::Tensor forward(const at::Tensor& x, bool checkpointing, const std::vector<int>& order = {}) {
        at::Tensor h = proj_in(x);
        std::vector<Block> run = blocks;
        if (!order.empty()) {
            run.clear();
            for (const int i : order) run.push_back(blocks[static_cast<std::size_t>(i)]);
        }
        for (auto& block : run) {
            if (checkpointing) {
                auto fn = [impl = block.ptr()](const std::vector<at::Tensor>& in) {
                    return models::run_unit(*impl, [&] { return impl->forward(in[0]); });
                };
                h = models::checkpointed(fn, {h}, block->parameters());
            } else {
                h = models::run_unit(*block, [&] { return block->forward(h); });
            }
        }
        return proj_out(h);  // [B, 1]
    }
    torch::nn::Linear proj_in{nullptr}, proj_out{nullptr};
    std::vector<Block> blocks;
};
TORCH_MODULE(Stack);

// Rank r's micro-batch m: [2, D].
at::Tensor batch_of(int rank, int micro) {
    return at::cos(at::arange(2 * kDim, at::kFloat) * (0.11 + 0.05 * rank) + micro).view({2, kDim});
}

struct Case {
    int world = 2;
    bool checkpointing = false;
    bool reshard = true;
    int prefetch = 1;
    bool offload = false;
    int reduce_in_flight = 2;
    // The block order of each micro-step (empty: all blocks in order); its size is the number of
    // micro-steps (default 2).
    std::vector<std::vector<int>> orders = {{}, {}};
};

struct RankResult {
    std::map<std::string, std::vector<std::pair<int64_t, at::Tensor>>> slice_grads;  // name -> (begin, grad)
    std::map<std::string, at::Tensor> stepped;  // whole weights after SGD
    int64_t resident_between = 0, shard = 0, full = 0, resident_after_forward = 0, root_bytes = 0;
    int64_t host_between = 0;
    int64_t gathers = 0, prefetched = 0;
    std::size_t units = 0, peak_gathered = 0, peak_prefetched = 0, peak_reducing = 0;
};

constexpr double kLr = 0.1;

RankResult run_rank(int rank, int port, const Case& c) {
    auto group = test::loopback_group(rank, c.world, port);
    Stack model;
    std::vector<std::string> names;
    std::vector<at::Tensor> params;
    for (const auto& item : model->named_parameters()) {
        names.push_back(item.key());
        params.push_back(item.value());
    }
    dist::Zero3Options zo;
    zo.reshard_after_forward = c.reshard;
    zo.prefetch = c.prefetch;
    zo.offload_params = c.offload;
    zo.reduce_in_flight = c.reduce_in_flight;
    train::ShardedModel sharded(*group, *model, names, params, zo);
    dist::Zero3Engine& engine = sharded.engine();
    RankResult r;
    r.units = engine.unit_count();
    r.shard = engine.shard_bytes();
    r.full = engine.full_parameter_bytes();
    for (std::size_t u = 0; u < engine.unit_count(); ++u)
        if (engine.unit(u).whole_step)
            for (const auto& p : engine.unit(u).params) r.root_bytes += p.numel() * 4;
    const int64_t gathers_before = engine.gathers();
    const auto micro = static_cast<int>(c.orders.size());
    for (int m = 0; m < micro; ++m) {
        engine.begin_forward();
        const at::Tensor loss =
            model->forward(batch_of(rank, m), c.checkpointing, c.orders[static_cast<std::size_t>(m)])
                .square()
                .mean() /
            micro;
        if (m == 0) r.resident_after_forward = engine.resident_parameter_bytes();
        loss.backward();
        engine.finish_backward();
    }
    r.gathers = engine.gathers() - gathers_before;
    r.prefetched = engine.prefetched_gathers();
    r.peak_gathered = engine.peak_gathered_units();
    r.peak_prefetched = engine.peak_prefetched_units();
    r.peak_reducing = engine.peak_reducing_units();
    r.resident_between = engine.resident_parameter_bytes();
    r.host_between = engine.host_parameter_bytes();
    {
        at::NoGradGuard no_grad;
        for (const auto& s : engine.slices()) {
            r.slice_grads[s.name].push_back({s.begin, s.value.grad().clone()});
            s.value.sub_(s.value.grad() * kLr);
        }
    }
    engine.zero_grad();
    engine.gather_all();
    for (std::size_t i = 0; i < names.size(); ++i) r.stepped[names[i]] = params[i].detach().clone();
    engine.release_all();
    group->barrier();
    group->shutdown();
    return r;
}

bool in_order(const Case& c) {
    for (const auto& o : c.orders)
        if (!o.empty()) return false;
    return true;
}

std::vector<RankResult> check_case(const Case& c) {
    SCOPED_TRACE(testing::Message() << c.world << " ranks, checkpointing " << c.checkpointing << ", reshard "
                                    << c.reshard << ", prefetch " << c.prefetch << ", offload " << c.offload
                                    << (in_order(c) ? "" : ", blocks out of order"));
    const auto micro = static_cast<int>(c.orders.size());
    // Reference: one process, the union of the ranks' batches (the mean of the per-rank means).
    Stack reference;
    for (int m = 0; m < micro; ++m) {
        std::vector<at::Tensor> xs;
        for (int r = 0; r < c.world; ++r) xs.push_back(batch_of(r, m));
        (reference->forward(at::cat(xs), false, c.orders[static_cast<std::size_t>(m)]).square().mean() /
         micro)
            .backward();
    }
    std::map<std::string, at::Tensor> ref_grad, ref_stepped;
    for (const auto& item : reference->named_parameters()) {
        ref_grad[item.key()] = item.value().grad().reshape({-1});
        ref_stepped[item.key()] = (item.value().detach() - item.value().grad() * kLr).clone();
    }

    const int port = test::free_port();
    std::vector<std::future<RankResult>> ranks;
    for (int r = 0; r < c.world; ++r)
        ranks.push_back(std::async(std::launch::async, [r, port, c] { return run_rank(r, port, c); }));
    std::vector<RankResult> results;
    for (auto& f : ranks) results.push_back(f.get());

    // Every element of every gradient is on exactly one rank, equal to the unsharded one.
    std::map<std::string, int64_t> covered;
    double worst = 0;
    for (const auto& r : results)
        for (const auto& [name, pieces] : r.slice_grads)
            for (const auto& [begin, g] : pieces) {
                const at::Tensor want = ref_grad.at(name).slice(0, begin, begin + g.numel());
                worst = std::max(worst, (g - want).abs().max().item<double>());
                covered[name] += g.numel();
            }
    double scale = 0;  // the largest gradient element: float rounding is relative to it
    for (const auto& [name, g] : ref_grad) {
        EXPECT_EQ(covered[name], g.numel()) << name;
        scale = std::max(scale, g.abs().max().item<double>());
    }
    EXPECT_LE(worst, 1e-6 * std::max(1.0, scale))
        << "slice gradients differ from the unsharded ones (largest " << scale << ")";
    for (const auto& r : results)
        for (const auto& [name, w] : ref_stepped)
            EXPECT_LE((r.stepped.at(name) - w).abs().max().item<double>(), 1e-6) << name;

    for (const auto& r : results) {
        EXPECT_EQ(r.units, static_cast<std::size_t>(kBlocks + 1));
        // Between steps: the shards only, 1/N of the parameters plus < N padding elements per unit
        // (offloaded: in host memory, none on the device).
        const int64_t on_device = c.offload ? 0 : r.shard;
        EXPECT_EQ(r.resident_between, on_device);
        EXPECT_EQ(r.host_between, c.offload ? r.shard : 0);
        EXPECT_GE(r.shard * c.world, r.full);
        EXPECT_LT(r.shard * c.world, r.full + static_cast<int64_t>(c.world * r.units * 4));
        // After the first forward (which has no prediction to prefetch by), only the root unit
        // (whole step) is gathered when blocks reshard; all of them otherwise.
        const int64_t root_padded = r.root_bytes + static_cast<int64_t>(c.world) * 4;
        if (c.reshard) {
            EXPECT_GE(r.resident_after_forward, on_device + r.root_bytes);
            EXPECT_LE(r.resident_after_forward, on_device + root_padded);
        } else {
            EXPECT_GE(r.resident_after_forward, on_device + r.full);
        }
        // Never more units gathered ahead of their use than the prefetch depth.
        EXPECT_LE(r.peak_prefetched, static_cast<std::size_t>(c.prefetch));
        if (c.prefetch == 0) {
            EXPECT_EQ(r.prefetched, 0);
        }
        if (!in_order(c)) continue;
        // Gathers per micro-step: root + each block in forward, + each block again in backward
        // (output-gradient hook, or the checkpoint's recomputation) when resharding; in order, the
        // prefetch wastes none.
        EXPECT_EQ(r.gathers, micro * (1 + kBlocks + (c.reshard ? kBlocks : 0)));
        if (c.prefetch > 0 && c.reshard) {
            // Prefetched: every block of each forward but the first (which records the order), and
            // every block of each backward but the last forward block, whose gradient starts it.
            EXPECT_EQ(r.prefetched, (micro - 1) * kBlocks + micro * (kBlocks - 1));
            EXPECT_EQ(r.peak_prefetched, static_cast<std::size_t>(std::min(c.prefetch, kBlocks - 1)));
        }
    }
    return results;
}

// Slice gradients and stepped weights of two runs of the same batches: equal bit for bit.
void expect_identical(const std::vector<RankResult>& a, const std::vector<RankResult>& b, const char* what) {
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t r = 0; r < a.size(); ++r) {
        ASSERT_EQ(a[r].slice_grads.size(), b[r].slice_grads.size());
        for (const auto& [name, pieces] : a[r].slice_grads) {
            const auto& other = b[r].slice_grads.at(name);
            ASSERT_EQ(pieces.size(), other.size()) << name;
            for (std::size_t i = 0; i < pieces.size(); ++i)
                EXPECT_TRUE(at::equal(pieces[i].second, other[i].second))
                    << what << ": rank " << r << " " << name;
        }
        for (const auto& [name, w] : a[r].stepped)
            EXPECT_TRUE(at::equal(w, b[r].stepped.at(name))) << what << ": rank " << r << " " << name;
    }
}

TEST(Zero3Engine, TwoRanksMatchUnshardedGradientsAndStep) {
    check_case({2, false, true});
}

TEST(Zero3Engine, ThreeRanksWithGradientCheckpointing) {
    check_case({3, true, true});
}

TEST(Zero3Engine, ThreeRanksWithoutCheckpointing) {
    check_case({3, false, true});
}

TEST(Zero3Engine, TwoRanksKeepingBlocksGatheredAfterForward) {
    check_case({2, false, false});
    check_case({2, true, false});
}

// Prefetch 1 and 2 against gathering on demand (prefetch 0), with and without gradient
// checkpointing: identical results; the prefetched units add at most `prefetch` to the peak of
// units gathered at once.
TEST(Zero3Engine, PrefetchEqualsGatheringOnDemand) {
    for (const bool checkpointing : {false, true}) {
        Case c{2, checkpointing, true};
        c.prefetch = 0;
        const auto sync = check_case(c);
        for (const int depth : {1, 2}) {
            c.prefetch = depth;
            const auto ahead = check_case(c);
            expect_identical(sync, ahead, checkpointing ? "prefetch, checkpointing" : "prefetch");
            for (std::size_t r = 0; r < ahead.size(); ++r) {
                std::printf(
                    "checkpointing %d, prefetch %d, rank %zu: %lld of %lld gathers prefetched, peak %zu "
                    "blocks gathered (%zu on demand)\n",
                    checkpointing, depth, r, static_cast<long long>(ahead[r].prefetched),
                    static_cast<long long>(ahead[r].gathers), ahead[r].peak_gathered, sync[r].peak_gathered);
                EXPECT_GT(ahead[r].prefetched, 0);
                EXPECT_LE(ahead[r].peak_gathered, sync[r].peak_gathered + static_cast<std::size_t>(depth));
                EXPECT_GT(ahead[r].peak_gathered, sync[r].peak_gathered);
            }
        }
    }
}

// Reduce-scatters retired as backward goes (1 or 2 in flight) against all of them waited for at
// the end of backward (0), with and without checkpointing and over 3 ranks: identical results,
// and never more than the bound of full-size unit gradients waiting (with 0, every trainable unit).
TEST(Zero3Engine, ReduceScattersRetiredDuringBackwardEqualWaitingAtTheEnd) {
    for (const bool checkpointing : {false, true}) {
        Case c{3, checkpointing, true};
        c.reduce_in_flight = 0;
        const auto at_end = check_case(c);
        for (const auto& r : at_end) EXPECT_EQ(r.peak_reducing, static_cast<std::size_t>(kBlocks + 1));
        for (const int depth : {1, 2}) {
            c.reduce_in_flight = depth;
            const auto retired = check_case(c);
            expect_identical(at_end, retired, checkpointing ? "retired, checkpointing" : "retired");
            for (const auto& r : retired) EXPECT_EQ(r.peak_reducing, static_cast<std::size_t>(depth));
        }
    }
}

// The blocks run out of the predicted order: the second micro-step permutes them, the third skips
// one (its gradient is then only the first two micro-steps'), and with 3 ranks. Prefetched
// gathers that were not needed next are dropped and the units gathered when used: the unsharded
// results, the same as on demand, and no rank waits on a collective the others did not issue.
TEST(Zero3Engine, BlocksOutOfThePredictedOrderAreGatheredOnDemand) {
    for (const bool checkpointing : {false, true}) {
        Case c{3, checkpointing, true};
        c.orders = {{}, {2, 0, 3, 1}, {0, 1, 3}, {3, 2, 1, 0}};
        c.prefetch = 0;
        const auto sync = check_case(c);
        c.prefetch = 1;
        const auto ahead = check_case(c);
        expect_identical(sync, ahead, "out of order");
        for (const auto& r : ahead) EXPECT_GT(r.prefetched, 0);
    }
}

// Parameter offload: the shards live in host memory (nothing on the device between steps), with
// and without prefetch and checkpointing; the same results bit for bit as shards on the device.
TEST(Zero3Engine, ParameterOffloadKeepsShardsOnTheHost) {
    for (const bool checkpointing : {false, true}) {
        Case c{2, checkpointing, true};
        const auto on_device = check_case(c);
        c.offload = true;
        expect_identical(on_device, check_case(c), "offload");
        c.prefetch = 0;
        expect_identical(on_device, check_case(c), "offload without prefetch");
    }
    Case kept{2, false, false};
    kept.offload = true;
    check_case(kept);
}

// ZeRO-1/2's deferred parameter sync (train/zero_sync.h) on the same stack, 3 Gloo ranks: each
// parameter's owner alone holds its new value (the others hold a stale -1). A training forward that
// starts with begin_forward() (blocks 0, 1 and 3 run, block 2 does not) leaves every parameter at
// its owner's value on every rank once wait_all() returns, and its output equals a second forward
// over the synced weights; flush() does the same with no forward. One grouped call per block plus
// one for the rest (on Gloo, one broadcast per tensor inside). Three layouts: owners interleaved
// (i % 3) broadcast per parameter, the same coalesced (no run has two parameters: nothing moves),
// and contiguous owners coalesced, where each run of one owner in a group is one flat buffer.
enum class SyncLayout { kInterleaved, kInterleavedCoalesced, kContiguousCoalesced };

struct SyncResult {
    std::size_t groups = 0, broadcasts = 0, collectives_per_sync = 0;
    double worst_after_forward = 0, worst_after_flush = 0, output_diff = 0;
    // Parameters whose data shares its storage with the parameter before it in the model, and
    // parameters whose data starts at an offset that is not a multiple of 256 bytes.
    int shared_with_previous = 0, misaligned = 0;
    bool gradients_ok = false;  // every parameter got a gradient of its shape from a backward
    // Coalesced: a parameter re-pointed out of its flat buffer makes the next sync fail, naming it.
    bool repoint_refused = false;
};

SyncResult run_sync_rank(int rank, int world, int port, SyncLayout layout) {
    auto group = test::loopback_group(rank, world, port);
    Stack model;
    const std::vector<at::Tensor> params = model->parameters();
    const auto n = static_cast<int>(params.size());
    std::vector<int> owners;
    owners.reserve(params.size());
    for (int i = 0; i < n; ++i)
        owners.push_back(layout == SyncLayout::kContiguousCoalesced ? i * world / n : i % world);
    train::DeferredParameterSync sync(*group, *model, params, owners, layout != SyncLayout::kInterleaved);
    SyncResult r;
    r.groups = sync.groups();
    r.broadcasts = sync.broadcasts();
    for (std::size_t i = 0; i < params.size(); ++i) {
        if (i > 0 && params[i].storage().is_alias_of(params[i - 1].storage())) ++r.shared_with_previous;
        if (params[i].storage_offset() * static_cast<int64_t>(params[i].element_size()) % 256 != 0)
            ++r.misaligned;
    }
    // Rank `owner`'s update of parameter i in round `round`; the other ranks hold -1.
    const auto value = [](std::size_t i, int round) { return 10.0 * round + static_cast<double>(i); };
    const auto update = [&](int round) {
        at::NoGradGuard no_grad;
        for (std::size_t i = 0; i < params.size(); ++i)
            params[i].fill_(owners[i] == rank ? value(i, round) : -1.0);
    };
    const auto worst = [&](int round) {
        double w = 0;
        for (std::size_t i = 0; i < params.size(); ++i)
            w = std::max(w, (params[i] - value(i, round)).abs().max().item<double>());
        return w;
    };
    update(1);
    const std::size_t before = group->collectives_issued();
    sync.begin_forward();
    r.collectives_per_sync = group->collectives_issued() - before;
    const at::Tensor x = batch_of(rank, 0) * 1e-3;
    at::Tensor out;
    {
        at::NoGradGuard no_grad;
        out = model->forward(x, false, {0, 1, 3});
    }
    sync.wait_all();
    r.worst_after_forward = worst(1);
    {
        at::NoGradGuard no_grad;
        r.output_diff = (model->forward(x, false, {0, 1, 3}) - out).abs().max().item<double>();
    }
    update(2);
    sync.flush();
    r.worst_after_flush = worst(2);
    model->forward(x, false, {0, 1, 2, 3}).sum().backward();
    r.gradients_ok = true;
    for (const auto& p : params)
        r.gradients_ok = r.gradients_ok && p.grad().defined() && p.grad().sizes() == p.sizes();
    if (layout == SyncLayout::kContiguousCoalesced) {
        {
            at::NoGradGuard no_grad;
            params[1].set_data(params[1].detach().clone());  // proj_in's bias leaves its run
        }
        try {
            sync.flush();  // refused on every rank before any collective is issued
        } catch (const std::exception& e) {
            r.repoint_refused =
                std::string(e.what()).find("no longer lives in its block's flat buffer") != std::string::npos;
        }
    }
    group->barrier();
    group->shutdown();
    return r;
}

TEST(DeferredParameterSync, OwnersValuesReachEveryRankBlockByBlock) {
    constexpr int kWorld = 3;
    constexpr int kParams = 4 * kBlocks + 4;  // a block: a and b, weight and bias; proj_in, proj_out
    for (const auto layout :
         {SyncLayout::kInterleaved, SyncLayout::kInterleavedCoalesced, SyncLayout::kContiguousCoalesced}) {
        SCOPED_TRACE(static_cast<int>(layout));
        const int port = test::free_port();
        std::vector<std::future<SyncResult>> ranks;
        ranks.reserve(kWorld);
        for (int r = 0; r < kWorld; ++r)
            ranks.push_back(std::async(std::launch::async,
                                       [r, port, layout] { return run_sync_rank(r, kWorld, port, layout); }));
        for (auto& f : ranks) {
            const SyncResult r = f.get();
            EXPECT_EQ(r.groups, static_cast<std::size_t>(kBlocks) + 1);  // the blocks, then proj_in/out
            EXPECT_EQ(r.collectives_per_sync, r.groups);                 // one grouped call per group
            EXPECT_EQ(r.worst_after_forward, 0.0);
            EXPECT_EQ(r.output_diff, 0.0);
            EXPECT_EQ(r.worst_after_flush, 0.0);
            EXPECT_TRUE(r.gradients_ok);
            EXPECT_EQ(r.misaligned, 0);
            if (layout != SyncLayout::kContiguousCoalesced) {
                EXPECT_EQ(r.broadcasts, static_cast<std::size_t>(kParams));
                EXPECT_EQ(r.shared_with_previous, 0);  // every parameter in its own storage
                continue;
            }
            // Owners by position (i * 3 / 20): parameters 0-6 rank 0, 7-13 rank 1, 14-19 rank 2. The
            // rest group is proj_in (0, 1) and proj_out (18, 19): 2 runs; block 0 (2-5): 1; block 1
            // (6 | 7-9): 2; block 2 (10-13): 1; block 3 (14-17): 1. Seven broadcasts, and 20 - 7
            // parameters share a run with the one before them in the model: 1, 3-5, 8-9, 11-13,
            // 15-17 and 19 (13 in all).
            EXPECT_EQ(r.broadcasts, 7u);
            EXPECT_EQ(r.shared_with_previous, 13);
            EXPECT_TRUE(r.repoint_refused);
        }
    }
}

}  // namespace
}  // namespace zero3_engine_test_local
}  // namespace dtune

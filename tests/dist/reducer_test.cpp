// The gradient reducer and the ZeRO-1/2 parameter sync (label unit): 2 or 3 real Gloo ranks on
// loopback, one thread each, in this process.
//  - gradients are views of persistent buckets: the same addresses every step, inside the bucket
//    the reducer all-reduces; an optimizer's set-to-none zero_grad is undone by zero_grad();
//  - a parameter unused on one rank is still averaged, unused on all ranks ends without a grad, and
//    the used counts are read back only by a rank that did not use every parameter;
//  - ZeRO-2: a rank keeps its own buckets and ends holding no other rank's gradient;
//  - a gradient accumulated twice in the armed backward is refused, micro-steps are not;
//  - sync_parameters issues one broadcast per sync bucket (counted by the group), far fewer than
//    one per parameter;
//  - ZeRO 0, 1 and 2 on 2 and 3 ranks, with gradient accumulation and overlap, train the weights
//    one process trains on the global batch, bit for bit.
//
// Why bit-exact equality with one process is expected: the model is a sum of linear maps with
// integer inputs and loss weights, so every per-rank gradient is an integer over a power of two
// (exact in float), their sum over ranks is exact in any order, and the mean over N ranks is a
// single rounding of the same real number as one process's division by N. A wrong, missing or
// doubled gradient shows up as a difference of whole learning-rate steps.
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <functional>
#include <future>
#include <numeric>
#include <thread>

#include "core/error.h"
#include "dist/group.h"
#include "dist/loopback_group.h"
#include "dist/reducer.h"
#include "support/shell.h"

namespace dtune::dist {
namespace reducer_test_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

// Runs fn(group) on `world` ranks, one thread each, and rethrows the first failure.
void on_ranks(int world, const std::function<void(Group&)>& fn) {
    const int port = test::free_port();
    GroupOptions options;
    options.collective_timeout = std::chrono::seconds(60);
    options.fault_poll_interval = std::chrono::milliseconds(0);  // no fault channel needed here
    std::vector<std::future<void>> ranks;
    for (int r = 0; r < world; ++r)
        ranks.push_back(std::async(std::launch::async, [&, r] {
            auto group = init_group(test::loopback_env(r, world, port), options);
            fn(*group);
            group->barrier();
        }));
    for (auto& f : ranks) f.get();
}

// Shapes of the toy model's parameters: weights [d_i, 3] of y = sum_i x_i W_i + b (one input per
// weight), then the bias.
const std::vector<std::vector<long>> kShapes{{4, 3}, {5, 3}, {1, 3}, {7, 3}, {2, 3}, {6, 3},
                                             {3, 3}, {8, 3}, {5, 3}, {2, 3}, {3}};

std::vector<at::Tensor> make_params() {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    std::vector<at::Tensor> out;
    for (const auto& s : kShapes) out.push_back(at::randn(s, gen).set_requires_grad(true));
    return out;
}

// Rows [first, first + rows) of step `step`'s global batch: integer inputs and loss weights.
struct Batch {
    std::vector<at::Tensor> x;  // [rows, d_i]
    at::Tensor c;               // [rows, 3]
};
Batch batch_rows(int step, long first, long rows, long total) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
    Batch b;
    for (std::size_t i = 0; i + 1 < kShapes.size(); ++i)
        b.x.push_back(
            at::randint(-3, 4, {total, kShapes[i][0]}, gen).to(at::kFloat).slice(0, first, first + rows));
    b.c = at::randint(-3, 4, {total, 3}, gen).to(at::kFloat).slice(0, first, first + rows);
    return b;
}

// (y * c).sum() / scale with y = sum_i x_i W_i + b; rows listed in `skip` leave W_skip out.
at::Tensor loss_of(const std::vector<at::Tensor>& p, const Batch& b, double scale, long skip = -1) {
    at::Tensor y = p.back().expand({b.c.size(0), 3});
    for (std::size_t i = 0; i + 1 < p.size(); ++i)
        if (static_cast<long>(i) != skip) y = y + at::matmul(b.x[i], p[i]);
    return (y * b.c).sum() / scale;
}

void sgd(const std::vector<at::Tensor>& params, const std::vector<std::size_t>& which) {
    at::NoGradGuard no_grad;
    for (std::size_t i : which)
        if (params[i].grad().defined()) params[i].sub_(params[i].grad() * 0.125);
}

constexpr int kSteps = 3, kAccum = 2;
constexpr long kRows = 2;  // per rank and micro-step (a power of two)

// One process on the global batch: integer gradient sums, divided by the world size once.
std::vector<at::Tensor> reference(int world) {
    auto p = make_params();
    std::vector<std::size_t> all(p.size());
    std::iota(all.begin(), all.end(), 0);
    const long total = kRows * world * kAccum;
    for (int step = 0; step < kSteps; ++step) {
        for (auto& t : p) t.mutable_grad() = at::Tensor();
        loss_of(p, batch_rows(step, 0, total, total), 1.0).backward();
        {
            at::NoGradGuard no_grad;
            for (auto& t : p) t.mutable_grad().div_(static_cast<double>(kRows * kAccum)).div_(world);
        }
        sgd(p, all);
    }
    return p;
}

// Data parallel with ZeRO `stage`: rank r takes rows [(micro * world + r) * kRows, +kRows).
// How backward's gradients reach the collective: in-place adds into the buckets, copy-in, direct.
enum class Handoff { kInPlace, kCopyIn, kDirect };

// ZeRO-2: `slots` staging slots for other ranks' buckets in the armed backward.
std::vector<at::Tensor> data_parallel(Group& g, int stage, bool overlap, Handoff handoff = Handoff::kInPlace,
                                      std::size_t slots = 4) {
    const int world = g.world_size();
    auto p = make_params();
    ZeroPartition partition(p, world, stage == 2 ? ZeroLayout::kContiguous : ZeroLayout::kGreedy);
    ReducerOptions options{64};  // bytes: several buckets
    options.staging_slots = slots;
    if (stage == 2) options.owners = partition.owners();
    GradReducer reducer(g, p, options);
    if (overlap) reducer.enable_overlap();
    reducer.set_copy_in(handoff == Handoff::kCopyIn);
    reducer.set_direct(handoff == Handoff::kDirect);
    std::vector<std::size_t> mine(p.size());
    std::iota(mine.begin(), mine.end(), 0);
    if (stage >= 1) mine = partition.owned_by(g.rank());
    const long total = kRows * world * kAccum;
    for (int step = 0; step < kSteps; ++step) {
        for (int micro = 0; micro < kAccum; ++micro) {
            const Batch b = batch_rows(step, (micro * world + g.rank()) * kRows, kRows, total);
            if (micro == kAccum - 1) reducer.arm();
            loss_of(p, b, static_cast<double>(kRows * kAccum)).backward();
        }
        reducer.reduce();
        for (std::size_t i = 0; i < p.size(); ++i)
            EXPECT_EQ(p[i].grad().defined(), stage < 2 || partition.owner(i) == g.rank())
                << "ZeRO " << stage << ", parameter #" << i << " on rank " << g.rank();
        sgd(p, mine);
        for (std::size_t i : mine) p[i].mutable_grad() = at::Tensor();  // as Optimizer::zero_grad does
        if (stage >= 1) partition.sync_parameters(g, p);
        reducer.zero_grad();
        if (handoff != Handoff::kInPlace && stage < 2) {  // no grads until backward makes them
            for (const auto& t : p) EXPECT_FALSE(t.grad().defined());
        }
    }
    return p;
}

TEST(GradReducerZero, ZeroStagesOnTwoAndThreeRanksEqualOneProcessBitForBit) {
    for (int world : {2, 3}) {
        const auto expected = reference(world);
        for (int stage : {0, 1, 2})
            for (bool overlap : {false, true}) {
                on_ranks(world, [&](Group& g) {
                    const auto got = data_parallel(g, stage, overlap);
                    for (std::size_t i = 0; i < got.size(); ++i)
                        EXPECT_TRUE(at::equal(got[i], expected[i]))
                            << world << " ranks, ZeRO " << stage << (overlap ? " overlap" : "")
                            << ": parameter #" << i << " on rank " << g.rank() << " differs by "
                            << (got[i] - expected[i]).abs().max().item<float>();
                });
            }
        // ZeRO-2 with one staging slot (each foreign bucket waits for the previous one's reduce, or
        // gets fresh memory while that one still fills) and with two.
        for (std::size_t slots : {1, 2})
            on_ranks(world, [&](Group& g) {
                const auto got = data_parallel(g, 2, true, Handoff::kInPlace, slots);
                for (std::size_t i = 0; i < got.size(); ++i)
                    EXPECT_TRUE(at::equal(got[i], expected[i]))
                        << world << " ranks, ZeRO 2 overlap, " << slots << " staging slots: parameter #" << i
                        << " on rank " << g.rank();
            });
        // Copy-in and direct (ZeRO-0/1; ZeRO-2 ignores them): autograd's gradients, summed over the
        // micro-steps by autograd, copied into the buckets at launch or all-reduced where they lie.
        for (Handoff handoff : {Handoff::kCopyIn, Handoff::kDirect})
            for (int stage : {0, 1, 2})
                for (bool overlap : {false, true})
                    on_ranks(world, [&](Group& g) {
                        const auto got = data_parallel(g, stage, overlap, handoff);
                        for (std::size_t i = 0; i < got.size(); ++i)
                            EXPECT_TRUE(at::equal(got[i], expected[i]))
                                << world << " ranks, ZeRO " << stage
                                << (handoff == Handoff::kDirect ? " direct" : " copy-in")
                                << (overlap ? " overlap" : "") << ": parameter #" << i << " on rank "
                                << g.rank();
                    });
        // The data matters: a single rank's share alone trains other weights.
        on_ranks(1, [&](Group& g) {
            const auto alone = data_parallel(g, 0, false);
            EXPECT_FALSE(at::equal(alone[0], expected[0]));
        });
    }
}

TEST(GradReducer, GradientsAreViewsOfPersistentBuckets) {
    on_ranks(2, [](Group& g) {
        auto p = make_params();
        GradReducer reducer(g, p, ReducerOptions{128});
        reducer.enable_overlap();
        ASSERT_TRUE(reducer.owns_gradients());
        ASSERT_GT(reducer.buckets().size(), 2u);
        // Where each grad lives in its bucket, checked against the flat tensor each step.
        auto expect_views = [&](const char* when) {
            for (std::size_t b = 0; b < reducer.buckets().size(); ++b) {
                const at::Tensor& flat = reducer.bucket_tensor(b);
                ASSERT_TRUE(flat.defined());
                const auto* base = static_cast<const char*>(flat.data_ptr());
                long offset = 0;
                for (std::size_t k : reducer.buckets()[b]) {
                    ASSERT_TRUE(p[k].grad().defined()) << when << ": parameter #" << k;
                    EXPECT_EQ(p[k].grad().data_ptr(), base + offset * flat.element_size())
                        << when << ": parameter #" << k << " is not a view of bucket " << b;
                    offset += p[k].numel();
                }
                EXPECT_EQ(flat.numel(), offset + static_cast<long>(reducer.buckets()[b].size()));
            }
        };
        expect_views("after construction");
        std::vector<const void*> first;
        for (const auto& t : p) first.push_back(t.grad().data_ptr());
        for (int step = 0; step < 3; ++step) {
            const Batch b = batch_rows(step, g.rank() * kRows, kRows, 2 * kRows);
            reducer.arm();
            loss_of(p, b, 1.0).backward();
            reducer.reduce();
            EXPECT_GT(reducer.overlapped_buckets(), 0u);
            EXPECT_EQ(reducer.host_reads(), 0u);  // every parameter used here: no read-back
            expect_views("after reduce");
            // The mean, computed here from both ranks' rows.
            const Batch whole = batch_rows(step, 0, 2 * kRows, 2 * kRows);
            auto q = make_params();
            loss_of(q, whole, 2.0).backward();
            for (std::size_t i = 0; i < p.size(); ++i)
                EXPECT_TRUE(at::allclose(p[i].grad(), q[i].grad(), 1e-6, 1e-6)) << "parameter #" << i;
            for (auto& t : p) t.mutable_grad() = at::Tensor();  // an optimizer's set-to-none
            reducer.zero_grad();
            expect_views("after zero_grad");
            for (std::size_t i = 0; i < p.size(); ++i) {
                EXPECT_EQ(p[i].grad().data_ptr(), first[i]) << "step " << step << ", parameter #" << i;
                EXPECT_EQ(p[i].grad().abs().sum().item<float>(), 0.0f);
            }
        }
        // The graphed step takes the gradients back: hooks and ownership go, and reduce() leaves
        // this rank's own gradients alone.
        reducer.release_gradients();
        EXPECT_FALSE(reducer.owns_gradients());
        for (auto& t : p) t.mutable_grad() = at::Tensor();
        const Batch own = batch_rows(0, g.rank() * kRows, kRows, 2 * kRows);
        reducer.arm();
        loss_of(p, own, 1.0).backward();
        reducer.reduce();
        auto q = make_params();
        loss_of(q, own, 1.0).backward();
        for (std::size_t i = 0; i < p.size(); ++i) EXPECT_TRUE(at::equal(p[i].grad(), q[i].grad()));
    });
}

class GradReducerHandoff : public ::testing::TestWithParam<bool> {};  // direct or the buckets

TEST_P(GradReducerHandoff, UnusedParametersAndTheOneReadBack) {
    const bool direct = GetParam();
    on_ranks(2, [direct](Group& g) {
        auto p = make_params();
        GradReducer reducer(g, p, ReducerOptions{96});
        reducer.enable_overlap();
        reducer.set_direct(direct);
        const Batch b = batch_rows(0, g.rank() * kRows, kRows, 2 * kRows);
        // W_0 unused on every rank; W_3 only on rank 1.
        reducer.arm();
        {
            at::Tensor y = p.back().expand({kRows, 3});
            for (std::size_t i = 1; i + 1 < p.size(); ++i)
                if (!(i == 3 && g.rank() == 0)) y = y + at::matmul(b.x[i], p[i]);
            (y * b.c).sum().backward();
        }
        reducer.reduce();
        EXPECT_FALSE(p[0].grad().defined()) << "unused on every rank, yet rank " << g.rank() << " has a grad";
        ASSERT_TRUE(p[3].grad().defined());
        // Both ranks hold rank 1's gradient / 2.
        const Batch rank1 = batch_rows(0, kRows, kRows, 2 * kRows);
        const at::Tensor expected = at::matmul(rank1.x[3].t(), rank1.c) / 2;
        EXPECT_TRUE(at::equal(p[3].grad(), expected)) << p[3].grad() << " vs " << expected;
        // Every rank skipped W_0, so every rank reads its counts back once; none per bucket.
        EXPECT_EQ(reducer.host_reads(), 1u);
        reducer.zero_grad();
        if (direct) {  // no buckets: no grads until the next backward makes them
            for (const auto& t : p) EXPECT_FALSE(t.grad().defined());
            for (std::size_t b = 0; b < reducer.buckets().size(); ++b)
                EXPECT_FALSE(reducer.bucket_tensor(b).defined()) << "bucket " << b;
            return;
        }
        ASSERT_TRUE(p[0].grad().defined());  // a view again, zeroed, for the next step
        EXPECT_EQ(p[0].grad().abs().sum().item<float>(), 0.0f);
    });
}
INSTANTIATE_TEST_SUITE_P(Reducer, GradReducerHandoff, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Direct" : "Buckets"; });

TEST(GradReducer, ZeroTwoKeepsOwnBucketsAndReleasesOthers) {
    on_ranks(2, [](Group& g) {
        auto p = make_params();
        ZeroPartition partition(p, 2, ZeroLayout::kContiguous);
        ReducerOptions options{64};
        options.owners = partition.owners();
        GradReducer reducer(g, p, options);
        reducer.enable_overlap();
        std::vector<const void*> own;
        for (int step = 0; step < 2; ++step) {
            reducer.arm();
            loss_of(p, batch_rows(step, g.rank() * kRows, kRows, 2 * kRows), 1.0).backward();
            reducer.reduce();
            std::vector<const void*> now;
            for (std::size_t i = 0; i < p.size(); ++i) {
                const bool mine = partition.owner(i) == g.rank();
                EXPECT_EQ(p[i].grad().defined(), mine) << "parameter #" << i << " on rank " << g.rank();
                if (mine) now.push_back(p[i].grad().data_ptr());
            }
            for (std::size_t b = 0; b < reducer.buckets().size(); ++b)
                EXPECT_EQ(reducer.bucket_tensor(b).defined(),
                          partition.owner(reducer.buckets()[b][0]) == g.rank());
            if (step > 0) {
                EXPECT_EQ(now, own) << "rank " << g.rank() << "'s buckets moved";
            }
            own = now;
            reducer.zero_grad();
        }
    });
}

// A chain x·W0·W1·…·W11 hands backward's gradients over in bucket order (W11 first), so each rank's
// six buckets of the other rank's weights pass through two staging slots: a slot is taken over from
// the earliest launched bucket once its reduce has finished, four times a step, the two slots are
// allocated once, and the owners' sums are those of one process over both ranks' rows.
TEST(GradReducer, ZeroTwoStagesOtherRanksBucketsInAFewSlots) {
    on_ranks(2, [](Group& g) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
        std::vector<at::Tensor> p;
        p.reserve(12);
        for (int i = 0; i < 12; ++i)
            p.push_back((at::eye(4) + 0.25 * at::randn({4, 4}, gen)).set_requires_grad(true));
        ZeroPartition partition(p, 2, ZeroLayout::kContiguous);
        ReducerOptions options{64};  // one 4x4 float32 weight per bucket
        options.owners = partition.owners();
        options.staging_slots = 2;
        GradReducer reducer(g, p, options);
        ASSERT_EQ(reducer.buckets().size(), p.size());
        reducer.enable_overlap();
        auto rows = [](int rank, int step) {
            auto r = at::make_generator<at::CPUGeneratorImpl>(20 + 2 * step + rank);
            return at::randint(-2, 3, {2, 4}, r).to(at::kFloat);
        };
        auto loss = [](const std::vector<at::Tensor>& w, const at::Tensor& x) {
            at::Tensor y = x;
            for (const auto& t : w) y = at::matmul(y, t);
            return y.sum();
        };
        for (int step = 0; step < 2; ++step) {
            reducer.arm();
            loss(p, rows(g.rank(), step)).backward();
            reducer.reduce();
            std::vector<at::Tensor> q;
            q.reserve(p.size());
            for (const auto& t : p) q.push_back(t.detach().clone().set_requires_grad(true));
            (loss(q, rows(0, step)) + loss(q, rows(1, step))).backward();
            for (std::size_t i = 0; i < p.size(); ++i) {
                const bool mine = partition.owner(i) == g.rank();
                ASSERT_EQ(p[i].grad().defined(), mine) << "weight " << i << " on rank " << g.rank();
                if (mine) {
                    EXPECT_TRUE(at::allclose(p[i].grad(), q[i].grad() / 2, 1e-5, 1e-5))
                        << "weight " << i << " on rank " << g.rank();
                }
            }
            EXPECT_EQ(reducer.released_early(), 4u) << "rank " << g.rank();
            EXPECT_EQ(reducer.staging_bytes(), 2u * (16 + 1) * sizeof(float)) << "rank " << g.rank();
            reducer.zero_grad();
        }
    });
}

// Two backward passes after arm() accumulate every gradient twice while its bucket may already be
// in flight: reduce() must refuse (after finishing the collectives, so the ranks stay in step), and
// the next round must work again.
TEST(GradReducer, GradientAccumulatedTwiceInTheArmedBackwardThrows) {
    on_ranks(2, [](Group& g) {
        auto p = make_params();
        GradReducer reducer(g, p, ReducerOptions{64});
        reducer.enable_overlap();
        const Batch b = batch_rows(0, g.rank() * kRows, kRows, 2 * kRows);
        reducer.arm();
        loss_of(p, b, 1.0).backward();
        loss_of(p, b, 1.0).backward();
        try {
            reducer.reduce();
            ADD_FAILURE() << "reduce() accepted gradients accumulated twice in the armed backward";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("accumulated twice"), std::string::npos) << e.what();
        }
        reducer.zero_grad();
        reducer.arm();
        loss_of(p, b, 1.0).backward();
        EXPECT_NO_THROW(reducer.reduce());
        // Without arm() the same two passes are ordinary accumulation (micro-steps).
        reducer.zero_grad();
        loss_of(p, b, 1.0).backward();
        loss_of(p, b, 1.0).backward();
        EXPECT_NO_THROW(reducer.reduce());
    });
}

// Many small parameters, greedily spread: the old sync issued one broadcast per parameter.
TEST(ZeroPartitionSync, FewBroadcastsAndOwnersValuesEverywhere) {
    for (int world : {2, 3}) {
        on_ranks(world, [world](Group& g) {
            std::vector<at::Tensor> p;
            for (int i = 0; i < 60; ++i) p.push_back(at::full({3 + i % 5, 2}, 0.0f));
            p.push_back(at::full({4, 4}, 0.0f).t());  // not contiguous: still bit-exact
            p.push_back(at::full({2}, 0.0, at::TensorOptions().dtype(at::kDouble)));  // another dtype
            ZeroPartition partition(p, world);
            for (std::size_t i = 0; i < p.size(); ++i)
                if (partition.owner(i) == g.rank()) p[i].fill_(static_cast<double>(i) + 0.1 * (g.rank() + 1));
            const std::size_t bucket_bytes = 480;  // ~12 of these parameters
            const auto buckets = partition.sync_buckets(p, bucket_bytes);
            // Every parameter once, each bucket of one owner.
            std::vector<int> seen(p.size(), 0);
            for (const auto& b : buckets)
                for (std::size_t k : b) {
                    ++seen[k];
                    EXPECT_EQ(partition.owner(k), partition.owner(b[0]));
                }
            EXPECT_EQ(seen, std::vector<int>(p.size(), 1));
            const std::size_t before = g.collectives_issued();
            partition.sync_parameters(g, p, bucket_bytes);
            const std::size_t issued = g.collectives_issued() - before;
            EXPECT_EQ(issued, buckets.size());
            EXPECT_LT(issued * 4, p.size())
                << world << " ranks: " << issued << " broadcasts for " << p.size() << " parameters";
            for (std::size_t i = 0; i < p.size(); ++i)
                EXPECT_TRUE(at::equal(
                    p[i], at::full_like(p[i], static_cast<double>(i) + 0.1 * (partition.owner(i) + 1))))
                    << "parameter #" << i << " on rank " << g.rank();
            // Default bucket size: one broadcast per owner and dtype.
            const std::size_t again = g.collectives_issued();
            partition.sync_parameters(g, p);
            EXPECT_LE(g.collectives_issued() - again, static_cast<std::size_t>(2 * world));
        });
    }
}

}  // namespace
}  // namespace reducer_test_local
}  // namespace dtune::dist

// Counter-based dropout (models/common/hash_dropout.h) on the CPU: the keep rate, the inverted-dropout
// scale, backward applying the forward's mask, masks that depend only on (seed value, salt, index)
// (so refreshing the seed in place changes them and the same value restores them), rank offsets
// that split one global batch, and the same mask for every dtype and memory layout rule.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/error.h"
#include "model_test_util.h"
#include "models/common/hash_dropout.h"

namespace dtune::models {
namespace {

at::Tensor seed_of(int64_t v) {
    return at::full({1}, v, at::kLong);
}

TEST(HashDropout, KeepsOneMinusPAndScalesTheKept) {
    const at::Tensor x = at::ones({1000, 1000});
    for (double p : {0.1, 0.5}) {
        const at::Tensor y = hash_dropout(x, seed_of(7), 3, p);
        const double kept = (y != 0).to(at::kDouble).mean().item<double>();
        EXPECT_NEAR(kept, 1 - p, 0.002) << "p " << p;  // 1e6 draws: sd 0.0005
        // Every kept element is exactly 1 / (1 - p) (float32 of it).
        const at::Tensor values = y.masked_select(y != 0);
        EXPECT_TRUE(at::all(values == static_cast<float>(1.0 / (1.0 - p))).item<bool>());
        // The mean is preserved (inverted dropout).
        EXPECT_NEAR(y.mean().item<double>(), 1.0, 0.005);
    }
    EXPECT_TRUE(at::equal(hash_dropout(x, seed_of(7), 3, 0.0), x));  // p 0: identity
}

TEST(HashDropout, BackwardUsesTheForwardMask) {
    const at::Tensor x = at::randn({4, 33, 17}).requires_grad_(true);
    const at::Tensor seed = seed_of(11);
    const at::Tensor y = hash_dropout(x, seed, 5, 0.3);
    y.backward(at::ones_like(y));
    const at::Tensor mask = (y != 0).to(at::kFloat);
    EXPECT_TRUE(at::allclose(x.grad(), mask / 0.7f));
    // The backward reads the seed tensor as it is when backward runs: within a step it is unchanged.
}

TEST(HashDropout, TheMaskIsAFunctionOfSeedValueSaltAndIndex) {
    const at::Tensor x = at::randn({8, 64});
    at::Tensor seed = seed_of(1);
    const at::Tensor a = hash_dropout(x, seed, 9, 0.5);
    EXPECT_TRUE(at::equal(a, hash_dropout(x, seed, 9, 0.5)));    // same seed: same mask
    EXPECT_FALSE(at::equal(a, hash_dropout(x, seed, 10, 0.5)));  // another layer (salt)
    seed.fill_(2);                                               // refreshed in place: new masks
    const at::Tensor b = hash_dropout(x, seed, 9, 0.5);
    EXPECT_FALSE(at::equal(a, b));
    seed.fill_(1);
    EXPECT_TRUE(at::equal(a, hash_dropout(x, seed, 9, 0.5)));
    // Masks of different seeds are independent: about half of the kept elements agree at p 0.5.
    const double both = ((a != 0) & (b != 0)).to(at::kDouble).mean().item<double>();
    EXPECT_NEAR(both, 0.25, 0.08);
}

TEST(HashDropout, RankOffsetsSplitTheGlobalBatch) {
    const at::Tensor x = at::randn({6, 5, 7});
    const at::Tensor seed = seed_of(42);
    const at::Tensor whole = hash_dropout(x, seed, 1, 0.4);
    const int64_t rows = 2, per_rank = rows * 5 * 7;
    for (int64_t r = 0; r < 3; ++r) {
        const at::Tensor part = hash_dropout(x.narrow(0, r * rows, rows), seed, 1, 0.4, r * per_rank);
        EXPECT_TRUE(at::equal(part, whole.narrow(0, r * rows, rows))) << "rank " << r;
    }
}

TEST(HashDropout, SameMaskInEveryDtypeAndKeepsTheLayout) {
    const at::Tensor x = at::rand({2, 8, 5, 5}) + 0.5;  // no zeros
    const at::Tensor seed = seed_of(3);
    const at::Tensor f = hash_dropout(x, seed, 2, 0.25);
    for (auto dtype : {at::kDouble, at::kBFloat16, at::kHalf}) {
        const at::Tensor y = hash_dropout(x.to(dtype), seed, 2, 0.25);
        EXPECT_EQ(y.scalar_type(), dtype);
        EXPECT_TRUE(at::equal(y != 0, f != 0)) << c10::toString(dtype);
    }
    // A channels-last input stays channels-last; the mask follows the physical order, and the
    // backward applies the forward's mask in that layout too.
    const at::Tensor cl = x.contiguous(at::MemoryFormat::ChannelsLast).requires_grad_(true);
    const at::Tensor y = hash_dropout(cl, seed, 2, 0.25);
    EXPECT_TRUE(y.is_contiguous(at::MemoryFormat::ChannelsLast));
    y.backward(at::ones_like(y));
    EXPECT_TRUE(at::equal(cl.grad() != 0, y != 0));
}

// One hash serves four neighbouring elements (hash_dropout_math.h): their decisions must still be
// independent, within a group (i, i + 1) as across groups (i, i + 4).
TEST(HashDropout, NeighbouringElementsAreKeptIndependently) {
    const at::Tensor kept = hash_dropout(at::ones({1 << 20}), seed_of(5), 4, 0.5) != 0;
    const int64_t n = kept.numel();
    for (int64_t gap : {1, 2, 3, 4, 5}) {
        const double both =
            (kept.narrow(0, 0, n - gap) & kept.narrow(0, gap, n - gap)).to(at::kDouble).mean().item<double>();
        EXPECT_NEAR(both, 0.25, 0.003) << "gap " << gap;  // ~1e6 pairs: sd 0.0004
    }
    // Lane by lane the keep rate is 1 - p (no lane of the hash is biased).
    const at::Tensor lanes = kept.view({-1, 4}).to(at::kDouble).mean(0);
    for (int64_t l = 0; l < 4; ++l) EXPECT_NEAR(lanes[l].item<double>(), 0.5, 0.004) << "lane " << l;
}

// hash_dropout_add_ adds the masked, scaled input into another tensor with the mask hash_dropout
// draws (float: the same sum exactly; bf16: rounded once instead of twice), at any index offset.
TEST(HashDropout, AddJoinsAnotherTensorWithTheSameMask) {
    const at::Tensor src = at::randn({5, 77}), base = at::randn({5, 77});
    const at::Tensor seed = seed_of(9);
    for (int64_t offset : {0, 3, 4001}) {
        at::Tensor dst = base.clone();
        hash_dropout_add_(dst, src, seed, 6, 0.3, offset);
        EXPECT_TRUE(at::equal(dst, base + hash_dropout_no_grad(src, seed, 6, 0.3, offset))) << offset;
        at::Tensor half = base.to(at::kBFloat16);
        hash_dropout_add_(half, src.to(at::kBFloat16), seed, 6, 0.3, offset);
        const at::Tensor exact =
            base.to(at::kBFloat16).to(at::kFloat) +
            hash_dropout_no_grad(src.to(at::kBFloat16).to(at::kFloat), seed, 6, 0.3, offset);
        EXPECT_TRUE(at::equal(half, exact.to(at::kBFloat16))) << offset;  // one rounding
    }
    at::Tensor dst = base.clone();
    hash_dropout_add_(dst, src, seed, 6, 0.0);  // p 0: a plain add
    EXPECT_TRUE(at::equal(dst, base + src));
    at::Tensor wrong = at::zeros({5, 76});
    EXPECT_THROW(hash_dropout_add_(wrong, src, seed, 6, 0.3), Error);
}

TEST(HashDropout, RefusesABadSeedOrP) {
    const at::Tensor x = at::ones({4});
    EXPECT_THROW(hash_dropout(x, at::zeros({1}), 0, 0.1), Error);             // float seed
    EXPECT_THROW(hash_dropout(x, at::zeros({2}, at::kLong), 0, 0.1), Error);  // two values
    EXPECT_THROW(hash_dropout(x, seed_of(1), 0, 1.0), Error);
}

}  // namespace
}  // namespace dtune::models

// Counter-based dropout (models/common/hash_dropout.h) on the CPU: the keep rate, the inverted-dropout
// scale, backward applying the forward's mask, masks that depend only on (seed value, salt, index)
// (so refreshing the seed in place changes them and the same value restores them), rank offsets
// that split one global batch, and the same mask for every dtype and memory layout rule; and LoRA's
// adapter products that read their input through the mask (common/lora_dropout.h).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "model_test_util.h"
#include "models/common/hash_dropout.h"
#include "models/common/lora_dropout.h"

namespace dtune::models {
namespace test_hash_dropout_unit_local {  // (named: unity builds merge files' anonymous namespaces)
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

// The mask as a float64 tensor of 0 and 1 / (1 - p), from hash_dropout itself.
at::Tensor lora_mask_of(at::IntArrayRef sizes, const LoRADropoutMask& m) {
    return hash_dropout_no_grad(at::ones(sizes, at::kDouble), m.seed, m.salt, m.p, m.index_offset);
}

double lora_tolerance(const at::Tensor& ref) {
    return 1e-5 * std::max(1.0, ref.abs().max().item<double>());
}

// LoRA's masked adapter products (common/lora_dropout.h) on the CPU, where they run the composite
// ops: each equals a float64 reference that applies the mask explicitly, at index offsets on and
// off the 4-element hash groups, for p 0.1 and 0.5, r 4 and 16, row counts that fill no tile, and
// gh / h given as column slices of wider matrices (the fused q/k/v path). The CUDA kernels are
// compared with the same references in test_models_gpu.cpp.
TEST(LoRADropoutUnit, ProductsMatchTheMaskedReference) {
    torch::manual_seed(8);
    for (const int64_t n : {37, 301})
        for (const int64_t r : {4, 16})
            for (const double p : {0.1, 0.5})
                for (const int64_t offset : {0, 4001, 123457}) {
                    SCOPED_TRACE(testing::Message()
                                 << "n " << n << " r " << r << " p " << p << " offset " << offset);
                    const int64_t k = 72;
                    const LoRADropoutMask m{at::full({1}, 31, at::kLong), 7, p, offset};
                    const at::Tensor x = at::randn({n, k}), a = at::randn({r, k}) * 0.1;
                    const at::Tensor mask = lora_mask_of({n, k}, m), xm = x.to(at::kDouble) * mask;
                    // The fused q/k/v path's operands: adapter 1 of 3 owns columns r .. 2r.
                    const at::Tensor gh_wide = at::randn({n, 3 * r}), gh = gh_wide.narrow(1, r, r);

                    const at::Tensor h_ref = at::mm(xm, a.to(at::kDouble).t());
                    const at::Tensor h = lora_masked_down(x, a, m);
                    EXPECT_EQ(h.sizes(), (at::IntArrayRef{n, r}));
                    EXPECT_LE(test::max_abs_diff(h.to(at::kDouble), h_ref), lora_tolerance(h_ref));
                    at::Tensor h_wide = at::zeros({n, 3 * r}), h_slice = h_wide.narrow(1, r, r);
                    lora_masked_down_out(h_slice, x, a, m);
                    EXPECT_LE(test::max_abs_diff(h_slice.to(at::kDouble), h_ref), lora_tolerance(h_ref));
                    EXPECT_EQ(h_wide.narrow(1, 0, r).abs().max().item<float>(), 0.0f);
                    EXPECT_EQ(h_wide.narrow(1, 2 * r, r).abs().max().item<float>(), 0.0f);

                    const at::Tensor da_ref = at::mm(gh.to(at::kDouble).t(), xm);
                    const at::Tensor da = lora_masked_down_grad(gh, x, m, at::kFloat);
                    EXPECT_EQ(da.scalar_type(), at::kFloat);
                    EXPECT_LE(test::max_abs_diff(da.to(at::kDouble), da_ref), lora_tolerance(da_ref));

                    const at::Tensor dx0 = at::randn({n, k});
                    const at::Tensor dx_ref =
                        dx0.to(at::kDouble) + mask * at::mm(gh.to(at::kDouble), a.to(at::kDouble));
                    at::Tensor dx = dx0.clone();
                    lora_masked_up_add_(dx, gh, a, m);
                    EXPECT_LE(test::max_abs_diff(dx.to(at::kDouble), dx_ref), lora_tolerance(dx_ref));
                    // The mask matters: without it the sums differ.
                    EXPECT_GT(test::max_abs_diff(h.to(at::kDouble), at::mm(x, a.t()).to(at::kDouble)), 1e-3);
                }
}

// bf16 operands: the factor gradient comes back in the factor's dtype (float32), and the masked
// elements are those hash_dropout drops in bf16 too.
TEST(LoRADropoutUnit, Bf16OperandsAndNoMask) {
    torch::manual_seed(9);
    const int64_t n = 45, k = 64, r = 8;
    const LoRADropoutMask m{at::full({1}, 5, at::kLong), 3, 0.1, 1};
    const at::Tensor x = at::randn({n, k}).to(at::kBFloat16), a = at::randn({r, k}).to(at::kBFloat16);
    const at::Tensor gh = at::randn({n, r}).to(at::kBFloat16);
    const at::Tensor xm = x.to(at::kDouble) * lora_mask_of({n, k}, m);
    const at::Tensor da = lora_masked_down_grad(gh, x, m, at::kFloat);
    EXPECT_EQ(da.scalar_type(), at::kFloat);
    const at::Tensor da_ref = at::mm(gh.to(at::kDouble).t(), xm);
    EXPECT_LE(test::max_abs_diff(da.to(at::kDouble), da_ref), 1e-2 * da_ref.abs().max().item<double>());
    const at::Tensor h = lora_masked_down(x, a, m);
    EXPECT_EQ(h.scalar_type(), at::kBFloat16);
    const at::Tensor h_ref = at::mm(xm, a.to(at::kDouble).t());
    EXPECT_LE(test::max_abs_diff(h.to(at::kDouble), h_ref), 1e-2 * h_ref.abs().max().item<double>());

    // No mask (undefined seed, or p 0): the plain products.
    for (const LoRADropoutMask& none : {LoRADropoutMask{}, LoRADropoutMask{m.seed, 3, 0.0, 1}}) {
        const at::Tensor xf = x.to(at::kFloat), af = a.to(at::kFloat), gf = gh.to(at::kFloat);
        EXPECT_TRUE(at::allclose(lora_masked_down(xf, af, none), at::mm(xf, af.t())));
        EXPECT_TRUE(at::allclose(lora_masked_down_grad(gf, xf, none, at::kFloat), at::mm(gf.t(), xf)));
        at::Tensor dx = at::zeros({n, k});
        lora_masked_up_add_(dx, gf, af, none);
        EXPECT_TRUE(at::allclose(dx, at::mm(gf, af)));
    }
}

// The group forms (fused q/k/v's backward): dx takes every adapter's masked product, an inactive mask
// giving the plain product, and each adapter's dA comes back in its dtype; on the CPU adapter by
// adapter, the same bits as the single forms. Shapes that do not split into adapters of one rank are
// refused, naming the shapes.
TEST(LoRADropoutUnit, GroupFormsMatchAdapterByAdapter) {
    torch::manual_seed(10);
    const int64_t n = 53, k = 40, r = 4;
    const at::Tensor a = at::randn({3 * r, k}) * 0.1, gh = at::randn({n, 3 * r}), dx0 = at::randn({n, k});
    const std::vector<LoRADropoutMask> masks{
        {at::full({1}, 31, at::kLong), 7, 0.1, 0}, {at::full({1}, 31, at::kLong), 8, 0.5, 11}, {}};
    at::Tensor dx = dx0.clone(), each = dx0.clone();
    lora_masked_up_add_group_(dx, gh, a, masks);
    at::Tensor ref = dx0.to(at::kDouble);
    for (int64_t i = 0; i < 3; ++i) {
        const at::Tensor gi = gh.narrow(1, i * r, r), ai = a.narrow(0, i * r, r);
        lora_masked_up_add_(each, gi, ai, masks[i]);
        const at::Tensor product = at::mm(gi.to(at::kDouble), ai.to(at::kDouble));
        ref += masks[i].seed.defined() ? lora_mask_of({n, k}, masks[i]) * product : product;
    }
    EXPECT_TRUE(at::equal(dx, each));
    EXPECT_LE(test::max_abs_diff(dx.to(at::kDouble), ref), lora_tolerance(ref));
    EXPECT_GT(test::max_abs_diff(dx.to(at::kDouble), dx0.to(at::kDouble) + at::mm(gh, a).to(at::kDouble)),
              1e-3)
        << "the masks matter";
    // The factor gradients of the group: each adapter's, bit for bit.
    const std::vector<at::Tensor> das =
        lora_masked_down_grad_group(gh, dx0, masks, {at::kFloat, at::kFloat, at::kDouble});
    ASSERT_EQ(das.size(), 3u);
    for (int64_t i = 0; i < 3; ++i)
        EXPECT_TRUE(at::equal(das[i], lora_masked_down_grad(gh.narrow(1, i * r, r), dx0, masks[i],
                                                            i == 2 ? at::kDouble : at::kFloat)));
    EXPECT_EQ(das[2].scalar_type(), at::kDouble);
    EXPECT_THROW(lora_masked_down_grad_group(gh, dx0, masks, {at::kFloat}), std::exception);
    at::Tensor bad = dx0.clone();
    EXPECT_THROW(
        {
            try {
                lora_masked_up_add_group_(bad, gh.narrow(1, 0, 3 * r - 1), a, masks);
            } catch (const std::exception& e) {
                EXPECT_NE(std::string(e.what()).find("do not hold 3 adapters"), std::string::npos)
                    << e.what();
                throw;
            }
        },
        std::exception);
}

TEST(LoRADropoutUnit, TheKernelsNeverTakeCpuTensors) {
    const at::Tensor x = at::randn({16, 64}), a = at::randn({4, 64});
    EXPECT_FALSE(lora_dropout_kernels_take(x, a));
    const LoRADropoutKernels was = lora_dropout_kernels_mode();
    set_lora_dropout_kernels(LoRADropoutKernels::kOff);
    EXPECT_FALSE(lora_dropout_kernels_enabled());
    set_lora_dropout_kernels(LoRADropoutKernels::kAll);
    EXPECT_FALSE(lora_dropout_kernels_take(x, a));
    set_lora_dropout_kernels(was);
}

}  // namespace
}  // namespace test_hash_dropout_unit_local
}  // namespace dtune::models

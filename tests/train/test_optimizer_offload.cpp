// CpuOffloadOptimizer (offload_optimizer_device cpu): the host optimizer's updates equal the same
// optimizer run on the parameters' device, its state lives in host memory with the same keys,
// resume through state_dict is exact, parameters without gradients are untouched and the wrapper's
// learning rate reaches the host. On the CPU and, where present, on a CUDA device.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include "train/optimizer.h"
#include "train/optimizer_offload.h"

namespace dtune::train {
namespace test_optimizer_offload_local {  // (named: unity builds merge files' anonymous namespaces)
namespace {

class CpuOffload : public ::testing::TestWithParam<c10::DeviceType> {
  protected:
    void SetUp() override {
        if (GetParam() == c10::kCUDA && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    }
    at::Device device() const {
        return GetParam() == c10::kCPU ? at::Device(at::kCPU) : at::Device(at::kCUDA, 0);
    }
};

const std::vector<std::string> kNames{"conv.weight", "conv.bias", "proj.weight"};
const std::vector<std::vector<int64_t>> kShapes{{4, 3, 3, 3}, {4}, {5, 7}};

std::vector<at::Tensor> make_params(const at::Device& device, at::ScalarType dtype) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
    std::vector<at::Tensor> out;
    for (const auto& s : kShapes) out.push_back(at::randn(s, gen).to(device, dtype).requires_grad_(true));
    return out;
}

// Step t's gradient of parameter i (deterministic, same on every device).
at::Tensor grad_of(int t, size_t i, const at::Tensor& like) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(100 * t + static_cast<uint64_t>(i));
    return (at::randn(like.sizes(), gen) * 0.1).to(like.device(), like.scalar_type());
}

void run_steps(Optimizer& opt, std::vector<at::Tensor>& params, int from, int to, bool skip_bias = false) {
    for (int t = from; t < to; ++t) {
        for (size_t i = 0; i < params.size(); ++i)
            params[i].mutable_grad() = (skip_bias && i == 1) ? at::Tensor() : grad_of(t, i, params[i]);
        opt.step();
        opt.zero_grad();
    }
}

std::vector<ParamGroup> groups_of(const std::vector<at::Tensor>& params, double lr) {
    return {ParamGroup{kNames, params, lr, 1e-2}};
}

std::unique_ptr<Optimizer> adamw(std::vector<ParamGroup> groups) {
    return std::make_unique<AdamW>(std::move(groups));
}

double max_diff(const at::Tensor& a, const at::Tensor& b) {
    return (a.detach().cpu().to(at::kDouble) - b.detach().cpu().to(at::kDouble)).abs().max().item<double>();
}

TEST_P(CpuOffload, AdamWOnTheHostEqualsAdamWOnTheDevice) {
    std::vector<at::Tensor> plain_params = make_params(device(), at::kFloat);
    std::vector<at::Tensor> off_params = make_params(device(), at::kFloat);
    AdamW plain(groups_of(plain_params, 1e-2));
    CpuOffloadOptimizer offloaded(groups_of(off_params, 1e-2), adamw);
    run_steps(plain, plain_params, 0, 4);
    run_steps(offloaded, off_params, 0, 4);
    // The same fused kernel on the CPU is bit-identical; a GPU's AdamW rounds differently.
    const double tol = device().is_cpu() ? 0.0 : 1e-6;
    for (size_t i = 0; i < plain_params.size(); ++i) {
        EXPECT_GT(max_diff(plain_params[i], make_params(device(), at::kFloat)[i]), 1e-3) << kNames[i];
        EXPECT_LE(max_diff(plain_params[i], off_params[i]), tol) << kNames[i];
        EXPECT_EQ(off_params[i].device(), device());
    }
    const TensorMap a = plain.state_dict(), b = offloaded.state_dict();
    ASSERT_EQ(a.size(), b.size());
    for (const auto& [key, value] : a) {
        ASSERT_TRUE(b.count(key)) << key;
        EXPECT_TRUE(b.at(key).device().is_cpu()) << key << ": the state must live in host memory";
        EXPECT_LE(max_diff(value, b.at(key)), device().is_cpu() ? 0.0 : 1e-6) << key;
    }
    EXPECT_GT(offloaded.host_copy_bytes(), 0);
}

TEST_P(CpuOffload, ResumeThroughStateDictIsExact) {
    std::vector<at::Tensor> straight_params = make_params(device(), at::kFloat);
    CpuOffloadOptimizer straight(groups_of(straight_params, 1e-2), adamw);
    run_steps(straight, straight_params, 0, 6);

    std::vector<at::Tensor> first_params = make_params(device(), at::kFloat);
    CpuOffloadOptimizer first(groups_of(first_params, 1e-2), adamw);
    run_steps(first, first_params, 0, 3);
    std::vector<at::Tensor> resumed_params;
    for (const auto& p : first_params) resumed_params.push_back(p.detach().clone().requires_grad_(true));
    CpuOffloadOptimizer resumed(groups_of(resumed_params, 1e-2), adamw);
    resumed.load_state_dict(first.state_dict());
    run_steps(resumed, resumed_params, 3, 6);
    for (size_t i = 0; i < straight_params.size(); ++i)
        EXPECT_TRUE(at::equal(straight_params[i], resumed_params[i])) << kNames[i];
}

TEST_P(CpuOffload, ParametersWithoutGradientAreUntouchedAndTheLrReachesTheHost) {
    std::vector<at::Tensor> params = make_params(device(), at::kFloat);
    const std::vector<at::Tensor> start = make_params(device(), at::kFloat);
    CpuOffloadOptimizer opt(groups_of(params, 1e-2), adamw);
    run_steps(opt, params, 0, 2, /*skip_bias=*/true);
    EXPECT_TRUE(at::equal(params[1], start[1]));
    EXPECT_FALSE(opt.state_dict().count("conv.bias.exp_avg"));
    EXPECT_GT(max_diff(params[0], start[0]), 1e-3);
    // lr 0 and no decay: AdamW leaves the weights as they are.
    opt.set_lr(0.0);
    opt.param_groups()[0].weight_decay = 0.0;
    std::vector<at::Tensor> before;
    for (const auto& p : params) before.push_back(p.detach().clone());
    run_steps(opt, params, 2, 3);
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i], before[i])) << kNames[i];
}

// adamw_bf16 on the host: bf16 weights, a CPU generator for its rounding; equal to the same
// optimizer with the same seed on CPU parameters.
TEST_P(CpuOffload, AdamWBF16OnTheHostEqualsItsCpuRun) {
    std::vector<at::Tensor> cpu_params = make_params(at::kCPU, at::kBFloat16);
    std::vector<at::Tensor> off_params = make_params(device(), at::kBFloat16);
    AdamWBF16 plain(groups_of(cpu_params, 1e-2), at::make_generator<at::CPUGeneratorImpl>(5));
    CpuOffloadOptimizer offloaded(groups_of(off_params, 1e-2), [](std::vector<ParamGroup> g) {
        return std::make_unique<AdamWBF16>(std::move(g), at::make_generator<at::CPUGeneratorImpl>(5));
    });
    run_steps(plain, cpu_params, 0, 3);
    run_steps(offloaded, off_params, 0, 3);
    for (size_t i = 0; i < cpu_params.size(); ++i) {
        EXPECT_EQ(off_params[i].scalar_type(), at::kBFloat16);
        EXPECT_TRUE(at::equal(cpu_params[i], off_params[i].cpu())) << kNames[i];
    }
    EXPECT_EQ(std::string(offloaded.name()), "adamw_bf16 (state offloaded to the CPU)");
}

INSTANTIATE_TEST_SUITE_P(Devices, CpuOffload, ::testing::Values(c10::kCPU, c10::kCUDA),
                         [](const ::testing::TestParamInfo<c10::DeviceType>& info) {
                             return info.param == c10::kCPU ? std::string("Cpu") : std::string("Cuda");
                         });

}  // namespace
}  // namespace test_optimizer_offload_local
}  // namespace dtune::train

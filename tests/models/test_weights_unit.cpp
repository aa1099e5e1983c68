#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "core/error.h"
#include "models/common/weights.h"
#include "support/test_support.h"

namespace dtune::models {
namespace {

struct TinyImpl : torch::nn::Module {
    TinyImpl() {
        proj = register_module("proj", torch::nn::Linear(3, 2));
        norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({2})));
    }
    torch::nn::Linear proj{nullptr};
    torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Tiny);

}  // namespace

TEST(Weights, SaveThenLoadRestoresEveryTensor) {
    test::TempDir dir;
    Tiny a, b;
    io::save_safetensors(dir / "w.safetensors", state_dict(*a));
    auto report = load_weights(*b, io::WeightSource::open(dir / "w.safetensors"), {}, "Tiny");
    EXPECT_EQ(report.loaded, 4u);
    EXPECT_TRUE(at::equal(a->proj->weight, b->proj->weight));
    EXPECT_TRUE(at::equal(a->norm->bias, b->norm->bias));
}

TEST(Weights, PrefixRenameAndDTypeConversion) {
    test::TempDir dir;
    Tiny a, b;
    io::TensorList prefixed;
    for (auto& [k, v] : state_dict(*a)) prefixed.emplace_back("model.unet." + k, v);
    prefixed.emplace_back("first_stage_model.other", at::ones({1}));
    io::save_safetensors(dir / "single.safetensors", prefixed);
    LoadOptions opts;
    opts.prefix = "model.unet.";
    opts.dtype = at::kBFloat16;
    load_weights(*b, io::WeightSource::open(dir / "single.safetensors"), opts, "Tiny");
    EXPECT_EQ(b->proj->weight.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::equal(b->proj->weight, a->proj->weight.to(at::kBFloat16)));
}

TEST(Weights, MismatchesAreListed) {
    test::TempDir dir;
    Tiny a, b;
    auto sd = state_dict(*a);
    sd.erase(sd.begin());                          // drop proj.weight
    sd.emplace_back("proj.extra", at::ones({1}));  // add an unknown key
    io::save_safetensors(dir / "bad.safetensors", sd);
    try {
        load_weights(*b, io::WeightSource::open(dir / "bad.safetensors"), {}, "Tiny from test");
        FAIL();
    } catch (const DataError& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("Tiny from test"), std::string::npos) << msg;
        EXPECT_NE(msg.find("missing:\n    proj.weight"), std::string::npos) << msg;
        EXPECT_NE(msg.find("unexpected:\n    proj.extra"), std::string::npos) << msg;
    }
    LoadOptions lenient;
    lenient.strict = false;
    auto report = load_weights(*b, io::WeightSource::open(dir / "bad.safetensors"), lenient, "Tiny");
    EXPECT_EQ(report.missing, std::vector<std::string>{"proj.weight"});

    io::save_safetensors(dir / "shape.safetensors", {{"proj.weight", at::ones({5, 5})}});
    EXPECT_THROW(load_weights(*b, io::WeightSource::open(dir / "shape.safetensors"), lenient, "Tiny"),
                 DataError);
}

// A NaN or an infinity in a weight only ever gives NaN outputs (`dtune sample` wrote a black PNG
// with exit code 0): loading refuses it, naming the component, the file and the tensor.
TEST(Weights, NonFiniteTensorsAreRefusedByName) {
    test::TempDir dir;
    for (const double bad : {std::nan(""), HUGE_VAL, -HUGE_VAL}) {
        Tiny a, b;
        auto sd = state_dict(*a);
        sd[2].second = sd[2].second.clone();  // norm.weight (the order of state_dict)
        sd[2].second.view(-1)[1] = bad;
        io::save_safetensors(dir / "nan.safetensors", sd);
        try {
            load_weights(*b, io::WeightSource::open(dir / "nan.safetensors"), {}, "Tiny from test");
            ADD_FAILURE() << "a weight holding " << bad << " was loaded";
        } catch (const DataError& e) {
            const std::string msg = e.what();
            EXPECT_NE(msg.find("Tiny from test: tensor '" + sd[2].first + "'"), std::string::npos) << msg;
            EXPECT_NE(msg.find((dir / "nan.safetensors").string()), std::string::npos) << msg;
            EXPECT_NE(msg.find("NaN or infinite"), std::string::npos) << msg;
        }
    }
}

}  // namespace dtune::models

// CLIP text encoders and SDXL prompt encoding against transformers/diffusers outputs for the tiny
// fixture pipeline (reference/text_encoders_io.safetensors, encode_prompt_io.safetensors):
// float32 CPU, max abs error <= 1e-4.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>

#include "core/error.h"
#include "io/ldm_keys.h"
#include "io/safetensors.h"
#include "models/clip/sdxl_text_encoders.h"
#include "models/common/pipeline_folder.h"
#include "support/test_support.h"

namespace dtune::models {
namespace {

constexpr double kTol = 1e-4;

double max_abs(const at::Tensor& a, const at::Tensor& b) {
    EXPECT_EQ(a.sizes(), b.sizes());
    if (a.sizes() != b.sizes()) return 1e9;
    const double err = (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>();
    std::printf("max abs error %.3g over %s\n", err, c10::str(a.sizes()).c_str());  // for the issue note
    return err;
}

io::SafetensorsFile reference(const std::string& name) {
    return io::SafetensorsFile(test::fixtures_dir() / "reference" / name);
}

SDXLTextEncoders& encoders() {
    static SDXLTextEncoders e =
        SDXLTextEncoders::load(PipelineFolder::open(test::fixtures_dir() / "tiny-sdxl"));
    return e;
}

}  // namespace

TEST(CLIPTextParity, TextEncoder1MatchesTransformers) {
    const auto ref = reference("text_encoders_io.safetensors");
    torch::NoGradGuard no_grad;
    const CLIPTextOutput out = encoders().text_encoder->forward(ref.get("input_ids"));
    EXPECT_LE(max_abs(out.last_hidden_state, ref.get("te1_last_hidden_state")), kTol);
    EXPECT_LE(max_abs(out.hidden_states.end()[-2], ref.get("te1_penultimate")), kTol);
    EXPECT_LE(max_abs(out.pooler_output, ref.get("te1_pooler_output")), kTol);
    EXPECT_EQ(out.hidden_states.size(), 6u);  // embeddings + 5 layers
}

TEST(CLIPTextParity, TextEncoder2MatchesTransformers) {
    const auto ref = reference("text_encoders_io.safetensors");
    torch::NoGradGuard no_grad;
    const CLIPTextOutput out = encoders().text_encoder_2->forward(ref.get("input_ids_2"));
    EXPECT_LE(max_abs(out.last_hidden_state, ref.get("te2_last_hidden_state")), kTol);
    EXPECT_LE(max_abs(out.hidden_states.end()[-2], ref.get("te2_penultimate")), kTol);
    EXPECT_LE(max_abs(out.text_embeds, ref.get("te2_text_embeds")), kTol);
    // Only the last two hidden states kept: same penultimate.
    const CLIPTextOutput lean = encoders().text_encoder_2->forward(ref.get("input_ids_2"), false);
    ASSERT_EQ(lean.hidden_states.size(), 2u);
    EXPECT_LE(max_abs(lean.hidden_states[0], ref.get("te2_penultimate")), kTol);
}

TEST(CLIPTextParity, TokenizerIdsAreTheReferenceInputs) {
    const auto ref = reference("text_encoders_io.safetensors");
    const at::Tensor ids = ref.get("input_ids"), ids2 = ref.get("input_ids_2");
    const std::vector<std::string> prompts = {"a photo of a cat",
                                              "pseudo-camera-10k, dslr, 35mm, bokeh, golden hour"};
    for (int64_t i = 0; i < 2; ++i) {
        const auto a = encoders().tokenizer.encode(prompts[static_cast<std::size_t>(i)]);
        const auto b = encoders().tokenizer_2.encode(prompts[static_cast<std::size_t>(i)]);
        EXPECT_TRUE(at::equal(at::tensor(a, at::kLong), ids[i].to(at::kLong)));
        EXPECT_TRUE(at::equal(at::tensor(b, at::kLong), ids2[i].to(at::kLong)));
    }
}

TEST(SDXLEncodePromptParity, MatchesDiffusers) {
    const auto ref = reference("encode_prompt_io.safetensors");
    SDXLEncodeOptions opts;
    opts.negative_prompt = std::vector<std::string>{"", "blurry"};
    const SDXLPromptEmbeds e = encoders().encode_prompt(
        {"a photo of a cat", "pseudo-camera-10k, dslr, 35mm, bokeh, golden hour"}, opts);
    EXPECT_LE(max_abs(e.prompt_embeds, ref.get("prompt_embeds")), kTol);
    EXPECT_LE(max_abs(e.pooled_prompt_embeds, ref.get("pooled_prompt_embeds")), kTol);
    EXPECT_LE(max_abs(e.negative_prompt_embeds, ref.get("negative_prompt_embeds")), kTol);
    EXPECT_LE(max_abs(e.negative_pooled_prompt_embeds, ref.get("negative_pooled_prompt_embeds")), kTol);
    EXPECT_FALSE(e.prompt_embeds.requires_grad());
}

TEST(SDXLEncodePromptParity, MissingNegativeIsZeroedWhenForced) {
    const auto ref = reference("encode_prompt_io.safetensors");
    const SDXLPromptEmbeds e = encoders().encode_prompt({"a photo of a cat"});
    ASSERT_TRUE(encoders().force_zeros_for_empty_prompt);  // model_index.json says true
    EXPECT_LE(max_abs(e.prompt_embeds, ref.get("prompt_embeds").slice(0, 0, 1)), kTol);
    EXPECT_EQ(e.negative_prompt_embeds.sizes(), e.prompt_embeds.sizes());
    EXPECT_EQ(e.negative_prompt_embeds.abs().max().item<double>(), 0.0);
    EXPECT_EQ(e.negative_pooled_prompt_embeds.abs().max().item<double>(), 0.0);
}

TEST(SDXLEncodePromptParity, MissingNegativeIsEncodedAsEmptyWhenNotForced) {
    const auto ref = reference("encode_prompt_io.safetensors");
    SDXLTextEncoders& enc = encoders();
    enc.force_zeros_for_empty_prompt = false;
    const SDXLPromptEmbeds e = enc.encode_prompt({"a photo of a cat"});
    enc.force_zeros_for_empty_prompt = true;
    // The reference's first negative is "", so it is what an unforced missing negative encodes to.
    EXPECT_LE(max_abs(e.negative_prompt_embeds, ref.get("negative_prompt_embeds").slice(0, 0, 1)), kTol);
    EXPECT_LE(
        max_abs(e.negative_pooled_prompt_embeds, ref.get("negative_pooled_prompt_embeds").slice(0, 0, 1)),
        kTol);
}

TEST(SDXLEncodePromptParity, ImagesPerPromptRepeatsRowsInOrder) {
    const auto ref = reference("encode_prompt_io.safetensors");
    SDXLEncodeOptions opts;
    opts.num_images_per_prompt = 2;
    opts.do_classifier_free_guidance = false;
    const SDXLPromptEmbeds e = encoders().encode_prompt(
        {"a photo of a cat", "pseudo-camera-10k, dslr, 35mm, bokeh, golden hour"}, opts);
    ASSERT_EQ(e.prompt_embeds.size(0), 4);
    EXPECT_FALSE(e.negative_prompt_embeds.defined());
    const at::Tensor expected = ref.get("prompt_embeds").index_select(0, at::tensor({0, 0, 1, 1}, at::kLong));
    EXPECT_LE(max_abs(e.prompt_embeds, expected), kTol);
}

TEST(SDXLEncodePromptParity, ChunkedLongPromptFirstWindowEqualsTruncated) {
    // For a prompt longer than 75 tokens, chunk 0 is the truncated encoding, so the first 77
    // positions must equal the ordinary output; a short prompt gives exactly one chunk. The two
    // runs encode batches of different sizes, so BLAS may block the GEMMs differently: the bound is
    // float rounding (1e-6 failed on a CPU without AVX-512 kernels), far below a wrong window.
    std::string text = "a";
    for (int i = 0; i < 40; ++i) text += " very long prompt";
    SDXLEncodeOptions chunked;
    chunked.chunked_long_prompts = true;
    chunked.do_classifier_free_guidance = true;
    chunked.negative_prompt = std::vector<std::string>{"blurry"};
    const SDXLPromptEmbeds c = encoders().encode_prompt({text}, chunked);
    SDXLEncodeOptions plain;
    plain.negative_prompt = std::vector<std::string>{"blurry"};
    const SDXLPromptEmbeds p = encoders().encode_prompt({text}, plain);
    ASSERT_EQ(c.prompt_embeds.size(1), 77 * 2);  // 121 tokens -> 2 chunks
    EXPECT_EQ(c.negative_prompt_embeds.sizes(), c.prompt_embeds.sizes());
    constexpr double kRounding = 1e-5;
    EXPECT_LE(max_abs(c.prompt_embeds.slice(1, 0, 77), p.prompt_embeds), kRounding);
    EXPECT_LE(max_abs(c.negative_prompt_embeds.slice(1, 0, 77), p.negative_prompt_embeds), kRounding);
    EXPECT_LE(max_abs(c.pooled_prompt_embeds, p.pooled_prompt_embeds), kRounding);
    chunked.max_chunks = 1;
    EXPECT_EQ(encoders().encode_prompt({text}, chunked).prompt_embeds.size(1), 77);
}

}  // namespace dtune::models

namespace dtune::models {

TEST(SDXLSingleFileParity, TextEncodersFromConvertedSingleFileMatchDiffusers) {
    // The tiny pipeline's text encoders written in the ldm single-file layout by io/ldm_keys, then
    // loaded back through the single-file path: encode_prompt must still match the reference.
    test::TempDir dir;
    const auto root = test::fixtures_dir() / "tiny-sdxl";
    io::TensorList single;
    for (const auto& [folder, kind] : {std::pair{"text_encoder", io::LdmComponent::kTextEncoder},
                                       std::pair{"text_encoder_2", io::LdmComponent::kTextEncoder2}}) {
        const auto src = io::WeightSource::open(root / folder / "model.safetensors");
        io::TensorList tensors;
        for (const auto& k : src.keys()) tensors.emplace_back(k, src.get(k));
        for (auto& kv : io::diffusers_to_ldm(tensors, kind)) single.push_back(std::move(kv));
    }
    io::save_safetensors(dir / "sdxl.safetensors", single);
    SDXLTextEncoders enc =
        SDXLTextEncoders::load_single_file(dir / "sdxl.safetensors", PipelineFolder::open(root));
    const auto ref = reference("encode_prompt_io.safetensors");
    SDXLEncodeOptions opts;
    opts.negative_prompt = std::vector<std::string>{"", "blurry"};
    const SDXLPromptEmbeds e =
        enc.encode_prompt({"a photo of a cat", "pseudo-camera-10k, dslr, 35mm, bokeh, golden hour"}, opts);
    EXPECT_LE(max_abs(e.prompt_embeds, ref.get("prompt_embeds")), kTol);
    EXPECT_LE(max_abs(e.pooled_prompt_embeds, ref.get("pooled_prompt_embeds")), kTol);
    EXPECT_LE(max_abs(e.negative_prompt_embeds, ref.get("negative_prompt_embeds")), kTol);

    // A checkpoint lacking one tensor is refused with a listing.
    single.erase(single.begin());
    io::save_safetensors(dir / "bad.safetensors", single);
    try {
        SDXLTextEncoders::load_single_file(dir / "bad.safetensors", PipelineFolder::open(root));
        FAIL() << "a checkpoint with a missing tensor loaded";
    } catch (const DataError& err) {
        EXPECT_NE(std::string(err.what()).find("missing"), std::string::npos) << err.what();
    }
}

TEST(SDXLEncodePromptParity, Bfloat16EncodersStayCloseToFloat32Reference) {
    TextEncoderLoadOptions bf16;
    bf16.dtype = at::kBFloat16;
    SDXLTextEncoders enc =
        SDXLTextEncoders::load(PipelineFolder::open(test::fixtures_dir() / "tiny-sdxl"), bf16);
    const auto ref = reference("encode_prompt_io.safetensors");
    SDXLEncodeOptions opts;
    opts.negative_prompt = std::vector<std::string>{"", "blurry"};
    const SDXLPromptEmbeds e =
        enc.encode_prompt({"a photo of a cat", "pseudo-camera-10k, dslr, 35mm, bokeh, golden hour"}, opts);
    EXPECT_EQ(e.prompt_embeds.scalar_type(), at::kBFloat16);
    // bf16 keeps ~3 significant digits (eps 2^-8); through 5 residual layers the error stays within
    // 3% of the largest reference magnitude (the penultimate states reach ~8, pooled ~2).
    const at::Tensor pe = ref.get("prompt_embeds"), pp = ref.get("pooled_prompt_embeds");
    EXPECT_LE(max_abs(e.prompt_embeds, pe), 0.03 * pe.abs().max().item<double>());
    EXPECT_LE(max_abs(e.pooled_prompt_embeds, pp), 0.03 * pp.abs().max().item<double>());
}

}  // namespace dtune::models

namespace dtune::models {

TEST(SDXLEncodePromptParity, CudaFloat32AndBfloat16MatchReference) {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
    const auto folder = PipelineFolder::open(test::fixtures_dir() / "tiny-sdxl");
    const auto ref = reference("encode_prompt_io.safetensors");
    const at::Tensor pe = ref.get("prompt_embeds"), pp = ref.get("pooled_prompt_embeds");
    SDXLEncodeOptions opts;
    opts.negative_prompt = std::vector<std::string>{"", "blurry"};
    const std::vector<std::string> prompts = {"a photo of a cat",
                                              "pseudo-camera-10k, dslr, 35mm, bokeh, golden hour"};
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
        TextEncoderLoadOptions load;
        load.dtype = dtype;
        load.device = c10::Device(c10::kCUDA);
        SDXLTextEncoders enc = SDXLTextEncoders::load(folder, load);
        const SDXLPromptEmbeds e = enc.encode_prompt(prompts, opts);
        ASSERT_TRUE(e.prompt_embeds.is_cuda());
        EXPECT_EQ(e.prompt_embeds.scalar_type(), dtype);
        // fp32 on the GPU differs from the CPU only by summation order; bf16 as on the CPU test.
        const double tol = dtype == at::kFloat ? 1e-4 : 0.03;
        const double scale_pe = dtype == at::kFloat ? 1.0 : pe.abs().max().item<double>();
        const double scale_pp = dtype == at::kFloat ? 1.0 : pp.abs().max().item<double>();
        EXPECT_LE(max_abs(e.prompt_embeds.cpu(), pe), tol * scale_pe);
        EXPECT_LE(max_abs(e.pooled_prompt_embeds.cpu(), pp), tol * scale_pp);
        EXPECT_LE(max_abs(e.negative_prompt_embeds.cpu(), ref.get("negative_prompt_embeds")), tol * scale_pe);
    }
}

}  // namespace dtune::models

namespace dtune::models {

TEST(SDXLEncodePromptParity, ClipSkipTakesAnEarlierLayer) {
    // diffusers: clip_skip k uses hidden_states[-(k + 2)] of both encoders.
    const auto ref = reference("text_encoders_io.safetensors");
    SDXLEncodeOptions opts;
    opts.clip_skip = 1;
    opts.do_classifier_free_guidance = false;
    const SDXLPromptEmbeds e = encoders().encode_prompt(
        {"a photo of a cat", "pseudo-camera-10k, dslr, 35mm, bokeh, golden hour"}, opts);
    torch::NoGradGuard no_grad;
    const auto h1 = encoders().text_encoder->forward(ref.get("input_ids")).hidden_states;
    const auto h2 = encoders().text_encoder_2->forward(ref.get("input_ids_2")).hidden_states;
    EXPECT_LE(max_abs(e.prompt_embeds, at::cat({h1.end()[-3], h2.end()[-3]}, -1)), 1e-6);
    // ...and really differs from the default penultimate layer.
    EXPECT_GT(max_abs(e.prompt_embeds, at::cat({h1.end()[-2], h2.end()[-2]}, -1)), 1e-2);
    opts.clip_skip = 5;  // the tiny encoders have 5 layers
    EXPECT_THROW(encoders().encode_prompt({"x"}, opts), UsageError);
}

}  // namespace dtune::models

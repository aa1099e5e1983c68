#!/usr/bin/env python3
"""Writes a FLUX.1-dev-shaped diffusers pipeline folder with random weights (issue #21's full-size
parity and timing runs: tools/gpu/flux_parity.sh). Nothing is downloaded.

Components, with black-forest-labs/FLUX.1-dev's configs (model_index.json, transformer/, vae/,
text_encoder/, text_encoder_2/, scheduler/ as published; the transformer's sizes are also diffusers'
FluxTransformer2DModel defaults and the VAE's scale/shift those diffusers documents for Flux):
  transformer     FluxTransformer2DModel: 19 double + 38 single blocks, 24 heads x 128, joint_attention_dim
                  4096, pooled 768, guidance_embeds, axes_dims_rope [16, 56, 56], in_channels 64 (11.9 B)
  text_encoder    CLIPTextModel (CLIP ViT-L/14's text tower: 768 wide, 12 layers, projection_dim 768)
  text_encoder_2  T5EncoderModel (T5 v1.1 XXL: d_model 4096, d_ff 10240, 24 layers, 64 heads x 64,
                  vocab 32128, gated-gelu, relative attention 32 buckets / distance 128) (4.76 B)
  vae             AutoencoderKL, 16 latent channels, [128, 256, 512, 512], scaling 0.3611, shift 0.1159,
                  no quant convs
  scheduler       FlowMatchEulerDiscreteScheduler, shift 3, dynamic shifting 0.5..1.15 over 256..4096 tokens
  tokenizer       CLIP's BPE files (vocab.json, merges.txt: the full 49408-token vocabulary) copied from the
                  shared fixtures' tiny-sdxl/tokenizer
  tokenizer_2     a small SentencePiece unigram model copied from tests/data/ref/tiny-t5-tokenizer (500 ids,
                  all below T5's 32128; both libraries read the same files, so the ids agree)

Weights: each component is built on --device under torch.manual_seed(seed + k) in float32, then cast to
--dtype and saved sharded (save_pretrained; the transformer in 10 GB shards and T5 in 5 GB shards as in
the published repository). CLIP, T5 and the VAE keep their library's own initialisation (transformers'
_init_weights, PyTorch's default Conv init). The transformer gets init_flux_transformer_ (below): with
PyTorch's default Linear init its 57 blocks add ~1% to the residual stream, so a wrong attention in dtune
would hardly move the image. Measured on the CPU at full width and depth (256 image + 64 text tokens,
float32): the residual stream grows from rms 1.1 to 3.4 over the 57 blocks, the output has rms ~1.05
(max 4.4) at t = 1 and 0.3, a relative input change comes out 0.68x as large (rounding differences
shrink through a step rather than grow), another text context moves the output by 12%, another pooled
vector by >100%, permuted positions (RoPE) by 19%. The default-init VAE decodes N(0, 1) latents to
rms 0.35 in [-1, 1] (pixel std ~45). --check repeats a forward of each on the device. On a GPU the
full-size build takes about a minute plus the disk writes: bf16 needs ~34 GB of disk (float32, 67 GB).

--tiny swaps in toy sizes (same structure, 8x VAE, the same tokenizers) to test the tooling on a CPU; it
also shards the transformer and T5 into small files so sharded loading is exercised.

Usage:
  python3 tools/ref/make_random_flux_pipeline.py OUT [--tiny] [--device cuda|cpu] [--seed 0]
      [--dtype bf16|fp32] [--fixtures ../shared/fixtures] [--t5-tokenizer tests/data/ref/tiny-t5-tokenizer]
      [--no-check]
Prints one JSON line: seconds per component, parameter counts and the --check statistics.
"""
import argparse
import json
import os
import shutil
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# black-forest-labs/FLUX.1-dev's configs (diffusers / transformers keys).
TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                   num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                   axes_dims_rope=(16, 56, 56))
VAE = dict(in_channels=3, out_channels=3, latent_channels=16, down_block_types=("DownEncoderBlock2D",) * 4,
           up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
           norm_num_groups=32, act_fn="silu", sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
           use_quant_conv=False, use_post_quant_conv=False, force_upcast=True, mid_block_add_attention=True)
CLIP = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
            max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768, layer_norm_eps=1e-5,
            bos_token_id=0, eos_token_id=2, pad_token_id=1, initializer_factor=1.0, initializer_range=0.02)
T5 = dict(vocab_size=32128, d_model=4096, d_ff=10240, d_kv=64, num_layers=24, num_decoder_layers=24, num_heads=64,
          relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
          dense_act_fn="gelu_new", is_gated_act=True, layer_norm_epsilon=1e-6, dropout_rate=0.1,
          initializer_factor=1.0, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
          decoder_start_token_id=0)
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=4096)

# Toy sizes for --tiny: every structural option kept (guidance embedding, gated-gelu, 8x VAE with 16 latent
# channels, CLIP's full vocabulary so the real BPE files work).
TINY = dict(
    transformer=dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                     joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)),
    vae=dict(block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=4, sample_size=64),
    clip=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, projection_dim=32),
    t5=dict(d_model=32, d_ff=64, d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=4),
)

MODEL_INDEX = {
    "_class_name": "FluxPipeline",
    "feature_extractor": [None, None],
    "image_encoder": [None, None],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    # FLUX.1-dev says T5TokenizerFast; transformers 5 calls the same class T5Tokenizer (the name it
    # writes itself), which every transformers version has.
    "tokenizer_2": ["transformers", "T5Tokenizer"],
    "transformer": ["diffusers", "FluxTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


def rms(t):
    return float(t.detach().float().pow(2).mean().sqrt())


def summary(t):
    return {"rms": round(rms(t), 5), "max_abs": round(float(t.detach().float().abs().max()), 4),
            "finite": bool(torch.isfinite(t).all())}


def copy_files(src, dst, names):
    os.makedirs(dst, exist_ok=True)
    for name in names:
        path = os.path.join(src, name)
        if not os.path.isfile(path):
            sys.exit(f"missing tokenizer file {path}: pass --fixtures / --t5-tokenizer pointing at the folders "
                     "that hold it (tools/gpu/prepare.sh copies the fixtures into shared/)")
        shutil.copy(path, os.path.join(dst, name))


def init_flux_transformer_(module):
    """Random transformer weights under which every block matters (in place, from torch's global RNG).

    PyTorch's default Linear init (gain 1/sqrt(3)) leaves the blocks' contributions at ~1% of the
    residual stream through all 57 blocks, so the transformer's output would be nearly a fixed linear map
    of its input and a wrong attention, RoPE or modulation in dtune would barely move the image. Here:
    Linear weights N(0, 1/fan_in) (gain 1), biases N(0, 0.05²), the q/k RMSNorm weights U(0.8, 1.6)
    (not ones, so a missing norm weight shows; above one, so attention is not uniform)."""
    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=m.in_features**-0.5)
            if m.bias is not None:
                torch.nn.init.normal_(m.bias, std=0.05)
        elif isinstance(m, torch.nn.RMSNorm) and m.weight is not None:
            torch.nn.init.uniform_(m.weight, 0.8, 1.6)
    return module


def build(make, seed, device, dtype):
    """Builds a module under a fixed seed on `device` in float32, returns it cast to `dtype`."""
    torch.manual_seed(seed)
    with torch.device(device):
        module = make()
    return module.to(dtype).eval()


@torch.no_grad()
def check_transformer(model, tiny):
    """One forward at 512² (1024 image tokens, 512 text tokens; 64² / 16 tokens when tiny) on unit-scale
    inputs, as the sampler's first step sees them."""
    dev, dt = next(model.parameters()).device, next(model.parameters()).dtype
    hw, length = (4, 16) if tiny else (32, 512)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, hw * hw, model.config.in_channels, generator=g)
    ctx = torch.randn(1, length, model.config.joint_attention_dim, generator=g)
    pooled = torch.randn(1, model.config.pooled_projection_dim, generator=g)
    ids = torch.zeros(hw, hw, 3)
    ids[..., 1] += torch.arange(hw)[:, None]
    ids[..., 2] += torch.arange(hw)[None, :]
    out = model(hidden_states=x.to(dev, dt), encoder_hidden_states=ctx.to(dev, dt),
                pooled_projections=pooled.to(dev, dt), timestep=torch.tensor([1.0], device=dev, dtype=dt),
                img_ids=ids.reshape(-1, 3).to(dev, dt), txt_ids=torch.zeros(length, 3, device=dev, dtype=dt),
                guidance=torch.tensor([3.5], device=dev, dtype=dt), return_dict=False)[0]
    return summary(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder to write (replaced if it exists)")
    ap.add_argument("--tiny", action="store_true", help="toy sizes, to test the tooling on a CPU")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--fixtures", default=os.path.join(ROOT, "shared", "fixtures"),
                    help="folder holding tiny-sdxl/tokenizer (CLIP's vocab.json and merges.txt)")
    ap.add_argument("--t5-tokenizer", default=os.path.join(ROOT, "tests", "data", "ref", "tiny-t5-tokenizer"))
    ap.add_argument("--no-check", dest="check", action="store_false",
                    help="skip the forward passes that check the random weights give finite outputs")
    args = ap.parse_args()

    import diffusers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    tiny = TINY if args.tiny else {}
    transformer_cfg = {**TRANSFORMER, **tiny.get("transformer", {})}
    vae_cfg = {**VAE, **tiny.get("vae", {})}
    clip_cfg = {**CLIP, **tiny.get("clip", {})}
    t5_cfg = {**T5, **tiny.get("t5", {})}
    # The transformer reads T5's hidden states and CLIP's pooled output.
    assert transformer_cfg["joint_attention_dim"] == t5_cfg["d_model"]
    assert transformer_cfg["pooled_projection_dim"] == clip_cfg["hidden_size"]
    assert sum(transformer_cfg["axes_dims_rope"]) == transformer_cfg["attention_head_dim"]
    shard = {"transformer": "100KB", "t5": "1MB"} if args.tiny else {"transformer": "10GB", "t5": "5GB"}

    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    report = {"out": args.out, "tiny": args.tiny, "device": args.device, "dtype": args.dtype, "seed": args.seed,
              "diffusers": diffusers.__version__, "torch": torch.__version__, "seconds": {}, "params": {}, "check": {}}
    t_all = time.time()

    def timed(name, fn):
        t0 = time.time()
        fn()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        report["seconds"][name] = round(time.time() - t0, 2)

    def save(name, module, **kw):
        report["params"][name] = sum(p.numel() for p in module.parameters())
        if isinstance(module, diffusers.ModelMixin):  # transformers 5 writes safetensors only, without the flag
            kw["safe_serialization"] = True
        module.save_pretrained(os.path.join(args.out, name), **kw)

    # One component at a time, freed before the next: the full-size transformer is 47.6 GB in float32.
    def transformer():
        model = build(lambda: init_flux_transformer_(FluxTransformer2DModel(**transformer_cfg)), args.seed + 1,
                      args.device, torch.float32)
        if args.check:
            report["check"]["transformer_fp32"] = check_transformer(model, args.tiny)
        model = model.to(dtype)
        if args.check and dtype != torch.float32:
            report["check"]["transformer_" + args.dtype] = check_transformer(model, args.tiny)
        save("transformer", model, max_shard_size=shard["transformer"])

    def text_encoder_2():
        model = build(lambda: T5EncoderModel(T5Config(**t5_cfg)), args.seed + 2, args.device, dtype)
        if args.check:
            ids = torch.randint(0, 500, (1, 64), generator=torch.Generator().manual_seed(2)).to(args.device)
            report["check"]["t5_" + args.dtype] = summary(model(input_ids=ids).last_hidden_state)
        save("text_encoder_2", model, max_shard_size=shard["t5"])

    def text_encoder():
        model = build(lambda: CLIPTextModel(CLIPTextConfig(**clip_cfg)), args.seed + 3, args.device, dtype)
        save("text_encoder", model)

    def vae():
        model = build(lambda: AutoencoderKL(**vae_cfg), args.seed + 4, args.device, dtype)
        if args.check:
            z = torch.randn(1, 16, 16, 16, generator=torch.Generator().manual_seed(3)).to(args.device, dtype)
            report["check"]["vae_decode_" + args.dtype] = summary(model.decode(z).sample)
        save("vae", model)

    with torch.no_grad():
        for name, fn in (("transformer", transformer), ("text_encoder_2", text_encoder_2),
                         ("text_encoder", text_encoder), ("vae", vae)):
            timed(name, fn)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    FlowMatchEulerDiscreteScheduler(**SCHEDULER).save_pretrained(os.path.join(args.out, "scheduler"))
    copy_files(os.path.join(args.fixtures, "tiny-sdxl", "tokenizer"), os.path.join(args.out, "tokenizer"),
               ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"))
    copy_files(args.t5_tokenizer, os.path.join(args.out, "tokenizer_2"),
               ("spiece.model", "tokenizer.json", "tokenizer_config.json"))
    with open(os.path.join(args.out, "model_index.json"), "w") as f:
        json.dump({**MODEL_INDEX, "_diffusers_version": diffusers.__version__}, f, indent=2)
        f.write("\n")
    report["seconds"]["total"] = round(time.time() - t_all, 2)
    report["bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.out) for f in fs)
    bad = [k for k, v in report["check"].items() if not v["finite"]]
    print(json.dumps(report), flush=True)
    if bad:
        sys.exit(f"random weights give non-finite outputs in {bad}; scale the initialisation down")


if __name__ == "__main__":
    main()

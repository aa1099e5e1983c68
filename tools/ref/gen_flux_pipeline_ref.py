#!/usr/bin/env python3
"""Reference data for tests/validate/test_flux_pipeline.cpp: diffusers' FluxPipeline end to end on
a tiny random Flux.1 [dev]-shaped pipeline.

Components: CLIP-L's stand-in is the shared fixtures' tiny SDXL text_encoder + tokenizer (not
copied here: the test takes them from ../shared/fixtures/tiny-sdxl); tokenizer_2 is
tests/data/ref/tiny-t5-tokenizer (tools/ref/gen_t5_tokenizer_ref.py); text_encoder_2 a tiny random
T5EncoderModel; the transformer a tiny random FluxTransformer2DModel with the guidance embedding; the
VAE tests/data/ref/tiny-flux-vae (tools/ref/gen_flux_vae_ref.py); FLUX.1-dev's scheduler config.

Writes tests/data/ref/tiny-flux-pipeline/ (model_index.json, scheduler/, tokenizer_2/,
text_encoder_2/, transformer/; the test adds vae/ from tiny-flux-vae and text_encoder/ + tokenizer/
from the shared tiny SDXL) and tests/data/ref/flux_pipeline_io.safetensors:
  latents [1, 16, 6, 4]  the final latents (unpacked, still scaled and shifted)
  image   [1, 3, 48, 32] in [0, 1]
  and tests/data/ref/tiny-flux-pipeline-transformer-bfl.safetensors: the transformer in Black Forest
  Labs' single-file layout
  image_lora [1, 3, 48, 32]  the same with tests/data/ref/tiny-flux-lora/pytorch_lora_weights.safetensors
             (a random rank-4 PEFT LoRA saved by FluxPipeline.save_lora_weights) loaded by load_lora_weights
for prompt "a red cube on a wooden table", 48x32, 3 steps, guidance 3.5, seed 0,
max_sequence_length 16, float32 on the CPU.

Usage: python3 tools/ref/gen_flux_pipeline_ref.py <shared fixtures dir> [out_dir]   (default tests/data/ref)
"""
import os
import shutil
import sys
import tempfile

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from safetensors.torch import save_file
from transformers import CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

FLUX_DEV_SCHEDULER = {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
                      "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True}


def randomise(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            fan_in = p[0].numel() if p.dim() > 1 else 1
            p.copy_(torch.randn_like(p) * (0.7 / fan_in**0.5 if p.dim() > 1 else 0.1))
    return model.eval()


def main(fixtures, out):
    tokenizer = CLIPTokenizer.from_pretrained(os.path.join(fixtures, "tiny-sdxl", "tokenizer"))
    text_encoder = CLIPTextModel.from_pretrained(os.path.join(fixtures, "tiny-sdxl", "text_encoder")).eval()
    tokenizer_2 = T5TokenizerFast.from_pretrained(os.path.join(out, "tiny-t5-tokenizer"))
    t5 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), d_model=24, d_kv=8, d_ff=40, num_layers=2, num_heads=3,
                                 relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                 feed_forward_proj="gated-gelu"))
    randomise(t5, 3)
    transformer = randomise(FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=24, pooled_projection_dim=text_encoder.config.hidden_size, guidance_embeds=True,
        axes_dims_rope=(2, 2, 4)), 4)
    vae = AutoencoderKL.from_pretrained(os.path.join(out, "tiny-flux-vae")).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=t5, tokenizer_2=tokenizer_2, transformer=transformer)
    args = dict(prompt="a red cube on a wooden table", height=48, width=32, num_inference_steps=3,
                guidance_scale=3.5, max_sequence_length=16)
    with torch.no_grad():
        packed = pipe(**args, generator=torch.Generator().manual_seed(0), output_type="latent").images
        image = pipe(**args, generator=torch.Generator().manual_seed(0), output_type="pt").images
    latents = FluxPipeline._unpack_latents(packed, 48, 32, 8)
    # A LoRA on the transformer (PEFT, rank 4, alpha 8, attention and feed-forward targets) saved
    # as FluxPipeline.save_lora_weights writes it, then loaded back with load_lora_weights.
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                       target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_mlp", "ff.net.2"]))
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 1.5)
    lora_dir = os.path.join(out, "tiny-flux-lora")
    FluxPipeline.save_lora_weights(lora_dir, transformer_lora_layers=get_peft_model_state_dict(transformer),
                                   safe_serialization=True)
    transformer.delete_adapters("default")
    pipe.load_lora_weights(lora_dir)
    with torch.no_grad():
        image_lora = pipe(**args, generator=torch.Generator().manual_seed(0), output_type="pt").images
    pipe.unload_lora_weights()
    # The transformer again in Black Forest Labs' single-file layout (for --model FILE --config_folder).
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gen_flux_transformer_ref import to_bfl
    sd = {k: v.detach().clone() for k, v in transformer.state_dict().items() if "lora" not in k}
    save_file(to_bfl(sd, 1, 1, 16), os.path.join(out, "tiny-flux-pipeline-transformer-bfl.safetensors"))
    with tempfile.TemporaryDirectory() as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
        dst = os.path.join(out, "tiny-flux-pipeline")
        shutil.rmtree(dst, ignore_errors=True)
        os.makedirs(dst)
        shutil.copy(os.path.join(tmp, "model_index.json"), dst)
        for part in ("scheduler", "tokenizer_2", "text_encoder_2", "transformer"):
            shutil.copytree(os.path.join(tmp, part), os.path.join(dst, part))
    save_file({"latents": latents.contiguous(), "image": image.contiguous(), "image_lora": image_lora.contiguous()},
              os.path.join(out, "flux_pipeline_io.safetensors"))
    print("latents", tuple(latents.shape), "image", tuple(image.shape), float(image.mean()))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "tests/data/ref")

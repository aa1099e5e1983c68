#!/usr/bin/env python3
"""Reference data for Flux's validation previews: a tiny random AutoencoderTiny of madebyollin/taef1's
shape (16 latent channels, TAESD's block counts, scaling_factor 1 and shift_factor 0: taef1 decodes
the latents FluxPipeline works in, already shifted and scaled) and what diffusers makes of it.

Writes tests/data/ref/tiny-taef1/ (a diffusers AutoencoderTiny folder) and
tests/data/ref/taef1_io.safetensors:
  latents [2, 16, 6, 5] -> decoded [2, 3, 48, 40]      AutoencoderTiny.decode(...).sample
  image   [1, 3, 32, 24] in [-1, 1] -> encoded [1, 16, 4, 3]
  step<i>_latents [1, 16, 6, 4]   FluxPipeline's latents after sampler step i (1-based) of
      tools/ref/tiny_flux_pipeline.REQUEST (seed 0, 3 steps), unpacked from the callback's packed form
  step<i>_preview [3, 48, 32] uint8   the preview SimpleTuner's ImageTAEDecoder makes of them:
      decode, / 2 + 0.5, clamp to [0, 1], x255 truncated (.byte())

Usage: python3 tools/ref/gen_taef1_ref.py <shared fixtures dir> [out_dir]   (default tests/data/ref)
"""
import os
import sys

import torch
from diffusers import AutoencoderTiny, FluxPipeline
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_flux_pipeline  # noqa: E402


def main(fixtures, out):
    torch.manual_seed(0)
    taef1 = AutoencoderTiny(
        in_channels=3, out_channels=3, latent_channels=16,
        encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(12, 12, 12, 12),
        num_encoder_blocks=(1, 3, 3, 3), num_decoder_blocks=(3, 3, 3, 1),
        act_fn="relu", upsample_fn="nearest", upsampling_scaling_factor=2,
        latent_magnitude=3, latent_shift=0.5, scaling_factor=1.0, shift_factor=0.0, force_upcast=False)
    with torch.no_grad():
        for p in taef1.parameters():  # every weight non-zero, outputs of order 1
            fan_in = p[0].numel() if p.dim() > 1 else 1
            p.copy_(torch.randn_like(p) * (1.4 / fan_in**0.5 if p.dim() > 1 else 0.1))
    taef1.eval()
    taef1.save_pretrained(os.path.join(out, "tiny-taef1"), safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 16, 6, 5, generator=g) * 2
    image = torch.rand(1, 3, 32, 24, generator=g) * 2 - 1
    with torch.no_grad():
        tensors = {"latents": latents, "decoded": taef1.decode(latents).sample.contiguous(), "image": image,
                   "encoded": taef1.encode(image).latents.contiguous()}

    pipe = tiny_flux_pipeline.load(out, fixtures)
    req = tiny_flux_pipeline.REQUEST

    def on_step(p, i, t, kwargs):
        unpacked = FluxPipeline._unpack_latents(kwargs["latents"], req["height"], req["width"],
                                                p.vae_scale_factor)
        with torch.no_grad():
            decoded = taef1.decode(unpacked).sample
        tensors[f"step{i + 1}_latents"] = unpacked.contiguous()
        tensors[f"step{i + 1}_preview"] = (decoded[0] / 2 + 0.5).clamp(0, 1).mul(255).byte().contiguous()
        return kwargs

    with torch.no_grad():
        pipe(**req, generator=torch.Generator().manual_seed(0), output_type="latent",
             callback_on_step_end=on_step, callback_on_step_end_tensor_inputs=["latents"])
    save_file(tensors, os.path.join(out, "taef1_io.safetensors"))
    print({k: tuple(v.shape) for k, v in tensors.items()})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "tests/data/ref")

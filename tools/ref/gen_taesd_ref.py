#!/usr/bin/env python3
"""Reference data for tests/models/test_autoencoder_tiny_parity.cpp: a tiny, randomly initialised
diffusers AutoencoderTiny (the TAESD architecture at toy width, taesdxl's block counts) and what
diffusers computes with it.

Writes tests/data/ref/tiny-taesd/ (config.json + diffusion_pytorch_model.safetensors, a diffusers
folder as madebyollin/taesdxl is one) and tests/data/ref/taesd_io.safetensors:
  latents [2, 4, 6, 5]  -> decoded [2, 3, 48, 40]   (AutoencoderTiny.decode(...).sample)
  image   [1, 3, 32, 24] in [-1, 1] -> encoded [1, 4, 4, 3]   (AutoencoderTiny.encode(...).latents)
Every weight is random and non-zero. Float32 on the CPU.

Usage: python3 tools/ref/gen_taesd_ref.py [out_dir]      (default tests/data/ref)
"""
import os
import sys

import torch
from diffusers import AutoencoderTiny
from safetensors.torch import save_file


def main(out):
    torch.manual_seed(0)
    model = AutoencoderTiny(
        in_channels=3, out_channels=3, latent_channels=4,
        encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(12, 12, 12, 12),
        num_encoder_blocks=(1, 3, 3, 3), num_decoder_blocks=(3, 3, 3, 1),
        act_fn="relu", upsample_fn="nearest", upsampling_scaling_factor=2,
        latent_magnitude=3, latent_shift=0.5, scaling_factor=1.0, force_upcast=False)
    with torch.no_grad():
        for p in model.parameters():  # every weight non-zero, outputs of order 1
            fan_in = p[0].numel() if p.dim() > 1 else 1
            p.copy_(torch.randn_like(p) * (1.4 / fan_in**0.5 if p.dim() > 1 else 0.1))
    model.eval()
    model.save_pretrained(os.path.join(out, "tiny-taesd"), safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 4, 6, 5, generator=g) * 2
    image = torch.rand(1, 3, 32, 24, generator=g) * 2 - 1
    with torch.no_grad():
        decoded = model.decode(latents).sample
        encoded = model.encode(image).latents
    save_file({"latents": latents, "decoded": decoded.contiguous(), "image": image,
               "encoded": encoded.contiguous()}, os.path.join(out, "taesd_io.safetensors"))
    print("decoded", tuple(decoded.shape), "range", float(decoded.min()), float(decoded.max()))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/ref")

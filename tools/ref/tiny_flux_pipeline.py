"""The tiny Flux.1 [dev]-shaped FluxPipeline of tests/data/ref, assembled as
tests/validate/test_flux_pipeline.cpp assembles it (tiny-flux-pipeline/ plus tiny-flux-vae/ and the
shared tiny SDXL's CLIP text encoder and tokenizer), and the request every Flux pipeline fixture
uses. Shared by the gen_flux_*_ref.py scripts that build on tools/ref/gen_flux_pipeline_ref.py's
output; it writes nothing.
"""
import os

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

# tests/validate/test_flux_pipeline.cpp's reference_request().
REQUEST = dict(prompt="a red cube on a wooden table", height=48, width=32, num_inference_steps=3,
               guidance_scale=3.5, max_sequence_length=16)


def load(ref, fixtures):
    """FluxPipeline from the committed tiny folders (float32, CPU)."""
    flux = os.path.join(ref, "tiny-flux-pipeline")
    sdxl = os.path.join(fixtures, "tiny-sdxl")
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(os.path.join(flux, "scheduler")),
        vae=AutoencoderKL.from_pretrained(os.path.join(ref, "tiny-flux-vae")).eval(),
        text_encoder=CLIPTextModel.from_pretrained(os.path.join(sdxl, "text_encoder")).eval(),
        tokenizer=CLIPTokenizer.from_pretrained(os.path.join(sdxl, "tokenizer")),
        text_encoder_2=T5EncoderModel.from_pretrained(os.path.join(flux, "text_encoder_2")).eval(),
        tokenizer_2=T5TokenizerFast.from_pretrained(os.path.join(flux, "tokenizer_2")),
        transformer=FluxTransformer2DModel.from_pretrained(os.path.join(flux, "transformer")).eval())


def run(pipe, **overrides):
    """(latents [1, 16, 6, 4] unpacked, image [1, 3, 48, 32] in [0, 1]) for REQUEST with seed 0."""
    args = dict(REQUEST, **overrides)
    with torch.no_grad():
        packed = pipe(**args, generator=torch.Generator().manual_seed(0), output_type="latent").images
        image = pipe(**args, generator=torch.Generator().manual_seed(0), output_type="pt").images
    latents = FluxPipeline._unpack_latents(packed, args["height"], args["width"], pipe.vae_scale_factor)
    return latents.contiguous(), image.contiguous()

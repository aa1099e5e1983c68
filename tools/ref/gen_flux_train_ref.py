#!/usr/bin/env python3
"""Reference for tests/train/test_flux_train_parity.cpp: ten LoRA training steps of the tiny Flux.1
[dev] transformer (tests/data/ref/tiny-flux-dev) written with diffusers + peft + torch.optim only,
the way SimpleTuner trains Flux with flow matching, on fixed inputs.

Each step, for a batch of B latents x0 [B, 4, 12, 16] (the tiny model's in_channels 16 = 4 latent
channels packed 2x2), fixed noise and sigmas:
    noisy  = (1 - sigma) * x0 + sigma * noise
    pred   = FluxTransformer2DModel(pack(noisy), timestep=sigma, guidance, T5 / pooled embeddings,
                                    img_ids / txt_ids as FluxPipeline builds them), unpacked
    loss   = mean((pred - (noise - x0))^2)
then backward, clip_grad_norm_ (max_grad_norm below), torch.optim.AdamW with dtune's defaults
(betas 0.9 / 0.999, eps 1e-8, weight decay 0.01) at a constant learning rate.
The transformer takes sigma in [0, 1] (FluxPipeline passes t / 1000; the model multiplies timestep
and guidance by 1000 itself). Guidance: steps 0-4 use 1.0, dtune's default when a batch carries none
(SimpleTuner's flux_guidance_value); steps 5-9 carry their own per-sample values, which the C++ test
puts into the batch as cond["guidance"].

LoRA: peft LoraConfig(r=4, lora_alpha=8, dropout 0) on dtune's Flux default targets
(FluxFamily::default_lora_targets: SimpleTuner's flux_lora_target "all"). lora_B starts at zero as in
both libraries; lora_A is peft's initialisation under a fixed seed and is stored, so the C++ test
starts dtune's adapters from exactly these factors.

Also stored, to show the tolerance can tell a wrong step from a right one: how far the results move
when one convention is changed (timestep 1 - sigma, sigma * 1000 given to the model, target x0 -
noise, guidance 3.5 instead of 1.0, no weight decay, no clipping).

Writes tests/data/ref/flux_train_ref.safetensors:
  latents, noise [10, B, 4, 12, 16]; sigmas, guidance [10, B]; prompt_embeds [10, B, L, 24];
  pooled_prompt_embeds [10, B, 12]; attention_mask [10, B, L] (T5-style padding, not applied, as
  diffusers and SimpleTuner train); losses, grad_norms [10] (float64 as float32: loss before the
  update, gradient norm before clipping);
  init.<peft name> (lora_A at the start; lora_B is zero), final.<peft name> (after step 10)
and tests/data/ref/flux_train_ref.json (settings and the variant deviations).

Usage: python3 tools/ref/gen_flux_train_ref.py [out_dir]      (default tests/data/ref)
"""
import json
import os
import sys

import diffusers
import peft
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file

OUT = sys.argv[1] if len(sys.argv) > 1 else "tests/data/ref"
MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "data", "ref", "tiny-flux-dev")

STEPS, B, C, H, W, L = 10, 2, 4, 12, 16, 8
GUIDED_FROM = 5  # steps from here on carry cond["guidance"]
SETTINGS = dict(
    lora_rank=4, lora_alpha=8.0, learning_rate=2e-3, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
    adam_weight_decay=0.01, grad_clip_method="norm", max_grad_norm=0.5, optimizer="torch-adamw",
    lr_scheduler="constant", steps=STEPS, batch=B, latent_shape=[C, H, W], text_tokens=L,
    guidance_in_batch_from_step=GUIDED_FROM, default_guidance=1.0)
TARGETS = ["to_k", "to_q", "to_v", "add_k_proj", "add_q_proj", "add_v_proj", "to_out.0", "to_add_out"]


def inputs():
    g = torch.Generator().manual_seed(23)
    latents = torch.randn(STEPS, B, C, H, W, generator=g) * 0.8 + 0.1
    noise = torch.randn(STEPS, B, C, H, W, generator=g)
    # Logit-normal sigmas shifted by 3 (SimpleTuner's Flux default), plus the ends of the range.
    sigmas = torch.sigmoid(torch.randn(STEPS, B, generator=g))
    sigmas = 3 * sigmas / (1 + 2 * sigmas)
    sigmas[0, 0], sigmas[3, 1] = 0.02, 0.97
    guidance = torch.ones(STEPS, B)
    guidance[GUIDED_FROM:] = 1 + 4 * torch.rand(STEPS - GUIDED_FROM, B, generator=g)
    prompt = torch.randn(STEPS, B, L, 24, generator=g)
    pooled = torch.randn(STEPS, B, 12, generator=g)
    mask = torch.zeros(STEPS, B, L)
    for s in range(STEPS):
        for b in range(B):
            mask[s, b, : 3 + (s + b) % (L - 3)] = 1  # T5 tokens then padding; the padding still counts
    return dict(latents=latents, noise=noise, sigmas=sigmas, guidance=guidance, prompt_embeds=prompt,
                pooled_prompt_embeds=pooled, attention_mask=mask)


def train(data, timestep=lambda s: s, target_sign=1.0, guidance_override=None,
          weight_decay=SETTINGS["adam_weight_decay"], clip=True):
    """Ten steps; returns (losses, grad norms, final adapters, initial lora_A)."""
    model = FluxTransformer2DModel.from_pretrained(MODEL, torch_dtype=torch.float32)
    model.requires_grad_(False)
    torch.manual_seed(4)  # peft's lora_A initialisation
    model.add_adapter(LoraConfig(r=SETTINGS["lora_rank"], lora_alpha=SETTINGS["lora_alpha"], lora_dropout=0.0,
                                 init_lora_weights=True, target_modules=TARGETS))
    model.train()
    named = {k: v for k, v in model.named_parameters() if v.requires_grad}
    start = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    params = list(named.values())
    opt = torch.optim.AdamW(params, lr=SETTINGS["learning_rate"],
                            betas=(SETTINGS["adam_beta1"], SETTINGS["adam_beta2"]),
                            eps=SETTINGS["adam_epsilon"], weight_decay=weight_decay, foreach=False)
    img_ids = FluxPipeline._prepare_latent_image_ids(B, H // 2, W // 2, "cpu", torch.float32)  # [HW/4, 3]
    txt_ids = torch.zeros(L, 3)
    losses, norms = [], []
    for s in range(STEPS):
        x0, noise = data["latents"][s], data["noise"][s]
        sigma = data["sigmas"][s]
        noisy = (1 - sigma[:, None, None, None]) * x0 + sigma[:, None, None, None] * noise
        guidance = data["guidance"][s] if guidance_override is None else guidance_override[s]
        out = model(hidden_states=FluxPipeline._pack_latents(noisy, B, C, H, W),
                    encoder_hidden_states=data["prompt_embeds"][s],
                    pooled_projections=data["pooled_prompt_embeds"][s], timestep=timestep(sigma),
                    guidance=guidance, img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]
        pred = FluxPipeline._unpack_latents(out, H * 8, W * 8, 8)  # [B, C, H, W]
        target = target_sign * (noise - x0)
        loss = ((pred.float() - target) ** 2).mean(dim=[1, 2, 3]).mean()
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, SETTINGS["max_grad_norm"] if clip else float("inf"))
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
    final = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    return losses, norms, final, start


def deviation(ref, other):
    """Largest per-tensor |update - reference update| / |reference update| (norms), and loss change."""
    (l0, _, f0, s0), (l1, _, f1, _) = ref, other
    w = max(float((f1[k] - f0[k]).norm() / (f0[k] - s0[k]).norm()) for k in f0)
    l = max(abs(a - b) / abs(a) for a, b in zip(l0, l1))
    return dict(weights=w, losses=l)


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    data = inputs()
    ref = train(data)
    losses, norms, final, start = ref
    for k, v in start.items():
        assert "lora_A" in k or float(v.abs().max()) == 0.0, k  # lora_B starts at zero
    variants = {
        "timestep 1 - sigma": train(data, timestep=lambda s: 1 - s),
        "timestep sigma * 1000": train(data, timestep=lambda s: s * 1000),
        "target x0 - noise": train(data, target_sign=-1.0),
        "guidance 3.5": train(data, guidance_override=torch.full((STEPS, B), 3.5)),
        "no weight decay": train(data, weight_decay=0.0),
        "no clipping": train(data, clip=False),
    }
    again = train(data)
    assert all(torch.equal(v[3][k], start[k]) for v in variants.values() for k in start), "init differs"
    assert again[0] == losses and all(torch.equal(again[2][k], final[k]) for k in final), "not repeatable"
    tensors = {k: v.contiguous() for k, v in data.items()}
    tensors["losses"] = torch.tensor(losses, dtype=torch.float32)
    tensors["grad_norms"] = torch.tensor(norms, dtype=torch.float32)
    for k, v in start.items():
        if "lora_A" in k:
            tensors["init." + k] = v.contiguous()
    for k, v in final.items():
        tensors["final." + k] = v.contiguous()
    save_file(tensors, os.path.join(OUT, "flux_train_ref.safetensors"))
    info = dict(SETTINGS, model="tiny-flux-dev", lora_targets=TARGETS, adapters=len(final),
                losses=losses, grad_norms=norms, variant_deviation={k: deviation(ref, v) for k, v in variants.items()},
                versions=dict(torch=torch.__version__, diffusers=diffusers.__version__, peft=peft.__version__))
    with open(os.path.join(OUT, "flux_train_ref.json"), "w") as f:
        json.dump(info, f, indent=1)
        f.write("\n")
    print(json.dumps({k: info[k] for k in ("losses", "grad_norms", "variant_deviation")}, indent=1))


if __name__ == "__main__":
    main()

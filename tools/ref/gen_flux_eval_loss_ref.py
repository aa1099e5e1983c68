#!/usr/bin/env python3
"""Reference data for the flow-matching eval loss (tests/report/test_eval_loss_flow.cpp): what
SimpleTuner's evaluation pass computes for a Flux model, rebuilt from diffusers' pieces.

SimpleTuner (helpers/training/validation.py, the eval pass, and trainer._prepare_custom_timestep_batch):
  * the training scheduler: FlowMatchEulerDiscreteScheduler.from_pretrained(<model>/scheduler,
    shift=flow_schedule_shift); with a static shift its sigma bounds are pinned to [1/T, 1]
    (flow_match.fix_flow_match_euler_schedule_bounds);
  * set_timesteps(eval_timesteps, mu=calculate_shift(token count of the latents)) when the config
    uses dynamic shifting (FLUX.1-dev), else set_timesteps(eval_timesteps);
  * the noise is drawn once per batch after torch.manual_seed(0); for every timestep t the batch is
    re-noised at sigma = t / T: x = (1 - sigma) x0 + sigma noise, the transformer sees t / T, and the
    loss is the MSE against noise - x0; the reported value is the mean over batches and timesteps.
Here the noise comes from a CPU generator seeded 0 per sample (dtune's choice, device-independent).

Writes tests/data/ref/flux_eval_loss_ref.safetensors for the tiny Flux pipeline's transformer
(tests/data/ref/tiny-flux-pipeline/transformer), three timesteps, two samples of different sizes
(so mu differs):
  s<i>.latents [1, 16, h, w], s<i>.prompt_embeds [1, 5, 24], s<i>.pooled_prompt_embeds [1, 32],
  s<i>.timesteps [3] (float32, the scheduler's), s<i>.losses [3] (float64, per timestep)
  loss [1] float64: the mean over both samples and the three timesteps
  static_timesteps [4]: set_timesteps(4) of the same scheduler with use_dynamic_shifting off and
      shift 3 (schnell's case), bounds pinned as SimpleTuner pins them

Usage: python3 tools/ref/gen_flux_eval_loss_ref.py [ref_dir]      (default tests/data/ref)
"""
import os
import sys

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline, calculate_shift
from safetensors.torch import save_file

NUM_TIMESTEPS = 3
FLOW_SCHEDULE_SHIFT = 3.0  # SimpleTuner's default flow_schedule_shift


def scheduler(folder, **overrides):
    s = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler",
                                                        shift=FLOW_SCHEDULE_SHIFT, **overrides)
    if not s.config.use_dynamic_shifting:  # SimpleTuner's bounds fix
        s.sigma_max = 1.0
        s.sigma_min = 1.0 / s.config.num_train_timesteps
    return s


def main(ref):
    folder = os.path.join(ref, "tiny-flux-pipeline")
    model = FluxTransformer2DModel.from_pretrained(os.path.join(folder, "transformer")).eval()
    sched = scheduler(folder)
    gen = torch.Generator().manual_seed(5)
    out, losses = {}, []
    for i, (h, w) in enumerate([(8, 8), (6, 10)]):
        x0 = torch.randn(1, 16, h, w, generator=gen)
        ctx = torch.randn(1, 5, 24, generator=gen)
        pooled = torch.randn(1, 32, generator=gen)
        noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
        seq = (h // 2) * (w // 2)
        c = sched.config
        mu = calculate_shift(seq, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
        sched.set_timesteps(NUM_TIMESTEPS, mu=mu)
        ts = sched.timesteps.clone()
        img_ids = FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", torch.float32)
        txt_ids = torch.zeros(ctx.shape[1], 3)
        per = []
        with torch.no_grad():
            for t in ts:
                t = t.reshape(1)
                sigma = (t / c.num_train_timesteps).reshape(1, 1, 1, 1)
                noisy = (1 - sigma) * x0 + sigma * noise
                packed = FluxPipeline._pack_latents(noisy, 1, 16, h, w)
                v = model(hidden_states=packed, timestep=t / 1000, guidance=torch.ones(1),
                          pooled_projections=pooled, encoder_hidden_states=ctx, txt_ids=txt_ids,
                          img_ids=img_ids, return_dict=False)[0]
                pred = FluxPipeline._unpack_latents(v, h * 8, w * 8, 8)
                per.append(torch.nn.functional.mse_loss(pred.double(), (noise - x0).double()).item())
        losses += per
        out.update({f"s{i}.latents": x0, f"s{i}.prompt_embeds": ctx, f"s{i}.pooled_prompt_embeds": pooled,
                    f"s{i}.timesteps": ts.float(), f"s{i}.losses": torch.tensor(per, dtype=torch.float64)})
        print(f"sample {i}: {h}x{w}, mu {mu:.6f}, timesteps {ts.tolist()}, losses {per}")
    out["loss"] = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64)
    static = scheduler(folder, use_dynamic_shifting=False)
    static.set_timesteps(4)
    out["static_timesteps"] = static.timesteps.float().clone()
    print("static timesteps", static.timesteps.tolist(), "mean loss", out["loss"].item())
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(ref, "flux_eval_loss_ref.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/ref")

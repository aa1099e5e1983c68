#!/usr/bin/env python3
"""Runs the quickstart's "use the result" steps for real: dtune's exports loaded by diffusers.

Trains on the tiny SDXL fixture with the dtune binary (CPU, deterministic, a dozen generated
images), then:
  (a) full fine-tune (adamw_bf16) -> `pipeline/`: StableDiffusionXLPipeline.from_pretrained loads it
      with exactly the exported UNet weights, and a 2-step generation equals `dtune sample --model
      pipeline/` with the same seed;
  (b) LoRA (diffusers keys, rank 4, alpha 8) -> `pipe.load_lora_weights(<output_dir>)` on the
      fixture pipeline, as docs/quickstart-sdxl.md writes it: the LoRA changes the image, and the
      image equals `dtune sample --lora ... --lora_scale 1`;
  (c) the same LoRA trained with `lora_format comfyui`: every key is a `lora_unet_<module>` name
      of a real UNet module as ComfyUI maps them (the module's diffusers path with '.' -> '_',
      `.lora_down.weight` / `.lora_up.weight` / `.alpha`), the tensors equal the diffusers-format
      run's, and diffusers' own kohya loader gives the same image;
  (d) Flux (with --ref, the tiny Flux.1 [dev] pipeline of tests/data/ref): a LoRA trained by
      `dtune train` (model_family flux) loads with FluxPipeline.load_lora_weights, changes the image
      and gives `dtune sample --lora`'s image; the same run with `lora_format comfyui` holds the
      same tensors plus a `.alpha` per module and gives diffusers the same image; a DoRA run
      (use_dora) loads with its trained `lora_magnitude_vector`s and gives `dtune sample --lora`'s
      image; a full fine-tune's `pipeline/` loads with FluxPipeline.from_pretrained holding exactly
      the exported transformer.

Images are compared as the 8-bit values dtune writes (round(x * 255), as diffusers' numpy_to_pil):
dtune's float32 pipeline matches diffusers to ~1e-5 on images (tests/validate parity), far below
1/255, so a byte may differ by 1 only where a value sits within ~1e-5 of a rounding boundary: at
most 1 everywhere and on under 1% of the bytes. The LoRA must change at least 10% of the bytes,
by more than 2 on at least one, so "LoRA not applied" or "applied at the wrong scale" fails.

Usage: check_diffusers_exports.py --dtune build/dev/bin/dtune --fixtures ../shared/fixtures [--ref tests/data/ref]
Exit status 0 when every check passes, 1 otherwise (including missing Python packages).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
    from PIL import Image
    from safetensors.torch import load_file
    from diffusers import FluxPipeline, StableDiffusionXLPipeline
    import peft  # noqa: F401  load_lora_weights needs diffusers' PEFT backend
except ImportError as err:
    print(f"check_diffusers_exports: FAIL: Python package missing ({err.name}); "
          "install with `python3 -m pip install diffusers transformers peft` (scripts/setup.sh does)",
          file=sys.stderr)
    sys.exit(1)

PROMPT = "a photo number 3"
SEED = 1
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def run(cmd, log):
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True)
    if res.returncode != 0:
        print(open(log).read()[-4000:], file=sys.stderr)
        raise SystemExit(f"check_diffusers_exports: FAIL: {cmd[1]} exited {res.returncode}")
    return res.stdout


def write_workspace(work, fixtures):
    images = os.path.join(work, "images")
    os.makedirs(images)
    rng = np.random.default_rng(0)
    for i in range(12):  # smooth colour fields with noise, captioned by file name
        y, x = np.mgrid[0:64, 0:80]
        base = np.stack([(x * (i + 1)) % 256, (y * 3 + i * 20) % 256, ((x + y) * 2) % 256], -1)
        noisy = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(noisy).save(os.path.join(images, f"a photo number {i}.png"))
    backends = [
        {"id": "tiny", "type": "local", "instance_data_dir": images, "resolution": 64,
         "resolution_type": "pixel", "caption_strategy": "filename",
         "cache_dir_vae": os.path.join(work, "cache_vae")},  # shared by the runs: encoded once
        {"id": "text", "type": "local", "dataset_type": "text_embeds", "default": True,
         "cache_dir": os.path.join(work, "cache_text")},
    ]
    with open(os.path.join(work, "multidatabackend.json"), "w") as f:
        json.dump(backends, f)
    config = {
        "model_family": "sdxl", "pretrained_model_name_or_path": os.path.join(fixtures, "tiny-sdxl"),
        "data_backend_config": os.path.join(work, "multidatabackend.json"),
        "train_batch_size": 2, "max_train_steps": 3, "checkpointing_steps": 100,
        "mixed_precision": "no", "gradient_checkpointing": False, "seed": 7, "deterministic": True,
        "device": "cpu", "caption_dropout_probability": 0.0,
    }
    path = os.path.join(work, "config.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def dtune_sample(args, model, out, log, extra=()):
    printed = run([args.dtune, "sample", "--model", model, "--prompt", PROMPT, "--width", "64",
                   "--height", "64", "--steps", "2", "--guidance", "5", "--seed", str(SEED),
                   "--device", "cpu", "--output_dir", out, *extra], log)
    png = [line for line in printed.splitlines() if line.endswith(".png")][0]
    return np.asarray(Image.open(png).convert("RGB")).astype(np.int16)


def diffusers_image(pipe):
    image = pipe(PROMPT, num_inference_steps=2, guidance_scale=5.0, height=64, width=64,
                 generator=torch.Generator("cpu").manual_seed(SEED), output_type="np").images[0]
    return np.round(image * 255).astype(np.int16)  # [H, W, 3], as numpy_to_pil rounds


def same_image(a, b, what):
    diff = np.abs(a - b)
    check(diff.max() <= 1 and (diff > 0).mean() < 0.01,
          f"{what}: max byte difference {diff.max()}, {100 * (diff > 0).mean():.2f}% of bytes differ "
          "(allowed: 1, under 1%)")


def check_full(args, work, config, log):
    out = os.path.join(work, "full")
    run([args.dtune, "train", "--config", config, "--output_dir", out, "--model_type", "full",
         "--optimizer", "adamw_bf16", "--learning_rate", "1e-3"], log)
    folder = os.path.join(out, "pipeline")
    pipe = StableDiffusionXLPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    exported = load_file(os.path.join(folder, "unet", "diffusion_pytorch_model.safetensors"))
    loaded = pipe.unet.state_dict()
    check(set(exported) == set(loaded), f"(a) from_pretrained: the UNet has exactly the exported "
          f"keys ({len(exported)}; missing {len(set(exported) - set(loaded))}, "
          f"extra {len(set(loaded) - set(exported))})")
    equal = all(torch.equal(loaded[k], exported[k].float()) for k in exported if k in loaded)
    check(equal, "(a) from_pretrained: every UNet tensor equals the exported one")
    base = load_file(os.path.join(args.fixtures, "tiny-sdxl", "unet", "diffusion_pytorch_model.safetensors"))
    moved = sum(not torch.equal(base[k].float(), exported[k].float()) for k in exported)
    check(moved > len(exported) // 2, f"(a) the full fine-tune changed {moved} of {len(exported)} tensors")
    ours = dtune_sample(args, folder, os.path.join(work, "sample_full"), log)
    same_image(diffusers_image(pipe), ours, "(a) diffusers on pipeline/ vs dtune sample --model pipeline/")


def comfy_module(key):
    for suffix in (".lora_down.weight", ".lora_up.weight", ".alpha"):
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return None


def check_lora(args, work, config, log):
    lora_args = ["--model_type", "lora", "--lora_rank", "4", "--lora_alpha", "8", "--optimizer",
                 "torch-adamw", "--learning_rate", "3e-2"]
    out = os.path.join(work, "lora")
    run([args.dtune, "train", "--config", config, "--output_dir", out, *lora_args], log)
    comfy_out = os.path.join(work, "lora_comfy")
    run([args.dtune, "train", "--config", config, "--output_dir", comfy_out, *lora_args,
         "--lora_format", "comfyui"], log)
    tiny = os.path.join(args.fixtures, "tiny-sdxl")
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny, torch_dtype=torch.float32)
    plain = diffusers_image(pipe)
    same_image(plain, dtune_sample(args, tiny, os.path.join(work, "sample_base"), log),
               "(b) base model: diffusers vs dtune sample")
    pipe.load_lora_weights(out)  # the quickstart's call: the folder holding pytorch_lora_weights.safetensors
    with_lora = diffusers_image(pipe)
    changed = np.abs(with_lora - plain)
    check((changed > 0).mean() > 0.1 and changed.max() > 2,
          f"(b) the LoRA changes the diffusers image ({100 * (changed > 0).mean():.1f}% of bytes, "
          f"by up to {changed.max()})")
    lora_file = os.path.join(out, "pytorch_lora_weights.safetensors")
    ours = dtune_sample(args, tiny, os.path.join(work, "sample_lora"), log,
                        ("--lora", lora_file, "--lora_scale", "1"))
    same_image(with_lora, ours, "(b) load_lora_weights vs dtune sample --lora --lora_scale 1")

    # (c) ComfyUI / kohya keys: module names from the UNet diffusers itself builds.
    comfy = load_file(os.path.join(comfy_out, "pytorch_lora_weights.safetensors"))
    modules = {"lora_unet_" + name.replace(".", "_") for name, _ in pipe.unet.named_modules() if name}
    bad = [k for k in comfy if comfy_module(k) not in modules]
    check(not bad, f"(c) ComfyUI keys: all {len(comfy)} name a UNet module as lora_unet_<path> "
          f"with lora_down/lora_up/alpha (bad: {bad[:3]})")
    diffusers_keys = load_file(lora_file)
    per_module = {comfy_module(k) for k in comfy}
    check(len(per_module) * 3 == len(comfy) and len(per_module) * 2 == len(diffusers_keys),
          f"(c) {len(per_module)} modules, each with down, up and alpha; the diffusers file has the "
          "same modules")
    same = all(torch.equal(comfy[f"{m}.lora_down.weight"], diffusers_keys[k])
               for k in diffusers_keys if k.endswith("lora.down.weight")
               for m in ["lora_unet_" + k[len("unet."):-len(".lora.down.weight")].replace(".", "_")])
    alphas = {float(comfy[k]) for k in comfy if k.endswith(".alpha")}
    check(same and alphas == {8.0}, f"(c) down weights equal the diffusers-format run's; alpha {alphas}")
    pipe.unload_lora_weights()
    pipe.load_lora_weights(comfy_out)  # diffusers converts kohya keys itself
    same_image(diffusers_image(pipe), with_lora, "(c) diffusers loading the ComfyUI file vs the diffusers file")


def flux_image(pipe):
    """(8-bit image as dtune writes it, the float image) of FluxPipeline."""
    image = pipe(PROMPT, num_inference_steps=2, guidance_scale=3.5, height=64, width=64,
                 max_sequence_length=32, generator=torch.Generator("cpu").manual_seed(SEED),
                 output_type="np").images[0]
    return np.round(image * 255).astype(np.int16), image


FLUX_LORA_ARGS = ["--model_type", "lora", "--lora_rank", "4", "--lora_alpha", "8", "--optimizer", "torch-adamw",
                  "--learning_rate", "1e-1"]


def flux_sample_lora(args, model, lora, out, log):
    printed = run([args.dtune, "sample", "--model", model, "--prompt", PROMPT, "--width", "64", "--height", "64",
                   "--steps", "2", "--guidance", "3.5", "--max_sequence_length", "32", "--seed", str(SEED),
                   "--device", "cpu", "--output_dir", out, "--lora", lora], log)
    png = [line for line in printed.splitlines() if line.endswith(".png")][0]
    return np.asarray(Image.open(png).convert("RGB")).astype(np.int16)


def check_flux_comfyui(args, work, configs, log, pipe, diffusers_out, diffusers_float):
    """lora_format comfyui for Flux: SimpleTuner's layout (the diffusers keys plus `.alpha`), which
    ComfyUI maps per projection; diffusers must read it to the same LoRA as the diffusers file."""
    out = os.path.join(work, "flux_lora_comfy")
    run([args.dtune, "train", "--config", configs[0], "--data_backend_config", configs[1], "--output_dir", out,
         *FLUX_LORA_ARGS, "--lora_format", "comfyui"], log)
    comfy = load_file(os.path.join(out, "pytorch_lora_weights.safetensors"))
    plain = load_file(os.path.join(diffusers_out, "pytorch_lora_weights.safetensors"))
    modules = [k[: -len(".lora_A.weight")] for k in plain if k.endswith(".lora_A.weight")]
    check(set(comfy) == set(plain) | {m + ".alpha" for m in modules}
          and all(torch.equal(comfy[k], plain[k]) for k in plain)
          and {float(comfy[m + ".alpha"]) for m in modules} == {8.0},
          f"(d) the comfyui Flux file is the diffusers file's {len(plain)} tensors plus alpha 8 for each of "
          f"its {len(modules)} modules, all under transformer.")
    pipe.load_lora_weights(out)
    _, comfy_float = flux_image(pipe)
    diff = np.abs(comfy_float - diffusers_float).max()
    check(diff < 1e-6, f"(d) FluxPipeline.load_lora_weights of the comfyui file vs the diffusers file: max "
          f"difference {diff:.1e}")


def check_flux_dora(args, work, configs, log, pipe, model, plain):
    """use_dora for Flux: PEFT's lora_magnitude_vector keys, loaded by diffusers as trained."""
    out = os.path.join(work, "flux_dora")
    run([args.dtune, "train", "--config", configs[0], "--data_backend_config", configs[1], "--output_dir", out,
         *FLUX_LORA_ARGS, "--use_dora", "true"], log)
    lora_file = os.path.join(out, "pytorch_lora_weights.safetensors")
    saved = load_file(lora_file)
    pipe.load_lora_weights(out)
    loaded, moved = 0, 0.0
    exact = True
    for name, module in pipe.transformer.named_modules():
        magnitude = getattr(module, "lora_magnitude_vector", None)
        if not magnitude:
            continue
        got = next(iter(magnitude.values())).weight
        key = f"transformer.{name}.lora_magnitude_vector"
        exact = exact and key in saved and torch.equal(got, saved[key])
        moved = max(moved, float((got - module.base_layer.weight.norm(dim=1)).abs().max()))
        loaded += 1
    expected = sum(k.endswith(".lora_magnitude_vector") for k in saved)
    check(loaded == expected > 0 and exact and moved > 1e-3,
          f"(d) FluxPipeline.load_lora_weights loads the {expected} DoRA magnitudes as trained "
          f"({loaded} loaded, exact: {exact}, moved from the weight norms by up to {moved:.2e})")
    with_dora, with_dora_float = flux_image(pipe)
    changed = np.abs(with_dora_float - plain).max()
    check(changed > 1e-3, f"(d) the Flux DoRA changes FluxPipeline's image (by up to {changed:.2e})")
    ours = flux_sample_lora(args, model, lora_file, os.path.join(work, "sample_flux_dora"), log)
    same_image(with_dora, ours, "(d) FluxPipeline.load_lora_weights (DoRA) vs dtune sample --lora")


def check_flux(args, work, config, log):
    import shutil
    model = os.path.join(work, "tiny-flux")
    shutil.copytree(os.path.join(args.ref, "tiny-flux-pipeline"), model)
    shutil.copytree(os.path.join(args.ref, "tiny-flux-vae"), os.path.join(model, "vae"))
    for part in ("text_encoder", "tokenizer"):
        shutil.copytree(os.path.join(args.fixtures, "tiny-sdxl", part), os.path.join(model, part))
    with open(config) as f:
        cfg = json.load(f)
    cfg.update({"model_family": "flux", "pretrained_model_name_or_path": model})
    flux_config = os.path.join(work, "flux_config.json")
    with open(flux_config, "w") as f:
        json.dump(cfg, f)
    backends = json.load(open(cfg["data_backend_config"]))
    backends[0]["cache_dir_vae"] = os.path.join(work, "cache_vae_flux")
    backends[1]["cache_dir"] = os.path.join(work, "cache_text_flux")
    flux_backends = os.path.join(work, "flux_multidatabackend.json")
    with open(flux_backends, "w") as f:
        json.dump(backends, f)
    out = os.path.join(work, "flux_lora")
    run([args.dtune, "train", "--config", flux_config, "--data_backend_config", flux_backends,
         "--output_dir", out, *FLUX_LORA_ARGS], log)
    pipe = FluxPipeline.from_pretrained(model, torch_dtype=torch.float32)
    _, plain = flux_image(pipe)
    pipe.load_lora_weights(out)
    with_lora, with_lora_float = flux_image(pipe)
    # The tiny Flux VAE flattens most of a change in its latents: compare the float images.
    changed = np.abs(with_lora_float - plain)
    check(changed.max() > 1e-3, f"(d) the Flux LoRA changes FluxPipeline's image (by up to {changed.max():.2e})")
    printed = run([args.dtune, "sample", "--model", model, "--prompt", PROMPT, "--width", "64", "--height", "64",
                   "--steps", "2", "--guidance", "3.5", "--max_sequence_length", "32", "--seed", str(SEED),
                   "--device", "cpu", "--output_dir", os.path.join(work, "sample_flux_lora"),
                   "--lora", os.path.join(out, "pytorch_lora_weights.safetensors"), "--lora_scale", "1"], log)
    png = [line for line in printed.splitlines() if line.endswith(".png")][0]
    ours = np.asarray(Image.open(png).convert("RGB")).astype(np.int16)
    same_image(with_lora, ours, "(d) FluxPipeline.load_lora_weights vs dtune sample --lora")
    pipe.unload_lora_weights()
    check_flux_comfyui(args, work, (flux_config, flux_backends), log, pipe, out, with_lora_float)
    pipe.unload_lora_weights()
    check_flux_dora(args, work, (flux_config, flux_backends), log, pipe, model, plain)

    full = os.path.join(work, "flux_full")
    run([args.dtune, "train", "--config", flux_config, "--data_backend_config", flux_backends,
         "--output_dir", full, "--model_type", "full", "--optimizer", "torch-adamw", "--learning_rate", "1e-3"],
        log)
    exported = load_file(os.path.join(full, "pipeline", "transformer", "diffusion_pytorch_model.safetensors"))
    loaded = FluxPipeline.from_pretrained(os.path.join(full, "pipeline"), torch_dtype=torch.float32)
    state = loaded.transformer.state_dict()
    check(set(exported) == set(state) and all(torch.equal(state[k], exported[k].float()) for k in exported),
          f"(d) FluxPipeline.from_pretrained(pipeline/) holds exactly the {len(exported)} exported tensors")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtune", required=True)
    parser.add_argument("--fixtures", required=True)
    parser.add_argument("--ref", help="tests/data/ref: adds the Flux checks (d)")
    parser.add_argument("--keep", help="work in this folder and keep it")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "2"))))
    work = args.keep or tempfile.mkdtemp(prefix="dtune_diffusers_check_")
    os.makedirs(work, exist_ok=True)
    log = os.path.join(work, "dtune.log")
    config = write_workspace(work, args.fixtures)
    check_lora(args, work, config, log)
    check_full(args, work, config, log)
    if args.ref:
        check_flux(args, work, config, log)
    if failures:
        print(f"check_diffusers_exports: {len(failures)} check(s) failed; dtune's log: {log}", file=sys.stderr)
        return 1
    if not args.keep:
        import shutil
        shutil.rmtree(work)
    print("check_diffusers_exports: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

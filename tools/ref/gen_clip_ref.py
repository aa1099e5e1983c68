#!/usr/bin/env python3
"""Reference data for tests/report/test_clip_score.cpp: a tiny CLIPModel and the CLIP score.

The tiny CLIPModel's text tower is the shared fixture's tiny-sdxl/text_encoder (so its 6 MB token
table is not committed twice); its vision tower (image 32, patch 8, 2 layers, width 24) and both
projections are random and saved to tests/data/ref/tiny-clip-vision.safetensors with
tiny-clip-config.json, the config.json of the assembled CLIPModel. The test assembles the same
folder (text_model.* from the fixture, the rest from this file).

tests/data/ref/clip_score_io.safetensors holds, for two images (float [3, H, W] in [0, 255], one
wide and one tall) and two prompts (ids from the fixture's tokenizer, padded to 77):
  pixel_values  the preprocessing of transformers' CLIPImageProcessor torchvision backend, run here
                with the same torch ops torchvision runs (interpolate bicubic antialias, centre crop
                int((h - s) / 2), normalise by 255·mean and 255·std)
  image_features / text_features   transformers' CLIPModel (vision/text tower + projection)
  scores        torchmetrics' clip_score per (image, prompt) pair: max(100 · cos, 0)

Usage: python3 tools/ref/gen_clip_ref.py <fixtures dir> [out_dir]   (default tests/data/ref)
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

MEAN = [0.48145466, 0.4578275, 0.40821073]
STD = [0.26862954, 0.26130258, 0.27577711]


def preprocess(image, size):
    h, w = image.shape[-2:]
    short, long = (h, w) if h <= w else (w, h)
    new_long = int(size * long / short)
    out_h, out_w = (size, new_long) if h <= w else (new_long, size)
    x = F.interpolate(image[None].float(), size=(out_h, out_w), mode="bicubic", align_corners=False,
                      antialias=True)[0]
    top, left = int((out_h - size) / 2.0), int((out_w - size) / 2.0)
    x = x[:, top:top + size, left:left + size]
    mean = torch.tensor(MEAN) * (1.0 / (1 / 255))
    std = torch.tensor(STD) * (1.0 / (1 / 255))
    return (x - mean[:, None, None]) / std[:, None, None]


def main(fixtures, out):
    te_dir = os.path.join(fixtures, "tiny-sdxl", "text_encoder")
    text_config = json.load(open(os.path.join(te_dir, "config.json")))
    vision_config = {"hidden_size": 24, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "image_size": 32, "patch_size": 8, "num_channels": 3, "hidden_act": "quick_gelu",
                     "layer_norm_eps": 1e-5}
    config = CLIPConfig(text_config={k: v for k, v in text_config.items() if k not in ("architectures", "dtype")},
                        vision_config=vision_config, projection_dim=16)
    torch.manual_seed(0)
    model = CLIPModel(config).eval()
    text_state = {("text_model." + k if not k.startswith("text_model.") else k): v
                  for k, v in load_file(os.path.join(te_dir, "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(text_state, strict=False)
    assert not unexpected, unexpected
    assert all(not k.startswith("text_model.") for k in missing), missing
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("text_model."):
                p.copy_(torch.randn_like(p) * (0.5 if p.dim() > 1 else 0.1))
    own = {k: v.contiguous() for k, v in model.state_dict().items()
           if not k.startswith("text_model.") and not k.endswith("position_ids")}
    save_file(own, os.path.join(out, "tiny-clip-vision.safetensors"))
    with open(os.path.join(out, "tiny-clip-config.json"), "w") as f:
        f.write(config.to_json_string())

    g = torch.Generator().manual_seed(3)
    images = [torch.randint(0, 256, (3, 40, 56), generator=g).float(),
              torch.randint(0, 256, (3, 64, 48), generator=g).float()]
    tok = CLIPTokenizer.from_pretrained(os.path.join(fixtures, "tiny-sdxl", "tokenizer"))
    prompts = ["a photo of a cat", "a red circle on a blue background"]
    ids = tok(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    pixels = torch.stack([preprocess(im, 32) for im in images])
    with torch.no_grad():
        img = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
        txt = model.text_projection(model.text_model(input_ids=ids).pooler_output)
    scores = 100 * (F.normalize(img, dim=-1)[:, None, :] * F.normalize(txt, dim=-1)[None, :, :]).sum(-1)
    scores = scores.clamp(min=0)
    save_file({"image_0": images[0], "image_1": images[1], "input_ids": ids, "pixel_values": pixels,
               "image_features": img, "text_features": txt, "scores": scores.contiguous()},
              os.path.join(out, "clip_score_io.safetensors"))
    print("scores", scores.tolist())


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "tests/data/ref")

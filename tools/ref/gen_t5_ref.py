#!/usr/bin/env python3
"""Reference data for tests/models/test_t5_encoder_unit.cpp: a tiny, randomly initialised
transformers T5EncoderModel (the T5 v1.1 architecture Flux.1 uses as text_encoder_2, at toy width:
gated-gelu feed-forward, relative attention bias in the first block only, RMS layer norms) and what
transformers computes with it.

Writes tests/data/ref/tiny-t5/ (config.json + model.safetensors, a transformers folder as
google/t5-v1_1-xxl or FLUX.1's text_encoder_2 is one) and tests/data/ref/t5_io.safetensors:
  input_ids        [2, 11] int64, random ids in [0, vocab)
  attention_mask   [2, 11] int64, row 0 all ones, row 1 with 4 trailing zeros (padding)
  last_hidden_state         [2, 11, 32]  T5EncoderModel(input_ids).last_hidden_state (no mask)
  last_hidden_state_masked  [2, 11, 32]  the same with attention_mask
Every weight is random and non-zero: linears normal * 0.7 / sqrt(fan_in), the token table and the
relative attention bias normal, the layer norms 1 + normal * 0.5. At this scale the hidden states stay
of order 1 (T5 does not scale q.k by 1/sqrt(d_kv)), so a bfloat16 run stays within ~1% of float32 and
the test's bf16 check can be tight.
Float32 on the CPU, transformers' default (sdpa) attention.

Usage: python3 tools/ref/gen_t5_ref.py [out_dir]      (default tests/data/ref)
"""
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import T5Config, T5EncoderModel


def main(out):
    torch.manual_seed(0)
    config = T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16,
                      feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6)
    model = T5EncoderModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():  # the tied embedding is visited once
            noise = torch.randn_like(p)
            if name.endswith("layer_norm.weight"):
                p.copy_(1.0 + 0.5 * noise)
            elif name.split(".")[-2] in ("q", "k", "v", "o", "wi_0", "wi_1", "wo"):
                p.copy_(noise * 0.7 / p.shape[1] ** 0.5)  # linears: activations of order 1
            else:
                p.copy_(noise)  # token table and relative attention bias
    model.eval()
    model.save_pretrained(os.path.join(out, "tiny-t5"), safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, config.vocab_size, (2, 11), generator=g, dtype=torch.int64)
    attention_mask = torch.ones(2, 11, dtype=torch.int64)
    attention_mask[1, -4:] = 0
    with torch.no_grad():
        plain = model(input_ids=input_ids).last_hidden_state
        masked = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    save_file({"input_ids": input_ids, "attention_mask": attention_mask,
               "last_hidden_state": plain.contiguous(), "last_hidden_state_masked": masked.contiguous()},
              os.path.join(out, "t5_io.safetensors"))
    print("last_hidden_state", tuple(plain.shape), "range", float(plain.min()), float(plain.max()),
          "masked differs by", float((plain - masked).abs().max()))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/ref")

#!/usr/bin/env python3
"""Reference plans for tests/diffusion/test_scheduled_sampling.cpp: SimpleTuner's own
build_rollout_schedule (simpletuner/helpers/scheduled_sampling/plan.py, commit bc8e6ab), run
unchanged from a checkout, for several seeds, batch sizes, strategies and probabilities. The
global CPU generator is seeded before each call; dtune draws from a CPU generator seeded alike, so
the plans must match draw for draw.

Usage:
  git -C <SimpleTuner git dir> archive bc8e6ab simpletuner/helpers | tar -x -C /tmp/st
  python3 tools/ref/scheduled_sampling_reference.py /tmp/st > tests/data/ref/scheduled_sampling_reference.json
"""
import importlib.util
import json
import os
import sys

import torch


def main(root):
    path = os.path.join(root, "simpletuner", "helpers", "scheduled_sampling", "plan.py")
    spec = importlib.util.spec_from_file_location("st_plan", path)
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    cases = []
    for seed, batch, offset, strategy, prob in [
        (0, 8, 10, "uniform", 1.0), (1, 8, 10, "uniform", 0.5), (2, 16, 25, "biased_early", 0.75),
        (3, 16, 25, "biased_late", 1.0), (4, 4, 3, "uniform", 0.0), (5, 12, 40, "biased_late", 0.3),
    ]:
        g = torch.Generator().manual_seed(100 + seed)
        base = torch.randint(0, 1000, (batch,), generator=g)
        base[0] = 995  # near the end: the source is clamped to T - 1
        torch.manual_seed(seed)
        p = plan.build_rollout_schedule(num_train_timesteps=1000, batch_size=batch, max_step_offset=offset,
                                        device="cpu", base_timesteps=base, strategy=strategy,
                                        apply_probability=prob)
        cases.append({"seed": seed, "max_step_offset": offset, "strategy": strategy, "probability": prob,
                      "base": base.tolist(), "offsets": p.rollout_steps.tolist(),
                      "source": p.source_timesteps.tolist(), "target": p.target_timesteps.tolist()})
    json.dump({"simpletuner_commit": "bc8e6ab", "num_train_timesteps": 1000, "cases": cases}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main(sys.argv[1])

#!/usr/bin/env python3
# Prints tools/gpu/perf_pass.sh's table from its $OUT: each dtune mode (dtune.jsonl) next to the
# diffusers mode it extends (the per-mode lines of diffusers.log: lora4cg -> lora4, full4bfgccg ->
# full4gc, full4bfcg -> full4gc, i.e. dtune-only suffixes cg/cl/bf dropped and gc kept; a dtune
# mode without gc is compared with the baseline's gc mode of that batch when the baseline ran no
# plain one), the unfused A/B rows (dtune_unfused.jsonl) and the gradient_checkpointing_interval rows
# (dtune_gc<N>.jsonl), the channels-last rows (dtune_cl.jsonl). Usage: perf_table.py OUT
import json, os, sys

out = sys.argv[1]


def jsonl(name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return {}
    rows = (json.loads(l) for l in open(path) if l.startswith("{"))
    return {r["mode"]: r for r in rows if "mode" in r}


def baseline():
    path, res = os.path.join(out, "diffusers.log"), {}
    if os.path.exists(path):
        for line in open(path):
            head, _, rest = line.partition(" ")
            if rest.startswith("{"):
                res[head] = json.loads(rest)
    return res


def base_of(mode, base):
    core = mode
    for sfx in ("cg", "cl", "bf"):
        core = core.replace(sfx, "")
    if core in base:
        return core
    return core + "gc" if core + "gc" in base else None


ours, unfused, base = jsonl("dtune.jsonl"), jsonl("dtune_unfused.jsonl"), baseline()
print(f"{'dtune mode':12} {'ms':>7} {'img/s':>6} {'GiB':>5} {'MFU':>5} | {'diffusers':10} {'ms':>7} {'GiB':>5} | {'ratio':>5}")
for mode, r in ours.items():
    b = base_of(mode, base)
    e = base.get(b, {}) if b else {}
    line = f"{mode:12} {r['ms_step_median']:7.1f} {r['img_per_s']:6.2f} {r['peak_gib']:5.1f} {r['mfu']:5.2f} | "
    if "ms_step_median" in e:
        line += f"{b:10} {e['ms_step_median']:7.1f} {e['peak_gib']:5.1f} | {e['ms_step_median'] / r['ms_step_median']:5.2f}"
    else:
        line += f"{(b or '-'):10} {e.get('error', '-'):>7}"
    print(line)
for name in sorted(os.listdir(out)):
    if not (name.startswith("dtune_gc") and name.endswith(".jsonl")):
        continue
    n = name[len("dtune_gc"):-len(".jsonl")]
    for mode, r in jsonl(name).items():
        b = base_of(mode, base)
        e = base.get(b, {}) if b else {}
        ratio = f"{e['ms_step_median'] / r['ms_step_median']:.2f}x {b}" if "ms_step_median" in e else ""
        print(f"{mode} gc interval {n}: {r['ms_step_median']:7.1f} ms {r['peak_gib']:5.1f} GiB "
              f"({r.get('checkpointed_blocks', '?')} of {r.get('checkpointable_blocks', '?')} blocks) {ratio}")
for mode, r in jsonl("dtune_cl.jsonl").items():
    plain = ours.get(mode.replace("cl", ""))
    vs = f"vs {plain['ms_step_median']:.1f} ms NCHW" if plain else ""
    print(f"channels-last + NHWC GroupNorm {mode}: {r['ms_step_median']:7.1f} ms {r['peak_gib']:5.1f} GiB {vs}")
for mode, r in unfused.items():
    f = ours.get(mode)
    gain = f"{r['ms_step_median'] / f['ms_step_median']:.2f}x faster fused" if f else ""
    print(f"unfused {mode:12} {r['ms_step_median']:7.1f} ms {r['peak_gib']:5.1f} GiB  {gain}")

#!/usr/bin/env python3
# Summarises a Chrome trace written by bench_train_step --profile (Kineto, GPU activity only) into
# where GPU time goes per step: busy vs idle over the traced span, time by kernel family, and the
# kernels that cost most; for data-parallel traces also how much collective time no other kernel
# hides, where in the window that time falls, the first 30 ms of the step after the first optimizer
# step kernel by kernel, and the gap before the optimizer.
# Usage: summarize_trace.py trace_lora4.json [--steps 2] [--top 25]
import argparse, collections, json, re

FAMILIES = [  # first match wins
    ("attention", r"flash|fmha|sdpa|attention"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm80_|matmul"),
    ("conv", r"conv|implicit_convolve|winograd|fft|dgrad|wgrad|fprop"),
    ("groupnorm", r"group_norm|groupnorm|RowwiseMoments|ComputeFusedParams|GroupNorm|Moments"),
    ("layernorm", r"layer_norm|LayerNorm"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("reduce", r"reduce"),
    ("copy/cast", r"copy|Memcpy|Memset|\bcast|convert"),  # \b: not gpu_kernel_impl_nocast
    ("elementwise", r"elementwise|vectorized|unrolled|Activation|gelu|silu"),
]


def family(name):
    for fam, pattern in FAMILIES:
        if re.search(pattern, name, re.IGNORECASE):
            return fam
    return "other"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--csv", help="write every kernel name with its family, launches and time per step")
    a = p.parse_args()
    events = json.load(open(a.trace))
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat", "").lower() in
               ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        print(a.trace, ": no GPU events")
        return
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    busy = sum(e["dur"] for e in kernels)
    per_fam, per_name, count = collections.Counter(), collections.Counter(), collections.Counter()
    for e in kernels:
        per_fam[family(e["name"])] += e["dur"]
        per_name[e["name"][:110]] += e["dur"]
        count[e["name"][:110]] += 1
    s = a.steps
    print(f"{a.trace}: per step span {(end - start) / s / 1e3:.1f} ms, GPU busy {busy / s / 1e3:.1f} ms "
          f"({100 * busy / (end - start):.0f}%), {len(kernels) // s} kernels")
    for fam, us in per_fam.most_common():
        print(f"  {fam:12} {us / s / 1e3:8.2f} ms  {100 * us / busy:5.1f}%")
    by_family = collections.defaultdict(list)
    for name, us in per_name.most_common():
        by_family[family(name)].append((name, us))
    print("  top kernels per family (ms per step, launches per step):")
    for fam, _ in per_fam.most_common():
        for name, us in by_family[fam][:4]:
            print(f"    {fam:11} {us / s / 1e3:7.2f} {count[name] // s:5d}  {name}")
    print("  top kernels (ms per step, launches per step):")
    for name, us in per_name.most_common(a.top):
        print(f"    {us / s / 1e3:7.2f} {count[name] // s:5d}  {name}")
    sizes(kernels, s)
    if a.csv:
        with open(a.csv, "w") as f:
            f.write("family,launches_per_step,ms_per_step,mean_us,name\n")
            for name, us in per_name.most_common():
                quoted = '"' + name.replace('"', "'") + '"'
                f.write(f"{family(name)},{count[name] / s:.1f},{us / s / 1e3:.3f},{us / count[name]:.2f},{quoted}\n")
    overlap(kernels, s)


def sizes(kernels, steps):
    """How much of the step small kernels take: launches and time per duration class. Inside a CUDA
    graph each launch still costs a microsecond or two of ramp-up, so many short kernels are a cost
    that fusing removes even where their bytes are few."""
    edges = [2, 5, 10, 20, 50, 100, 1000, float("inf")]
    n, t = collections.Counter(), collections.Counter()
    for e in kernels:
        cls = next(x for x in edges if e["dur"] < x)
        n[cls] += 1
        t[cls] += e["dur"]
    print("  kernels by duration (launches per step, ms per step):")
    lo = 0
    for x in edges:
        hi = "inf" if x == float("inf") else f"{x:g}"
        print(f"    {lo:>5g}-{hi:<5} us {n[x] // steps:6d} {t[x] / steps / 1e3:8.2f}")
        lo = x


def union(intervals):
    """Sorted, merged [start, end) intervals."""
    out = []
    for b, e in sorted(intervals):
        if out and b <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([b, e])
    return out


def length(intervals):
    return sum(e - b for b, e in intervals)


def subtract(a, b):
    """Merged intervals a minus merged intervals b."""
    out, j = [], 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append([cur, b[k][0]])
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append([cur, e])
    return out


def timeline(exposed, kernels, bins=20):
    """Where in the profiled window the collectives run alone: ms per bin of 1/bins of the window,
    with the bins where an optimizer step starts marked."""
    t0 = min(e["ts"] for e in kernels)
    t1 = max(e["ts"] + e["dur"] for e in kernels)
    width = (t1 - t0) / bins
    per = [0.0] * bins
    for s, e in exposed:
        for i in range(int((s - t0) // width), min(bins - 1, int((e - t0) // width)) + 1):
            lo, hi = t0 + i * width, t0 + (i + 1) * width
            per[i] += max(0.0, min(e, hi) - max(s, lo))
    opt = [e["ts"] for e in kernels if family(e["name"]) == "optimizer"]
    marks = {min(bins - 1, int((t - t0) // width)) for t in opt}
    cells = " ".join(f"{v / 1e3:4.1f}{'*' if i in marks else ' '}" for i, v in enumerate(per))
    print(f"  collectives alone by twentieths of the window ({width / 1e3:.1f} ms each; * optimizer): {cells}")


def step_head(kernels, window_ms=30.0, lines=40):
    """The first window_ms after the first optimizer step in the trace (the start of the next step):
    collectives one by one, the other kernels merged into runs between them, per stream."""
    opt = sorted(e["ts"] + e["dur"] for e in kernels if family(e["name"]) == "optimizer")
    if not opt:
        return
    end_opt = opt[0]
    for t in opt[1:]:  # the end of the first optimizer cluster
        if t - end_opt > 20e3:
            break
        end_opt = t
    later = sorted((e for e in kernels if end_opt <= e["ts"] < end_opt + window_ms * 1e3), key=lambda e: e["ts"])
    print(f"  the next step's first {window_ms:.0f} ms (ms from the optimizer's end; stream; kernel):")
    run, shown = None, 0

    def flush():
        nonlocal run, shown
        if run and shown < lines:
            print(f"    {(run[0] - end_opt) / 1e3:7.2f}-{(run[1] - end_opt) / 1e3:7.2f}  s{run[3]}  "
                  f"{run[2]} other kernels ({run[4] / 1e3:.2f} ms busy)")
            shown += 1
        run = None

    for e in later:
        stream = e.get("args", {}).get("stream", "?")
        if "nccl" in e["name"].lower():
            flush()
            if shown < lines:
                print(f"    {(e['ts'] - end_opt) / 1e3:7.2f}-{(e['ts'] + e['dur'] - end_opt) / 1e3:7.2f}  s{stream}  "
                      f"{e['name'][:60]}")
                shown += 1
            continue
        if run is None:
            run = [e["ts"], e["ts"] + e["dur"], 0, stream, 0]
        run[1] = max(run[1], e["ts"] + e["dur"])
        run[2] += 1
        run[4] += e["dur"]
    flush()


def overlap(kernels, steps):
    """Data-parallel steps: how much of the collectives' time no other kernel hides, and how long
    each step's optimizer waits after the last compute kernel before it (the exposed tail)."""
    nccl = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()]
    if not nccl:
        return
    comp = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()]
    u_nccl, u_comp = union(nccl), union(comp)
    both = length(union(nccl + comp))
    exposed = both - length(u_comp)
    print(f"  collectives: {length(u_nccl) / steps / 1e3:.2f} ms per step on the GPU, "
          f"{exposed / steps / 1e3:.2f} ms of it with no other kernel running")
    timeline(subtract(u_nccl, u_comp), kernels)
    step_head(kernels)
    opt = sorted(e["ts"] for e in kernels if family(e["name"]) == "optimizer")
    starts = [t for i, t in enumerate(opt) if i == 0 or t - opt[i - 1] > 20e3]  # one per step
    for t_opt in starts:
        before = [e for e in kernels if e["ts"] + e["dur"] <= t_opt]
        last_comp = max((e["ts"] + e["dur"] for e in before if "nccl" not in e["name"].lower()), default=None)
        last_nccl = max((e["ts"] + e["dur"] for e in before if "nccl" in e["name"].lower()), default=None)
        if last_comp is None or last_nccl is None:
            continue
        print(f"  step tail: optimizer starts {(t_opt - last_comp) / 1e3:.2f} ms after the last kernel before it "
              f"that is not a collective; the last collective before it ends "
              f"{(last_nccl - last_comp) / 1e3:+.2f} ms from that kernel")


if __name__ == "__main__":
    main()

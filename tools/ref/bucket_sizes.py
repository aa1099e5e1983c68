#!/usr/bin/env python3
"""Reference bucket sizes for tests/data/test_bucket_reference.cpp.

Recomputes SimpleTuner's size calculators (SIMPLETUNER.md §3.1) in plain Python, where round()
(half to even, exact on the binary value) and int() (truncation) are the native semantics the C++
code has to emulate. Output: tests/data/ref/bucket_sizes.json (small; regenerate with
`python3 tools/ref/bucket_sizes.py > tests/data/ref/bucket_sizes.json`).
"""
import json
import math
import random

ALIGN = 64


def to_multiple(value):
    return max(int(round(value / ALIGN) * ALIGN), ALIGN)


def by_edge(ar, res, orig):
    w0, h0 = orig
    if w0 < h0:
        wi, hi = res, int(res / ar)
    else:
        hi, wi = res, int(res * ar)
    wt, ht = to_multiple(wi), to_multiple(hi)
    if wi < wt or hi < ht:
        grow = max(wt - wi, ht - hi)
        wi, hi = wi + grow, hi + grow
    return (wt, ht), (wi, hi), round(wt / ht, 2)


def by_area(ar, mp, orig, pinned):
    edge = to_multiple(int(math.sqrt(mp * 1e6)))
    if ar == 1.0:
        return (edge, edge), (edge, edge) if orig[0] == orig[1] else tuple(orig), 1.0
    wt, ht = to_multiple(edge * math.sqrt(ar)), to_multiple(edge / math.sqrt(ar))
    if wt < ht:
        wi, hi = wt, int(wt / ar)
    else:
        hi, wi = ht, int(ht * ar)
    key = str(round(wt / ht, 2))
    if key in pinned:
        wt, ht = pinned[key]
    else:
        pinned[key] = (wt, ht)
    if wt > wi or ht > hi:
        if wt > wi:
            wd = wt - wi
            hd = int(wd / ar)
        else:
            hd = ht - hi
            wd = int(hd * ar)
        wi, hi = wi + wd, hi + hd
    return (wt, ht), (wi, hi), float(key)


def main():
    rng = random.Random(20261126)
    sizes = [(1920, 1080), (1080, 1920), (1500, 1000), (800, 1200), (2048, 512), (1000, 1000)]
    while len(sizes) < 400:
        w = rng.randint(200, 6000)
        h = max(64, int(w / math.exp(rng.uniform(math.log(0.25), math.log(4.0)))))
        sizes.append((w, h))
    pinned = {}
    cases = []
    for w, h in sizes:
        ar = round(w / h, 2)
        at, ai, ab = by_area(ar, 1.048576, (w, h), pinned)
        pt, pi, pb = by_edge(ar, 1024, (w, h))
        cases.append({"original": [w, h], "aspect": ar,
                      "area": {"target": list(at), "intermediary": list(ai), "bucket": ab},
                      "pixel": {"target": list(pt), "intermediary": list(pi), "bucket": pb}})
    print(json.dumps({"megapixels": 1.048576, "pixel_resolution": 1024, "alignment": ALIGN, "cases": cases}))


if __name__ == "__main__":
    main()

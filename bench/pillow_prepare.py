#!/usr/bin/env python3
"""Pillow baseline for bench_image_prepare: same files, same geometry, same thread count.

Usage: pillow_prepare.py --dir DIR --resize W H --crop TOP LEFT TW TH [--threads T]
Prints one JSON line like the C++ bench. Pillow releases the GIL in decode and resize, so a
thread pool is a fair comparison.
"""
import argparse, glob, json, os, time
from concurrent.futures import ThreadPoolExecutor
from PIL import Image, ImageOps


def prepare(path, resize, crop):
    with Image.open(path) as im:
        im = ImageOps.exif_transpose(im.convert("RGB"))
        im = im.resize(tuple(resize), Image.Resampling.LANCZOS)
        top, left, tw, th = crop
        im = im.crop((left, top, left + tw, top + th))
        return im.getpixel((tw // 2, th // 2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--resize", type=int, nargs=2, required=True)
    ap.add_argument("--crop", type=int, nargs=4, required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    paths = sorted(glob.glob(os.path.join(a.dir, "photo_*.jpg")))
    with ThreadPoolExecutor(a.threads) as pool:
        list(pool.map(lambda p: prepare(p, a.resize, a.crop), paths))  # warm
        t0 = time.perf_counter()
        list(pool.map(lambda p: prepare(p, a.resize, a.crop), paths))
        s = time.perf_counter() - t0
    print(json.dumps({"bench": "image_prepare", "impl": "pillow", "files": len(paths), "threads": a.threads,
                      "seconds": round(s, 3), "images_per_s": round(len(paths) / s, 2),
                      "images_per_s_per_core": round(len(paths) / s / a.threads, 2)}))


if __name__ == "__main__":
    main()

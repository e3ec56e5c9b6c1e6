#!/bin/sh
# Prints the base image to build docker/'s images on: debian:bookworm-slim when it is here or can
# be pulled, else a Debian bookworm minbase made locally with debootstrap from this host's
# Debian mirror (a machine with no image registry, but with Debian's package mirror) and
# imported as hvd-sparse-base:bookworm. Both images' Dockerfiles take it as BASE. Needs root
# for debootstrap (the local fallback only).
set -eu
OFFICIAL=debian:bookworm-slim
LOCAL=hvd-sparse-base:bookworm
for img in "$OFFICIAL" "$LOCAL"; do
  if docker image inspect "$img" > /dev/null 2>&1; then echo "$img"; exit 0; fi
done
if timeout 60 docker pull -q "$OFFICIAL" > /dev/null 2>&1; then echo "$OFFICIAL"; exit 0; fi
# The first deb822 or one-line source naming a Debian archive (not debian-security).
MIRROR=$(grep -hoE 'https?://[^ ]*/debian/?( |$)' /etc/apt/sources.list.d/*.sources \
           /etc/apt/sources.list 2>/dev/null | head -n1 | tr -d ' ') || true
MIRROR=${MIRROR:-http://deb.debian.org/debian}
DIR=$(mktemp -d /var/tmp/hvd-sparse-base.XXXXXX)
trap 'rm -rf "$DIR"' EXIT
echo "base-image: no $OFFICIAL (no registry): debootstrap bookworm from $MIRROR (~1 min)" >&2
timeout 900 debootstrap --variant=minbase bookworm "$DIR" "$MIRROR" > "$DIR.log" 2>&1 \
  || { tail -20 "$DIR.log" >&2; rm -f "$DIR.log"; exit 1; }
rm -f "$DIR.log"
# As the official slim image: no docs, man pages or translations, now or from later installs.
printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
  'path-exclude /usr/share/man/*' 'path-exclude /usr/share/locale/*' \
  > "$DIR/etc/dpkg/dpkg.cfg.d/docker-slim"
find "$DIR/usr/share/doc" -type f ! -name copyright -delete
rm -rf "$DIR"/usr/share/man/* "$DIR"/usr/share/locale/* "$DIR"/var/cache/apt/*.bin \
  "$DIR"/var/cache/apt/archives/*.deb "$DIR"/var/lib/apt/lists/*
tar -C "$DIR" -c . | docker import -c 'CMD ["bash"]' - "$LOCAL" > /dev/null
echo "$LOCAL"

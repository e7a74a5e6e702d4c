#!/usr/bin/env bash
# Run python3.13 (or, with IN_TRIXIE_CMD set, that command) inside the Debian 13 root that
# scripts/python313.sh made, with the project at the same path, so that a venv made through this
# wrapper works unchanged from inside the root: bash scripts/in_trixie.sh -m venv .venv-newest
# gives a venv whose bin/ scripts must then also be run through this wrapper
# (IN_TRIXIE_CMD=.venv-newest/bin/pytest bash scripts/in_trixie.sh -q).
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
ROOT="$HERE/.cache/trixie"
bind() {  # bind <host path> : mount it at the same path inside the root, once
  local p=$1
  [ -e "$p" ] || return 0
  if [ -d "$p" ]; then mkdir -p "$ROOT$p"; else mkdir -p "$(dirname "$ROOT$p")"; touch "$ROOT$p"; fi
  mountpoint -q "$ROOT$p" 2>/dev/null || mount --bind "$p" "$ROOT$p"
}
for p in /proc /sys /dev /dev/shm /tmp "$HERE" "$(dirname "$HERE")/shared" /etc/pip.conf /etc/xdg/pip \
  /opt/wheels /opt/pypi /opt/pypi-more /etc/resolv.conf /etc/hosts; do
  bind "$p"
done
cmd=${IN_TRIXIE_CMD:-/usr/bin/python3.13}
exec chroot "$ROOT" /usr/bin/env -C "$PWD" PATH="$(dirname "$cmd"):/usr/local/bin:/usr/bin:/bin" \
  HOME=/root "$cmd" "$@"

#!/usr/bin/env bash
# Run python3.13 (or, with IN_TRIXIE_CMD set, that command) inside the Debian 13 root that
# scripts/python313.sh made, with the project, ../shared, /tmp and pip's configuration bound in
# at the same paths, so that paths mean the same inside and out. The binds are undone when the
# command ends (also on failure), so that nothing under .cache/trixie points at host files.
#   bash scripts/in_trixie.sh -c 'import sys; print(sys.version)'
#   IN_TRIXIE_CMD=/bin/bash JAXEXP_STAGES=newest-here bash scripts/in_trixie.sh scripts/test.sh
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
ROOT="$HERE/.cache/trixie"
[ -x "$ROOT/usr/bin/python3.13" ] || { echo "no Debian 13 root at $ROOT (scripts/python313.sh)" >&2; exit 2; }

unbind_all() {  # every mount under the root, deepest first
  { grep -o " $ROOT/[^ ]*" /proc/mounts || true; } | sort -r | while read -r m; do umount -l "$m" || true; done
}
bind() {  # bind <host path>: mount it at the same path inside the root
  local p=$1
  [ -e "$p" ] || return 0
  if [ -d "$p" ]; then mkdir -p "$ROOT$p"; else mkdir -p "$(dirname "$ROOT$p")"; touch "$ROOT$p"; fi
  mount --bind "$p" "$ROOT$p"
}
bind_shared() {  # ../shared at its path, and, when it is a symlink, its target at the target's
  local link real
  link="$(dirname "$HERE")/shared"
  [ -e "$link" ] || return 0
  real=$(realpath "$link")
  [ "$real" = "$link" ] && { bind "$link"; return 0; }
  bind "$real"  # an absolute symlink resolves inside the root too
  # seen through a bound directory (/tmp) the symlink is there already; else mount the target
  if [ ! -L "$ROOT$link" ] && [ ! -e "$ROOT$link" ]; then
    mkdir -p "$ROOT$link"
    mount --bind "$real" "$ROOT$link"
  fi
}
unbind_all
trap unbind_all EXIT
for p in /proc /sys /dev /dev/pts /dev/shm /tmp "$HERE" /etc/pip.conf \
  /etc/xdg/pip /opt/wheels /opt/pypi /opt/pypi-more /etc/resolv.conf /etc/hosts /etc/ssl/certs; do
  bind "$p"
done
bind_shared
cmd=${IN_TRIXIE_CMD:-/usr/bin/python3.13}
rc=0
chroot "$ROOT" /usr/bin/env -C "$PWD" PATH="/usr/local/bin:/usr/bin:/bin" HOME=/root \
  "$cmd" "$@" || rc=$?
exit $rc

#!/usr/bin/env bash
# Print the path of a CPython 3.13 interpreter with venv and pip, finding or making one:
#   1. $JAXEXP_PYTHON313, if set;
#   2. python3.13 on PATH;
#   3. pyenv's 3.13.x (this machine kind carries CPython 3.13.0 there);
#   4. otherwise a Debian 13 ("trixie") root made with debootstrap under .cache/trixie (2-3 min,
#      about 0.4 GB), from the apt mirror the host already uses; the interpreter printed is then a
#      wrapper that runs the root's python3.13 through chroot with /proc, /dev, /sys, the
#      project and pip's configuration bound in, so `"$(bash scripts/python313.sh)" -m venv DIR`
#      works and the venv's tools run inside the root (see scripts/in_trixie.sh).
# Usage: PY313=$(bash scripts/python313.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

ok() { "$1" -c 'import sys, venv, ensurepip; assert sys.version_info[:2] == (3, 13)' 2>/dev/null; }

# JAXEXP_FORCE_TRIXIE=1 skips 1-3 (to test the fallback on a machine that has a 3.13)
[ "${JAXEXP_FORCE_TRIXIE:-0}" = 1 ] || for cand in "${JAXEXP_PYTHON313:-}" "$(command -v python3.13 || true)"; do
  if [ -n "$cand" ] && ok "$cand"; then echo "$cand"; exit 0; fi
done
if [ "${JAXEXP_FORCE_TRIXIE:-0}" != 1 ] && { command -v pyenv >/dev/null 2>&1 || [ -d "${PYENV_ROOT:-$HOME/.pyenv}/versions" ]; }; then
  root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
  for cand in $(ls -d "$root"/versions/3.13*/bin/python3.13 2>/dev/null | sort -V -r); do
    if ok "$cand"; then echo "$cand"; exit 0; fi
  done
fi

# 4. Debian 13 root.
ROOT="$PWD/.cache/trixie"
if [ ! -x "$ROOT/usr/bin/python3.13" ]; then
  echo "python313: no CPython 3.13 found; making a Debian 13 root in $ROOT" >&2
  command -v debootstrap >/dev/null 2>&1 || {
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >&2
  }
  mirror=$(awk '/^URIs:/ && $2 ~ /debian\/?$/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  [ -n "$mirror" ] || mirror=$(awk '/^deb / && $2 ~ /debian\/?$/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  # never remove a root with host directories still bound into it
  { grep -o " $ROOT/[^ ]*" /proc/mounts || true; } | sort -r | while read -r m; do umount -l "$m" || true; done
  if grep -q " $ROOT/" /proc/mounts; then echo "python313: $ROOT still has mounts" >&2; exit 1; fi
  rm -rf "$ROOT"
  debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-dev,gcc,ca-certificates,git,procps \
    trixie "$ROOT" ${mirror:+"$mirror"} >&2
fi
echo "$PWD/scripts/in_trixie.sh"

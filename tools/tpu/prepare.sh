#!/usr/bin/env bash
# Makes a folder that installs tpurec's locked set on a TPU VM without network access. Run it on a machine
# that reaches the package indexes and has the VM's platform (Linux x86_64, Python 3.11), from the checkout's root:
#
#   bash tools/tpu/prepare.sh [--skip NAMES] [--from-vm NAMES] [--test] [--dry-run] [OUT]
#
# OUT (default .tpu) receives
#   wheels/           a wheel of every package pinned in requirements.lock (torch's CPU build, not PyPI's CUDA
#                     one) and libtpu, JAX's TPU runtime, with what it requires (pip's resolution of jax[tpu] at
#                     the locked jax, constrained by the lock: what `pip install "tpurec[tpu]"` adds)
#   requirements.txt  name==version of every package to install on the VM
#   setup.sh          sourced on the VM from the checkout's root: installs requirements.txt from wheels/ with no
#                     index, puts the checkout on PYTHONPATH and lets JAX take the TPU
# Options (NAMES: comma-separated package names):
#   --skip NAMES     left out: packages the VM has installed at the locked versions (jax,jaxlib,libtpu,numpy,...)
#                    or that its runs do not use (libtpu, not in the lock: the release jax[tpu] names)
#   --from-vm NAMES  installed on the VM, from wheels it keeps in a folder that TPUREC_FIND_LINKS names when
#                    setup.sh runs, and not put in wheels/ (torch's CPU wheel alone is about 190 MB)
#   --test           also the test suite's pins (requirements-test.lock: pytest, transformers, ...)
#   --dry-run        print the pip commands and what is left out, download nothing
# Then copy the checkout with OUT to the VM, and there, from the checkout's root:  source OUT/setup.sh
set -euo pipefail
usage() { echo "usage: bash tools/tpu/prepare.sh [--skip NAMES] [--from-vm NAMES] [--test] [--dry-run] [OUT]" >&2; exit 2; }
# PEP 503 normalized name: lower case, runs of -_. as one -.
norm() { tr '[:upper:]' '[:lower:]' <<<"$1" | sed -E 's/[-_.]+/-/g'; }

skip_names="" from_vm="" test=0 dry=0 out=""
while [ $# -gt 0 ]; do
  case $1 in
    --skip | --from-vm)
      [ $# -ge 2 ] && [[ $2 != -* ]] || { echo "$1 needs a comma-separated list of package names" >&2; usage; }
      if [ "$1" = --skip ]; then skip_names=$2; else from_vm=$2; fi
      shift 2 ;;
    --test) test=1; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "unknown option $1" >&2; usage ;;
    *) [ -z "$out" ] || usage; out=$1; shift ;;
  esac
done
out=${out:-.tpu}
[ -f requirements.lock ] || { echo "run from the checkout's root (requirements.lock not found)" >&2; exit 2; }
PY=${PYTHON:-python3}; [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python

locks=(requirements.lock); [ $test = 1 ] && locks+=(requirements-test.lock)
# name==version lines of the locks (comments and blank lines dropped).
pins=$(sed -e 's/#.*//' -e 's/[[:space:]]//g' "${locks[@]}" | grep -v '^$')
declare -A locked=()
for pin in $pins; do locked[$(norm "${pin%%==*}")]=$pin; done
declare -A skip=() elsewhere=()
for name in ${skip_names//,/ }; do skip[$(norm "$name")]=1; done
for name in ${from_vm//,/ }; do elsewhere[$(norm "$name")]=1; done
for name in "${!skip[@]}"; do
  [ -n "${locked[$name]:-}" ] || [ "$name" = libtpu ] || { echo "--skip $name: not pinned in ${locks[*]}" >&2; exit 2; }
done
for name in "${!elsewhere[@]}"; do
  [ -n "${locked[$name]:-}" ] || { echo "--from-vm $name: not pinned in ${locks[*]}" >&2; exit 2; }
done
[ -n "${locked[torch]:-}" ] && [ -n "${locked[jax]:-}" ] || { echo "torch and jax must be pinned in requirements.lock" >&2; exit 2; }

specs=()
for pin in $pins; do
  name=$(norm "${pin%%==*}")
  [ "$name" = torch ] || [ -n "${skip[$name]:-}" ] || [ -n "${elsewhere[$name]:-}" ] || specs+=("$pin")
done
wheels="$out/wheels"
commands=()
# Every pin, as a wheel (packages published only as source are built here, on the VM's platform).
commands+=("$PY -m pip wheel -q --no-deps -w $wheels ${specs[*]}")
# torch's CPU build: PyPI's Linux torch is the CUDA build.
if [ -z "${skip[torch]:-}" ] && [ -z "${elsewhere[torch]:-}" ]; then
  commands+=("$PY -m pip download -q --no-deps --only-binary=:all: -d $wheels --index-url https://download.pytorch.org/whl/cpu ${locked[torch]}")
fi
# JAX's TPU runtime and what it requires, as `pip install tpurec[tpu]` resolves it against the lock.
if [ -z "${skip[libtpu]:-}" ] && [ -z "${elsewhere[libtpu]:-}" ]; then
  commands+=("$PY -m pip download -q --only-binary=:all: -d $wheels ${locks[*]/#/-c } jax[tpu]==${locked[jax]#*==}")
fi
left_out=$(printf '%s\n' "${!skip[@]}" "${!elsewhere[@]}" | sort | tr '\n' ' ')
if [ $dry = 1 ]; then
  printf '%s\n' "${commands[@]}"
  echo "left out: ${left_out% }"
  exit 0
fi

mkdir -p "$wheels"
rm -f "$wheels"/*.whl
set -f  # jax[tpu] is a requirement, not a pattern
for command in "${commands[@]}"; do $command; done
set +f
# Drop what jax[tpu]'s resolution brought that is skipped or comes from the VM.
for file in "$wheels"/*.whl; do
  name=$(norm "$(basename "$file" | cut -d- -f1)")
  if [ -n "${skip[$name]:-}" ] || [ -n "${elsewhere[$name]:-}" ]; then rm -f "$file"; fi
done
{
  for file in "$wheels"/*.whl; do basename "$file" | awk -F- '{ print $1 "==" $2 }'; done
  for name in "${!elsewhere[@]}"; do
    if [ -n "${locked[$name]:-}" ]; then echo "${locked[$name]}"; fi
  done
} | sort -f >"$out/requirements.txt"
cp "$(dirname "${BASH_SOURCE[0]}")/setup.sh" "$out/setup.sh"
echo "prepared $out: $(ls "$wheels" | wc -l) wheels ($(du -sh "$wheels" | cut -f1)), $(wc -l <"$out/requirements.txt") packages to install${left_out:+; left out: ${left_out% }}"

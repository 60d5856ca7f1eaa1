# Sourced by bash on the TPU VM, from the checkout's root:  source .tpu/setup.sh   (the folder prepare.sh made)
# Installs requirements.txt from the wheels beside this file with no package index (pip --no-index --no-deps: the
# list is the whole locked set) into a folder of its own, TPUREC_SITE (default /tmp/tpurec-site), so the VM's
# Python stays as it is; wheels that prepare.sh left out with --from-vm come from TPUREC_FIND_LINKS.
# Then puts that folder and the checkout on PYTHONPATH, unsets JAX_PLATFORMS and XLA_FLAGS so that JAX takes the
# TPU, keeps compiled programs in TPUREC_CACHE_DIR (default /tmp/tpurec-cache) and prints the platform tpurec found
# (tpu) with the chip's device kind. PYTHON names the interpreter (default python3).
if [ -z "${BASH_VERSION:-}" ]; then echo "source .tpu/setup.sh from bash" >&2; return 2; fi
_tpurec_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_tpurec_site=${TPUREC_SITE:-/tmp/tpurec-site}
_tpurec_t0=$(date +%s)
if PIP_CONFIG_FILE=/dev/null "${PYTHON:-python3}" -m pip install --isolated -q --no-index --no-deps \
  --only-binary=:all: --no-compile --no-cache-dir --upgrade --target "$_tpurec_site" \
  --find-links "$_tpurec_dir/wheels" ${TPUREC_FIND_LINKS:+--find-links "$TPUREC_FIND_LINKS"} \
  -r "$_tpurec_dir/requirements.txt" >"$_tpurec_dir/setup.log" 2>&1; then
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$_tpurec_site:$PWD"
  export PYTHONUNBUFFERED=1 TPUREC_CACHE_DIR="${TPUREC_CACHE_DIR:-/tmp/tpurec-cache}"
  unset JAX_PLATFORMS XLA_FLAGS
  echo "tpurec setup: $(($(date +%s) - _tpurec_t0)) s; $("${PYTHON:-python3}" -c \
    'import jax, tpurec; print("platform", tpurec.platform() + ",", jax.devices()[0].device_kind)')"
else
  echo "installing the wheels failed: see $_tpurec_dir/setup.log" >&2
  tail -5 "$_tpurec_dir/setup.log" >&2
fi
unset _tpurec_dir _tpurec_site _tpurec_t0

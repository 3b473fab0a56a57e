#!/usr/bin/env bash
# The whole GPU suite (pytest -m gpu tests) on the lent machine, in one run, plus the AOTI loader
# diagnosis. That machine has torch and triton but not the test dependencies' pinned versions and no
# network: the wheels constraints.txt names for transformers, huggingface_hub, kernels, peft,
# accelerate, expecttest and their missing needs travel in .whl/ (see the device README's note on
# wheels), installed to /tmp/site.
#
#   bash benchmarks/gpu_tests.sh start DIR   # install, start the suite in its own session, run the
#                                            # diagnosis, then wait up to WAIT_S (default 500) seconds
#   bash benchmarks/gpu_tests.sh wait DIR    # wait for a suite started by an earlier call (same machine)
#
# DIR receives gpu-tests.log (first line: GPU, driver, versions, date, tree), gpu-tests.rc once the
# suite has ended, and diagnose-aoti-load.json.
set -uo pipefail
cd "$(dirname "$0")/.."
action=$1 out=$2
log=/tmp/gpu-tests.log rc=/tmp/gpu-tests.rc
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=1
mkdir -p "$out"
if [ "$action" = start ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
  rm -f "$rc"
  {
    echo "# $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader);" \
      "$(python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)');" \
      "$(date -u +%F); tree of ${TREE:-?}; pytest -m gpu -n ${WORKERS:-14} tests"
  } > "$log"
  setsid bash -c "python3 -m pytest -m gpu -n ${WORKERS:-14} -p no:cacheprovider tests >> $log 2>&1; echo \$? > $rc" < /dev/null &
  python3 benchmarks/diagnostics/diagnose_aoti_load.py --out "$out" > "$out/diagnose-aoti-load.log" 2>&1
fi
for _ in $(seq "${WAIT_S:-500}"); do [ -f "$rc" ] && break; sleep 1; done
cp "$log" "$out/gpu-tests.log"
[ -f "$rc" ] && cp "$rc" "$out/gpu-tests.rc" && echo "suite ended, rc=$(cat $rc)" || echo "suite still running"
tail -5 "$log"

#!/usr/bin/env bash
# The one command for the H200 (the device tool's `run`, with carry: [".peers"]):
#     bash bench/run_h200.sh [extra bench.py options, e.g. --shapes 4x1024 --iters 20]
# 1. If .peers/ holds FlashInfer (built on a CPU machine by ../shared/peers/flashinfer_carry.sh: a trimmed
#    flashinfer-python 0.7.4, its MLA modules precompiled for sm_90a, the apache-tvm-ffi wheel), unpack it into
#    /tmp/site and put that on PYTHONPATH, exactly as that script's header says. Without .peers the FlashInfer rows
#    are reported as skipped, with the import error.
# 2. Run bench.py on the 8 leaderboard shapes, writing bench.json, bench.md and bench.log into $OUT (the device
#    tool brings that folder back), or into results/ where $OUT is unset.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-results}
mkdir -p "$OUT_DIR"

if [ -f .peers/flashinfer_trim.tar.xz ]; then
  mkdir -p /tmp/site
  tar xJf .peers/flashinfer_trim.tar.xz -C /tmp/site
  if [ -f .peers/fi_aot.tar.gz ]; then
    tar xzf .peers/fi_aot.tar.gz -C /tmp/site
  else
    echo "run_h200: no .peers/fi_aot.tar.gz: FlashInfer will compile its MLA modules here (minutes)"
  fi
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/apache_tvm_ffi-*.whl \
    || echo "run_h200: installing the apache-tvm-ffi wheel failed; FlashInfer's import will say why"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "run_h200: no .peers/flashinfer_trim.tar.xz: the FlashInfer rows will be skipped"
fi

export PYTHONUNBUFFERED=1
python3 bench/bench.py --json "$OUT_DIR/bench.json" --markdown "$OUT_DIR/bench.md" "$@" 2>&1 | tee "$OUT_DIR/bench.log"

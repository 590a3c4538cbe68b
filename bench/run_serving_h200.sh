#!/usr/bin/env bash
# The serving grid on the H200 (the device tool's `run`, with carry: [".peers"]):
#     bash bench/run_serving_h200.sh [extra serving.py options, e.g. --rows 128x32k-h128-q2 --iters 20]
# 1. FlashInfer from .peers/ onto PYTHONPATH where it is there (bench/peers_env.sh says how); serving.py itself
#    imports FlashMLA's prebuilt modules from .peers/flashmla/.
# 2. Run serving.py over serving.yml, writing serving.json, serving.md and serving.log into $OUT (the device tool
#    brings that folder back), or into results/ where $OUT is unset (bench/device_run.sh). A method that raises is an
#    ERROR in its row (its traceback in the log) and the others still run; serving.json is rewritten after every row,
#    so a run cut short keeps what it measured. The exit status is serving.py's: 1 when a row is FAIL or ERROR.
source "$(dirname "$0")/device_run.sh"
run_on_device serving serving.py "$@"

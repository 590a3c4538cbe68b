#!/usr/bin/env bash
# The one command for the H200 (the device tool's `run`, with carry: [".peers"]):
#     bash bench/run_h200.sh [extra leaderboard.py options, e.g. --shapes 4x1024 --iters 20]
# 1. FlashInfer from .peers/ onto PYTHONPATH where it is there (bench/peers_env.sh says how).
# 2. Run leaderboard.py on the 8 leaderboard shapes, writing bench.json, bench.md and bench.log into $OUT (the device
#    tool brings that folder back), or into results/ where $OUT is unset (bench/device_run.sh).
source "$(dirname "$0")/device_run.sh"
run_on_device bench leaderboard.py "$@"

# Sourced (not run) by run_h200.sh and run_serving_h200.sh, which it moves to the repository root:
#     run_on_device NAME SCRIPT [options]
# runs `python3 bench/SCRIPT --json DIR/NAME.json --markdown DIR/NAME.md [options]`, its console log in DIR/NAME.log,
# where DIR is $OUT (the device tool brings that folder back) or results/ where $OUT is unset; FlashInfer from .peers/
# goes onto PYTHONPATH first where it is there (peers_env.sh). The status is the script's (pipefail).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

run_on_device() {
  local name=$1 script=$2
  shift 2
  local out_dir=${OUT:-results}
  mkdir -p "$out_dir"
  source bench/peers_env.sh "$(basename "$0" .sh)"
  export PYTHONUNBUFFERED=1
  python3 "bench/$script" --json "$out_dir/$name.json" --markdown "$out_dir/$name.md" "$@" 2>&1 \
    | tee "$out_dir/$name.log"
}

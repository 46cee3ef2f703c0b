#!/usr/bin/env bash
# megamemo's main job, end to end on local CPU processes:
#   shards -> train (2 data-parallel processes) -> checkpoint -> stop -> resume -> convert -> evaluate
# Usage: bash scripts/main.sh [CORPUS]
#   CORPUS: an enwik8-format file you give; else ../shared/data/enwik8/enwik8_prefix where it exists; else the
#   standard enwik8 download (checked against its published size and prefix digests).
# Environment: MEGAMEMO_MAIN_DIR (default runs/main), MEGAMEMO_MAIN_STEPS (default 200), MEGAMEMO_MAIN_PROCS (2).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
bash scripts/setup.sh
# shellcheck source=env.sh
source scripts/env.sh

out="${MEGAMEMO_MAIN_DIR:-$here/runs/main}"
steps="${MEGAMEMO_MAIN_STEPS:-200}"
procs="${MEGAMEMO_MAIN_PROCS:-2}"
half=$(( steps / 2 ))
corpus="${1:-}"
if [ -n "$corpus" ]; then
  [ -f "$corpus" ] || { echo "main: corpus $corpus does not exist" >&2; exit 2; }
  where="the path you gave: $corpus"
elif [ -f "$here/../shared/data/enwik8/enwik8_prefix" ]; then
  corpus="$(cd "$here/../shared/data/enwik8" && pwd)/enwik8_prefix"
  where="../shared/data: the enwik8 prefix ($corpus)"
else
  python scripts/fetch_enwik8.py "$here/data/raw"
  corpus="$here/data/raw/enwik8"
  where="the standard enwik8 download, checksums verified ($corpus)"
fi
echo "[main] corpus: $where"
rm -rf "$out"
mkdir -p "$out"

echo "[main] 1/5 shards"
megamemo prepare enwik8 --raw "$corpus" --out "$out/shards"
megamemo verify-shards "$out/shards"

common=(--config configs/tiny-cpu.yaml --data "$out/shards" --run-dir "$out/run" --save-every $(( half / 2 ))
        --set optim.decay_steps="$steps")
echo "[main] 2/5 train $procs processes to step $half (then stop, as a preempted job would)"
launch/local.sh "$procs" "${common[@]}" --max-steps "$half"
echo "[main] 3/5 resume from the newest committed checkpoint and train to step $steps"
launch/local.sh "$procs" "${common[@]}" --max-steps "$steps"

echo "[main] 4/5 convert to a single-device checkpoint"
megamemo convert to-single --ckpt "$out/run" --out "$out/single"

echo "[main] 5/5 evaluate on the test split"
megamemo eval --ckpt "$out/single" --data "$out/shards" --split test --json "$out/eval.json"
megamemo plot "$out/run" --out "$out/curves.png"     # training/validation bpc, the resume marked
python - "$out" <<'PY'
import json, sys
out = sys.argv[1]
r = json.load(open(f"{out}/eval.json"))
steps = [m for m in map(json.loads, open(f"{out}/run/metrics.jsonl")) if m.get("kind", "train") == "train"]
print(f"[main] done: trained {steps[-1]['step']} steps (last training loss {steps[-1]['loss']:.4f}); "
      f"test {r.get('tokens')} tokens, nll {r['nll']:.4f} nats/token"
      + (f", bpc {r['bpc']:.4f}" if 'bpc' in r else ""))
print(f"[main] outputs in {out}: shards/, run/ (metrics.jsonl, checkpoints/), single/, eval.json, curves.png")
PY

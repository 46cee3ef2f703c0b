#!/usr/bin/env bash
# megamemo's main job, end to end on local CPU processes:
#   shards -> train (2 data-parallel processes) -> checkpoint -> stop -> resume -> convert -> evaluate -> sample
# The model is configs/main-cpu.yaml (a 0.68M-parameter LaMemo): about 7 minutes on 2 CPU cores, test bpc ~2.4 on
# the enwik8 prefix (unigram baseline ~5.1). At the end: test bpc beside the unigram baseline of the same split, a
# sample continuation of a test-split prompt from the converted checkpoint, and the plot's path.
# Usage: bash scripts/main.sh [CORPUS]
#   CORPUS: an enwik8-format file you give; else ../shared/data/enwik8/enwik8_prefix where it exists; else the
#   standard enwik8 download (checked against its published size and prefix digests).
# Environment: MEGAMEMO_MAIN_DIR (default runs/main), MEGAMEMO_MAIN_CONFIG (default configs/main-cpu.yaml),
#   MEGAMEMO_MAIN_STEPS (default: the config's train.max_steps), MEGAMEMO_MAIN_PROCS (2),
#   MEGAMEMO_MAIN_SAMPLE (new tokens sampled at the end, default 300; 0: no sample).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
bash scripts/setup.sh
# shellcheck source=env.sh
source scripts/env.sh

out="${MEGAMEMO_MAIN_DIR:-$here/runs/main}"
config="${MEGAMEMO_MAIN_CONFIG:-configs/main-cpu.yaml}"
steps="${MEGAMEMO_MAIN_STEPS:-$(python -c 'import sys, yaml
print(yaml.safe_load(open(sys.argv[1]))["train"]["max_steps"])' "$config")}"
sample="${MEGAMEMO_MAIN_SAMPLE:-300}"
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

echo "[main] 1/6 shards"
megamemo prepare enwik8 --raw "$corpus" --out "$out/shards"
megamemo verify-shards "$out/shards"

common=(--config "$config" --data "$out/shards" --run-dir "$out/run" --save-every $(( half / 2 ))
        --set optim.decay_steps="$steps")
echo "[main] 2/6 train $procs processes to step $half (then stop, as a preempted job would)"
launch/local.sh "$procs" "${common[@]}" --max-steps "$half"
echo "[main] 3/6 resume from the newest committed checkpoint and train to step $steps"
launch/local.sh "$procs" "${common[@]}" --max-steps "$steps"

echo "[main] 4/6 convert to a single-device checkpoint"
megamemo convert to-single --ckpt "$out/run" --out "$out/single"

echo "[main] 5/6 evaluate on the whole test split"
megamemo eval --ckpt "$out/single" --data "$out/shards" --split test --json "$out/eval.json"
megamemo plot "$out/run" --out "$out/curves.png"     # training/validation bpc, the resume marked
python -c 'import json, sys; from megamemo.data.stats import unigram_baseline
json.dump(unigram_baseline(sys.argv[1], "test"), open(sys.argv[2], "w"))' "$out/shards" "$out/unigram.json"

echo "[main] 6/6 sample a continuation of a test-split prompt from the converted checkpoint (top-p 0.9, seed 1)"
python -c 'import sys; from megamemo.data.stats import excerpt
open(sys.argv[2], "wb").write(excerpt(sys.argv[1], "test", start=100_000, n_tokens=200))' \
  "$out/shards" "$out/prompt.txt"
if [ "$sample" -gt 0 ]; then
  megamemo generate --ckpt "$out/single" --prompt-file "$out/prompt.txt" --max-new-tokens "$sample" \
    --top-p 0.9 --seed 1 --out "$out/sample.txt"
fi
python - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
r = json.load(open(out / "eval.json"))
u = json.load(open(out / "unigram.json"))
steps = [m for m in map(json.loads, open(out / "run/metrics.jsonl")) if m.get("kind", "train") == "train"]
unit = u["unit"]
score = r["bpc"] if "bpc" in r else r["nll"] / 0.6931471805599453
print(f"[main] done: trained {steps[-1]['step']} steps (last training loss {steps[-1]['loss']:.4f})")
print(f"[main] test split, {r['tokens']:,} of its {u['tokens']:,} tokens scored (eval's {r.get('batch_size', 10)} "
      f"columns drop the remainder): model {score:.4f} {unit} | unigram baseline "
      f"{u['bits']:.4f} {unit} (byte frequencies of the train split, add-one smoothed; the test split's own "
      f"entropy is {u['self_entropy']:.4f})")
prompt = (out / "prompt.txt").read_bytes().decode("utf-8", errors="replace")
print("[main] prompt (200 bytes of the test split):\n" + prompt)
if (out / "sample.txt").exists():
    print("[main] sampled continuation (top-p 0.9, seed 1):\n" + (out / "sample.txt").read_text())
print(f"[main] plot: {out / 'curves.png'}")
print(f"[main] outputs in {out}: shards/, run/ (metrics.jsonl, checkpoints/), single/, eval.json, unigram.json, "
      f"prompt.txt, sample.txt, curves.png")
PY

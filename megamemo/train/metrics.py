"""Training metrics: a log line every N steps, every step as one JSON object in <run_dir>/metrics.jsonl, and
TensorBoard events in <run_dir>/tb. Only rank 0 writes.

metrics.jsonl objects carry `kind`: "train" (one per applied step: step, loss, bpc, ppl, lr, grad_norm,
(on subword corpora bits_per_byte: the loss over the split's average UTF-8 bytes per token),
loss_scale, skipped, tokens, time (wall clock, s), cpu_s (rank 0's process CPU seconds since it started, all its
threads: beside time it tells a step's own work from a wait for cores that other jobs hold; tests/
test_plan_measured.py); on log lines also tokens_per_s, hfu_flops_per_s, hfu,
mfu_flops_per_s and mfu),
"skip" (an overflowing attempt that was not applied), "eval", "resume" (step, time: a run resumed there).
A loss spike's rollback (train/rollback.py) moves the undone steps' "train" and "skip" records to
metrics.rolled_back.jsonl beside it, each tagged "rolled_back": {"spike": its step, "to": the step rolled back to}.
On resume from step S the file keeps only what happened up to S, so it reads like one uninterrupted run; the
"resume" record marks where it restarted (`megamemo plot` draws it).

Throughput: tokens_per_s counts every rank's tokens over the window since the last log line. Two utilisations
(megamemo/model/flops.py derives both), each a total over all ranks and a fraction of world size x the device's
peak (megamemo/runtime/peak.py; null where the peak is unknown, the CPU):
  hfu_flops_per_s = tokens_per_s x the FLOPs per token the step executes (flops_per_token: LaMemo's memory-row
                    recompute and look-ahead included); hfu = hfu_flops_per_s / peak;
  mfu_flops_per_s = tokens_per_s x the PaLM convention's model FLOPs per token (model_flops_per_token:
                    6 N + the attention over mem_len + tgt_len keys); mfu = mfu_flops_per_s / peak.
The log line prints the executed FLOP/s, HFU and MFU. Records written before both existed carry
model_flops_per_s and mfu instead, which were the executed figures (today's hfu_flops_per_s and hfu): a record
with an "mfu" and no "hfu" is such a one. Nothing in megamemo reads these keys back (`megamemo plot` draws losses).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, TextIO

from megamemo.runtime.peak import format_flops
from megamemo.util.files import write_text_atomic
from megamemo.util.units import bits, bits_per_byte, perplexity

ROLLED_BACK = "metrics.rolled_back.jsonl"


def trim_jsonl(path: Path, last_step: int) -> list[dict]:
    """Drop records after `last_step` (written by a run that died after its last checkpoint) -> those dropped."""
    if not path.is_file():
        return []
    keep, dropped = [], []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if rec.get("step", 0) <= last_step and not (rec.get("kind") == "resume" and rec["step"] == last_step):
            keep.append(line)  # (a resume at last_step is written again by the new run)
        else:
            dropped.append(rec)
    write_text_atomic(path, "".join(k + "\n" for k in keep), durable=False)
    return dropped


def rolled_back_steps(run_dir: Path, spike_step: int) -> dict[int, dict]:
    """{step: its "train" record} of the attempt that the rollback at the spike of step `spike_step` undid (the
    newest such rollback's), from metrics.rolled_back.jsonl."""
    path = Path(run_dir) / ROLLED_BACK
    out: dict[int, dict] = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "train" and (rec.get("rolled_back") or {}).get("spike") == spike_step:
            if out and rec["step"] <= max(out):  # a later rollback of the same spike: its attempt replaces
                out = {s: r for s, r in out.items() if s < rec["step"]}
            out[int(rec["step"])] = rec
    return out


class Metrics:
    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        every: int,
        unit: str,
        tensorboard: bool,
        start_step: int,
        config_yaml: str | None = None,
        *,
        flops_per_token: float | None = None,
        model_flops_per_token: float | None = None,
        peak_flops: float | None = None,
        world_size: int = 1,
        bytes_per_token: dict | None = None,
        splits: tuple[str, str] = ("train", "valid"),
        start: dict | None = None,
    ):
        self.enabled = enabled
        self.every = every
        self.unit = unit  # "bpc" or "ppl": what the log line shows
        self.flops_per_token = flops_per_token  # executed training FLOPs per token (None: no FLOP/s, HFU or MFU)
        self.model_flops_per_token = model_flops_per_token  # PaLM's model FLOPs per token (None: no MFU)
        self.peak_flops = peak_flops  # per device, FLOP/s (None: HFU and MFU n/a)
        self.world_size = world_size
        # subword corpora: per split UTF-8 bytes per token, for bits per byte (training split, then eval split)
        self.bytes_per_token = bytes_per_token or {}
        self.train_split, self.eval_split = splits
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.start_step, self.tensorboard, self.config_yaml = start_step, tensorboard, config_yaml
        self._file: TextIO | None = None
        self._tb: Any = None  # a SummaryWriter when TensorBoard logs
        self._window_tokens = 0
        self._window_t0 = time.perf_counter()
        # this start, for goodput (runtime/goodput.py): {time: the process's start, step, world_size, restart}; its
        # "start" record (with `ready`, when training began) goes out with the first step
        self.start = start
        self._ready: float | None = None

    def _open(self) -> None:
        """The run directory's files appear with the first record (the first step): a start that fails before it
        leaves nothing new there. config.yaml (the resolved config), metrics.jsonl (kept up to the resumed step),
        TensorBoard events in tb/."""
        if self._file is not None or not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.config_yaml is not None:
            write_text_atomic(self.run_dir / "config.yaml", self.config_yaml, durable=False)
        if self.start_step > 0:
            trim_jsonl(self.path, self.start_step)
        elif self.start is not None and self.start.get("restart", 0) > 0:
            trim_jsonl(self.path, 0)  # a restart before the first commit: the earlier starts stay (goodput)
        else:
            for stale in (self.path, self.run_dir / ROLLED_BACK):  # a fresh run
                stale.unlink(missing_ok=True)
        self._file = open(self.path, "a", buffering=1)
        if self.start_step > 0:
            self._write({"kind": "resume", "step": self.start_step, "time": time.time()})
        if self.start is not None:
            self._write({"kind": "start", **self.start, "ready": self._ready or time.time()})
        if self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional: log.tensorboard, and slow to import

                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"), purge_step=self.start_step + 1)
            except ImportError as e:  # tensorboard missing: keep training, say so once
                print(f"[metrics] TensorBoard disabled: {e}", flush=True)

    def start_window(self) -> None:
        """Start the tokens/s clock (the loop calls this when training starts, after start-up)."""
        self._window_tokens, self._window_t0 = 0, time.perf_counter()
        self._ready = self._ready or time.time()

    def derived(self, loss: float, split: str | None = None) -> dict:
        """bpc and ppl of a mean per-token loss (nats); on a subword corpus also bits_per_byte, the loss over the
        split's average UTF-8 bytes per token (megamemo.util.units)."""
        out = {"bpc": bits(loss), "ppl": perplexity(loss)}
        ratio = self.bytes_per_token.get(split or self.train_split)
        if ratio:
            out["bits_per_byte"] = bits_per_byte(loss, ratio)
        return out

    def _bpb_text(self, rec: dict) -> str:
        return f" | bpb {rec['bits_per_byte']:.4f}" if "bits_per_byte" in rec else ""

    def throughput(self, tokens_per_s: float) -> dict:
        """hfu_flops_per_s, hfu and (with model FLOPs per token) mfu_flops_per_s, mfu for a tokens/s figure (all
        ranks); {} without a FLOP count."""
        if self.flops_per_token is None:
            return {}
        peak = self.world_size * self.peak_flops if self.peak_flops else None
        out: dict[str, float | None] = {}
        for name, per_token in (("hfu", self.flops_per_token), ("mfu", self.model_flops_per_token)):
            if per_token is not None:
                flops = tokens_per_s * per_token
                out[f"{name}_flops_per_s"], out[name] = flops, (flops / peak if peak else None)
        return out

    def _write(self, rec: dict) -> None:
        self._open()
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")

    def train_step(self, rec: dict) -> None:
        """rec: step, loss, lr, grad_norm, loss_scale, skipped, tokens (this step's, all ranks), seconds (the step's
        time on rank 0: goodput's productive time)."""
        self._window_tokens += rec["tokens"]
        if not self.enabled:
            return
        now = time.perf_counter()
        rec = {"kind": "train", **rec, **self.derived(rec["loss"]), "time": time.time(), "cpu_s": time.process_time()}
        if rec["step"] % self.every == 0:
            dt = max(now - self._window_t0, 1e-9)
            rec["tokens_per_s"] = self._window_tokens / dt
            rec.update(self.throughput(rec["tokens_per_s"]))
            self._window_tokens, self._window_t0 = 0, now
            scale = f" | scale {rec['loss_scale']:.0f}" if rec.get("loss_scale", 1.0) != 1.0 else ""
            speed = ""
            if "hfu_flops_per_s" in rec:
                speed = f" | {format_flops(rec['hfu_flops_per_s'])}/s" + "".join(
                    f" | {name.upper()} {'n/a' if rec[name] is None else format(rec[name], '.1%')}"
                    for name in ("hfu", "mfu")
                    if name in rec
                )
            print(
                f"step {rec['step']:>7} | lr {rec['lr']:.3e} | loss {rec['loss']:.4f} | "
                f"{self.unit} {rec[self.unit]:.4f}{self._bpb_text(rec)} | tok/s {rec['tokens_per_s']:,.0f}{speed} | "
                f"grad norm {rec['grad_norm']:.3f}{scale} | skipped {rec['skipped']}",
                flush=True,
            )
        self._write(rec)
        if self._tb is not None:
            s = rec["step"]
            for k in (
                "loss",
                "lr",
                "grad_norm",
                "loss_scale",
                self.unit,
                "bits_per_byte",
                "tokens_per_s",
                "hfu_flops_per_s",
                "hfu",
                "mfu_flops_per_s",
                "mfu",
            ):
                if k in rec and rec[k] is not None and math.isfinite(rec[k]):
                    self._tb.add_scalar(f"train/{k}", rec[k], s)

    def skipped(self, rec: dict) -> None:
        if not self.enabled:
            return
        print(
            f"step {rec['step']:>7} | overflow: step skipped and retried, loss scale "
            f"{rec['old_scale']:.0f} -> {rec['loss_scale']:.0f} | skipped {rec['skipped']}",
            flush=True,
        )
        self._write({"kind": "skip", **rec})
        if self._tb is not None:
            self._tb.add_scalar("train/skipped", rec["skipped"], rec["step"])

    def eval(self, rec: dict) -> None:
        if not self.enabled:
            return
        rec = {"kind": "eval", **rec, **self.derived(rec["loss"], rec.get("split", self.eval_split))}
        print(
            f"eval  {rec['step']:>7} | {rec['split']} loss {rec['loss']:.4f} | {self.unit} {rec[self.unit]:.4f}"
            f"{self._bpb_text(rec)} | "
            f"{rec['tokens']:,} tokens in {rec['seconds']:.1f}s",
            flush=True,
        )
        self._write(rec)
        if self._tb is not None:
            self._tb.add_scalar(f"{rec['split']}/loss", rec["loss"], rec["step"])
            self._tb.add_scalar(f"{rec['split']}/{self.unit}", rec[self.unit], rec["step"])
            if "bits_per_byte" in rec:
                self._tb.add_scalar(f"{rec['split']}/bits_per_byte", rec["bits_per_byte"], rec["step"])

    def rolled_back(self, step: int, spike_step: int) -> None:
        """A loss spike at `spike_step` rolled the run back to `step` (train/rollback.py): the records after it move
        to metrics.rolled_back.jsonl (tagged "rolled_back": {spike, to}: what the undone attempt saw, which `megamemo
        replay --rolled-back` compares with), and a "resume" record marks it, as after a restart."""
        if not self.enabled:
            return
        if self._file is not None:
            self._file.close()
            self._file = None
        undone = [r for r in trim_jsonl(self.path, step) if r.get("kind") in ("train", "skip")]
        with open(self.run_dir / ROLLED_BACK, "a") as f:  # kept for `megamemo replay --rolled-back`
            f.writelines(json.dumps({**r, "rolled_back": {"spike": spike_step, "to": step}}) + "\n" for r in undone)
        self._file = open(self.path, "a", buffering=1)
        self._write({"kind": "resume", "step": step, "time": time.time(), "spike": spike_step})

    def end(self, step: int, outcome: str) -> None:
        """The run ended (done, or stopped by a signal after saving): the "end" record goodput's wall time ends at."""
        if self._file is not None:  # (a start that trained no step leaves the files as they were)
            self._write({"kind": "end", "step": step, "time": time.time(), "outcome": outcome})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

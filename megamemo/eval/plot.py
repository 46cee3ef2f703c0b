"""What `megamemo plot` does (megamemo/commands/plot.py): training and validation curves of one or more runs, from
their metrics.jsonl, as a PNG.

    megamemo plot RUN_DIR [RUN_DIR ...] [--out FILE.png] [--x steps|tokens] [--metric bpc|ppl]

Per run (labelled by its directory name, one colour each): the training curve (every applied step), the
validation points (kind "eval"), a dotted vertical line where the run resumed (kind "resume"), a mark at the
foot of the axes for each skipped step (kind "skip": an fp16 overflow, not applied) and a dashed vertical line at
the step each interruption reached (a crash, a hang, a lost node: <run_dir>/interruptions.jsonl). --x tokens puts
the tokens trained so far (summed over the applied steps) on the x axis instead of the step. Each run's goodput
(productive step time over wall time since its first start: megamemo/runtime/goodput.py) is printed and shown in
the legend.

The metric is bpc for byte/character corpora and perplexity for word-level and subword ones (log scale), as
training logs it (subword runs, whose records carry bits_per_byte, get a second panel of bits per byte beside it): from
the shard manifest of config.yaml's data.dir when that directory exists (relative paths are read from the current
directory), else from config.yaml's vocabulary size (<= 256 symbols: bytes or characters), else from the records (a last
loss above 2 nats per token is a word-level run). --metric overrides; runs that disagree need it. Output: --out, default
RUN_DIR/metrics.png for one run, ./metrics.png for several. Exit codes: 0 written; 2 a missing, empty or malformed
metrics.jsonl (the message names the file and line).
"""

from __future__ import annotations

import bisect
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megamemo.runtime import goodput, interruptions
from megamemo.util.errors import MegamemoError
from megamemo.util.units import metric_value

WORD_LEVEL_NATS = 2.0  # records-only guess: characters sit below this (bpc < 2.9), words above (ppl > 7.4)


class PlotError(MegamemoError, ValueError):
    """A missing or unreadable run; the message names the file."""


@dataclass
class Run:
    name: str
    path: Path
    train: list[dict] = field(default_factory=list)  # kind "train", in file order
    evals: list[dict] = field(default_factory=list)
    skips: list[dict] = field(default_factory=list)
    resumes: list[dict] = field(default_factory=list)
    interruptions: list[dict] = field(default_factory=list)  # interruptions.jsonl, in the run's history
    goodput: dict | None = None
    metric: str = "bpc"
    metric_from: str = ""
    _cum: tuple | None = field(default=None, repr=False)

    def tokens_at(self, step: float) -> int:
        """Tokens trained by the end of `step` (applied steps up to and including it)."""
        if self._cum is None:
            order = sorted(self.train, key=lambda r: r["step"])
            self._cum = ([r["step"] for r in order], list(itertools.accumulate(r["tokens"] for r in order)))
        steps, cum = self._cum
        k = bisect.bisect_right(steps, step)
        return cum[k - 1] if k else 0


def read_records(path: Path) -> list[tuple[int, dict]]:
    """(line number, record) of every non-blank line."""
    if not path.is_file():
        raise PlotError(f"{path}: no such file (is this a megamemo run directory?)")
    recs = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise PlotError(f"{path}:{i}: not JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise PlotError(f"{path}:{i}: not a JSON object")
        recs.append((i, rec))
    if not recs:
        raise PlotError(f"{path}: empty (no records yet)")
    return recs


NEEDS = {"train": ("step", "loss", "tokens"), "eval": ("step", "loss"), "skip": ("step",), "resume": ("step",)}


def load_run(run_dir: str | Path) -> Run:
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    run = Run(name=run_dir.resolve().name, path=path)
    lists = {"train": run.train, "eval": run.evals, "skip": run.skips, "resume": run.resumes}
    records = read_records(path)
    for i, rec in records:
        kind = rec.get("kind", "train")
        if kind not in lists:
            continue  # a kind this version does not draw
        for key in NEEDS[kind]:
            if not isinstance(rec.get(key), (int, float)) or isinstance(rec.get(key), bool):
                raise PlotError(f"{path}:{i}: {kind!r} record without a numeric {key!r}")
        lists[kind].append(rec)
    if not run.train and not run.evals:
        raise PlotError(f"{path}: no training or evaluation records")
    failures = interruptions.history(run_dir)
    run.goodput = goodput.compute([rec for _, rec in records], failures)
    since = run.goodput["first_start"] if run.goodput else float("-inf")
    run.interruptions = [r for r in failures if isinstance(r.get("step"), int) and float(r.get("time", 0)) >= since]
    run.metric, run.metric_from = infer_metric(run_dir, run)
    return run


def infer_metric(run_dir: Path, run: Run) -> tuple[str, str]:
    """("bpc" | "ppl", where that came from): manifest, then config, then records (module docstring)."""
    cfg_path = run_dir / "config.yaml"
    cfg = None
    if cfg_path.is_file():
        try:
            cfg = yaml.safe_load(cfg_path.read_text()) or {}
        except yaml.YAMLError as e:
            raise PlotError(f"{cfg_path}: not YAML ({e})") from None
        data_dir = ((cfg.get("data") or {}).get("dir")) if isinstance(cfg, dict) else None
        manifest = Path(data_dir) / "manifest.json" if data_dir else None
        if manifest is not None and manifest.is_file():
            try:
                kind = (json.loads(manifest.read_text()).get("tokenizer") or {}).get("kind", "")
            except (json.JSONDecodeError, AttributeError):
                kind = None
            if kind is not None:
                from megamemo.data.vocab import unit_of  # megamemo.data brings torch: plot runs without it

                return unit_of(kind), f"{manifest} (tokenizer {kind})"
        model = (cfg.get("model") or {}) if isinstance(cfg, dict) else {}
        n_token = model.get("n_vocab") or model.get("n_token")  # a padded vocabulary's symbols
        if isinstance(n_token, int):
            return ("bpc" if n_token <= 256 else "ppl"), f"{cfg_path} (vocabulary of {n_token})"
    last = (run.evals or run.train)[-1]["loss"]
    return ("ppl" if last > WORD_LEVEL_NATS else "bpc"), f"the records (last loss {last:.3f} nats)"


def value(rec: dict, metric: str) -> float:
    if metric == "bits_per_byte":
        return rec.get("bits_per_byte", float("nan"))
    loss = rec["loss"]
    return metric_value(loss, metric)


LABELS = {"bpc": "bits per character", "ppl": "perplexity (per token)", "bits_per_byte": "bits per byte"}


def has_bits_per_byte(runs: list[Run]) -> bool:
    """Subword runs record bits_per_byte in every train/eval record: the plot shows it beside perplexity."""
    recs = [r for run in runs for r in run.train + run.evals]
    return bool(recs) and all("bits_per_byte" in r for r in recs)


def figure(runs: list[Run], x: str = "steps", metric: str | None = None):
    """The figure and its artists: {(run name, "train" | "eval" | "resume" | "skip" | "interruption"): Line2D or list
    of them}."""
    import matplotlib  # heavy, and only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen
    from matplotlib.transforms import blended_transform_factory

    metric = metric or runs[0].metric
    panels = [metric] + (["bits_per_byte"] if metric == "ppl" and has_bits_per_byte(runs) else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(9 * len(panels), 5.5), squeeze=False)
    drawn: dict = {}
    for k, (ax, m) in enumerate(zip(axes[0], panels, strict=True)):
        _draw(ax, runs, x, m, drawn if k == 0 else {}, plt, blended_transform_factory)
    fig.tight_layout()
    return fig, drawn


def _draw(ax, runs: list[Run], x: str, metric: str, drawn: dict, plt, blended_transform_factory) -> None:
    foot = blended_transform_factory(ax.transData, ax.transAxes)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def xs(run: Run, steps):
        return list(steps) if x == "steps" else [run.tokens_at(s) for s in steps]

    for i, run in enumerate(runs):
        c = colours[i % len(colours)]
        if run.train:
            good = f" (goodput {run.goodput['goodput']:.1%})" if run.goodput else ""
            (drawn[run.name, "train"],) = ax.plot(
                xs(run, [r["step"] for r in run.train]),
                [value(r, metric) for r in run.train],
                color=c,
                lw=0.8,
                alpha=0.6,
                label=f"{run.name} train{good}",
            )
        if run.evals:
            split = run.evals[0].get("split", "valid")
            (drawn[run.name, "eval"],) = ax.plot(
                xs(run, [r["step"] for r in run.evals]),
                [value(r, metric) for r in run.evals],
                color=c,
                lw=1.8,
                marker="o",
                ms=4,
                label=f"{run.name} {split}",
            )
        drawn[run.name, "resume"] = [
            ax.axvline(xv, color=c, ls=":", lw=1.2) for xv in xs(run, [r["step"] for r in run.resumes])
        ]
        drawn[run.name, "interruption"] = [
            ax.axvline(xv, color=c, ls="--", lw=1.2, alpha=0.8)
            for xv in xs(run, [r["step"] for r in run.interruptions])
        ]
        if run.skips:  # at the step attempted; by tokens, where that attempt began (it trained none)
            at = [r["step"] for r in run.skips] if x == "steps" else [run.tokens_at(r["step"] - 1) for r in run.skips]
            (drawn[run.name, "skip"],) = ax.plot(
                at, [0.02] * len(at), ls="none", marker="x", color=c, transform=foot, clip_on=False
            )
    ax.set_xlabel("step" if x == "steps" else "tokens trained")
    ax.set_ylabel(LABELS[metric])
    if metric == "ppl":
        ax.set_yscale("log")
    marks = []
    if any(r.interruptions for r in runs):
        marks.append("dashed: interrupted")
    if any(r.resumes for r in runs):
        marks.append("dotted: resumed")
    if any(r.skips for r in runs):
        marks.append("x: skipped step")
    ax.set_title(f"training and validation {metric}" + (f" ({'; '.join(marks)})" if marks else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def load_runs(run_dirs: list, metric: str | None = None) -> list[Run]:
    """The runs to draw; PlotError when two share a name, or (without `metric`) they disagree on the metric."""
    runs = [load_run(r) for r in run_dirs]
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise PlotError(f"run directories share a name, the plot could not tell them apart: {run_dirs}")
    if metric is None and len({r.metric for r in runs}) > 1:
        raise PlotError(
            "runs disagree on the metric ("
            + ", ".join(f"{r.name}: {r.metric} from {r.metric_from}" for r in runs)
            + "); pass --metric bpc or --metric ppl"
        )
    return runs


def default_out(run_dirs: list) -> Path:
    """RUN_DIR/metrics.png for one run, ./metrics.png for several."""
    return Path(run_dirs[0]) / "metrics.png" if len(run_dirs) == 1 else Path("metrics.png")


def save(runs: list[Run], out: Path, x: str = "steps", metric: str | None = None, log=print) -> Path:
    """The figure of `runs` written to `out` (PlotError naming the file if it cannot be), and a line per run."""
    import matplotlib.pyplot as plt  # heavy, and only to draw (figure() chose the Agg backend)

    fig, _ = figure(runs, x, metric)
    try:
        fig.savefig(out, dpi=120)
    except OSError as e:
        raise PlotError(f"{out}: cannot write the plot ({e.strerror or e})") from None
    finally:
        plt.close(fig)
    for r in runs:
        log(
            f"[plot] {r.name}: {len(r.train)} steps, {len(r.evals)} evaluations, {len(r.resumes)} resumes, "
            f"{len(r.skips)} skipped steps, {len(r.interruptions)} interruptions; {metric or r.metric} "
            f"({'--metric' if metric else r.metric_from})"
        )
        if r.goodput:
            log(f"[plot] {r.name}: {goodput.describe(r.goodput)}")
    log(f"[plot] wrote {out}")
    return out

"""`megamemo plot` (megamemo/eval/plot.py): the plotted data are the records of metrics.jsonl, resumes and skipped
steps are marked, several runs share one figure, the metric follows the run's corpus, and bad input is a one-line
error naming the file with exit code 2."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from itertools import accumulate
from pathlib import Path

import matplotlib.image
import pytest

from megamemo import cli
from megamemo.commands import plot as plot_cmd
from megamemo.eval import plot

# Tolerances here: pytest.approx (default rel 1e-6) and rel=1e-12 compare float64 evaluations of the same formula
# (IEEE arithmetic, rounded alike on any CPU; numpy's sums in another order at most): they differ by a few u64
# (1.1e-16) relative, so either tolerance only says 'the same number'. Nothing here depends on a CPU's kernels.

REPO = Path(__file__).resolve().parents[2]
LN2 = math.log(2.0)


def make_run(
    root: Path, name: str, *, loss0=3.0, config: str | None = "model: {n_token: 256}\n", shift=0.0
) -> tuple[Path, list[dict]]:
    """A run directory: 12 applied steps (token counts vary), evals at 4, 8 and 12, an overflow at attempt 7 (then
    step 7 applied on retry), a resume at step 8 (the file keeps what happened up to it)."""
    d = root / name
    d.mkdir(parents=True)
    recs = []
    for s in range(1, 13):
        if s == 7:
            recs.append(
                {
                    "kind": "skip",
                    "step": 7,
                    "loss": float("inf"),
                    "old_scale": 2.0**16,
                    "loss_scale": 2.0**15,
                    "skipped": 1,
                }
            )
        if s == 9:
            recs.append({"kind": "resume", "step": 8, "time": 1.7e9})
        recs.append(
            {
                "kind": "train",
                "step": s,
                "loss": loss0 - 0.1 * s + shift,
                "lr": 1e-3,
                "grad_norm": 1.0,
                "loss_scale": 1.0,
                "skipped": int(s >= 7),
                "tokens": 64 if s % 3 else 32,
                "time": 1.7e9 + s,
            }
        )
        if s % 4 == 0:
            recs.append(
                {
                    "kind": "eval",
                    "step": s,
                    "split": "valid",
                    "loss": loss0 - 0.08 * s + shift,
                    "tokens": 1000,
                    "seconds": 0.1,
                }
            )
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    if config is not None:
        (d / "config.yaml").write_text(config)
    return d, recs


def of(recs, kind):
    return [r for r in recs if r["kind"] == kind]


def test_plotted_data_are_the_records(tmp_path):
    d, recs = make_run(tmp_path, "lamemo")
    run = plot.load_run(d)
    assert run.metric == "bpc"
    train, evals = of(recs, "train"), of(recs, "eval")
    fig, drawn = plot.figure([run], "steps")
    assert list(drawn[run.name, "train"].get_xdata()) == [r["step"] for r in train]
    assert list(drawn[run.name, "train"].get_ydata()) == pytest.approx([r["loss"] / LN2 for r in train])
    assert list(drawn[run.name, "eval"].get_xdata()) == [4, 8, 12]
    assert list(drawn[run.name, "eval"].get_ydata()) == pytest.approx([r["loss"] / LN2 for r in evals])
    assert [ln.get_xdata()[0] for ln in drawn[run.name, "resume"]] == [8]
    assert list(drawn[run.name, "skip"].get_xdata()) == [7]
    assert fig.axes[0].get_ylabel() == "bits per character"
    # by tokens: the running sum of the applied steps' tokens (a skipped attempt trained none)
    cum = dict(zip([r["step"] for r in train], accumulate(r["tokens"] for r in train), strict=True))
    fig, drawn = plot.figure([run], "tokens")
    assert list(drawn[run.name, "train"].get_xdata()) == [cum[r["step"]] for r in train]
    assert list(drawn[run.name, "eval"].get_xdata()) == [cum[4], cum[8], cum[12]]
    assert [ln.get_xdata()[0] for ln in drawn[run.name, "resume"]] == [cum[8]]
    assert list(drawn[run.name, "skip"].get_xdata()) == [cum[6]]
    assert fig.axes[0].get_xlabel() == "tokens trained"


def test_command_writes_a_png(tmp_path, capsys):
    d, _ = make_run(tmp_path, "xl")
    out = tmp_path / "curves.png"
    assert plot_cmd.main([str(d), "--out", str(out), "--x", "tokens"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    h, w = matplotlib.image.imread(out).shape[:2]
    assert 800 <= w <= 2000 and 500 <= h <= 1500
    assert f"[plot] wrote {out}" in capsys.readouterr().out
    assert plot_cmd.main([str(d)]) == 0 and (d / "metrics.png").is_file()  # default: inside the run


def test_several_runs_one_line_each(tmp_path):
    runs = [plot.load_run(make_run(tmp_path, n, shift=k * 0.2)[0]) for k, n in enumerate(("rpe", "xl", "lamemo"))]
    fig, drawn = plot.figure(runs, "steps")
    ax = fig.axes[0]
    train_lines = [ln for ln in ax.get_lines() if ln.get_label().endswith(" train")]
    assert sorted(ln.get_label() for ln in train_lines) == ["lamemo train", "rpe train", "xl train"]
    assert len({ln.get_color() for ln in train_lines}) == 3
    for k, r in enumerate(runs):
        assert drawn[r.name, "train"].get_ydata()[0] == pytest.approx((3.0 - 0.1 + k * 0.2) / LN2)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["rpe train", "rpe valid", "xl train", "xl valid", "lamemo train", "lamemo valid"]


def test_word_level_runs_plot_perplexity(tmp_path):
    data = tmp_path / "wt103"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"tokenizer": {"kind": "words"}}))
    d, recs = make_run(tmp_path, "wt", loss0=5.0, config=f"model: {{n_token: 256}}\ndata: {{dir: '{data}'}}\n")
    run = plot.load_run(d)
    assert run.metric == "ppl" and "manifest.json" in run.metric_from  # the manifest wins over n_token
    fig, drawn = plot.figure([run])
    assert list(drawn[run.name, "eval"].get_ydata()) == pytest.approx([math.exp(r["loss"]) for r in of(recs, "eval")])
    assert fig.axes[0].get_yscale() == "log"


@pytest.mark.parametrize(
    "config,loss0,metric",
    [
        ("model: {n_token: 267735}\n", 1.5, "ppl"),
        ("model: {n_token: 204}\n", 5.0, "bpc"),
        ("model: {n_token: 512, n_vocab: 256}\n", 1.5, "bpc"),  # padded
        (None, 5.0, "ppl"),
        (None, 2.0, "bpc"),
    ],
)
def test_metric_without_a_manifest(tmp_path, config, loss0, metric):
    d, _ = make_run(tmp_path, "r", loss0=loss0, config=config)
    assert plot.load_run(d).metric == metric


def test_runs_that_disagree_need_metric(tmp_path, capsys):
    a, _ = make_run(tmp_path, "chars")
    b, _ = make_run(tmp_path, "words", config="model: {n_token: 50000}\n")
    assert cli.run_command("plot", plot_cmd.main, [str(a), str(b), "--out", str(tmp_path / "x.png")]) == 2
    assert "--metric" in capsys.readouterr().err
    assert plot_cmd.main([str(a), str(b), "--out", str(tmp_path / "x.png"), "--metric", "bpc"]) == 0


def bad_runs(tmp_path):
    missing = tmp_path / "missing"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    broken, _ = make_run(tmp_path, "broken")
    lines = (broken / "metrics.jsonl").read_text().splitlines()
    lines[3] = '{"kind": "train", "step": 4, "lo'
    (broken / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    nofield, _ = make_run(tmp_path, "nofield")
    lines = (nofield / "metrics.jsonl").read_text().splitlines()
    lines[1] = json.dumps({"kind": "train", "step": 2, "tokens": 64})
    lines[2] = json.dumps({"kind": "eval", "step": 2, "loss": "low"})
    (nofield / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    badval, _ = make_run(tmp_path, "badval")
    lines = (badval / "metrics.jsonl").read_text().splitlines()
    lines[4] = json.dumps({"kind": "eval", "step": 4, "loss": "low"})
    (badval / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return [
        (missing, "missing/metrics.jsonl: no such file"),
        (empty, "empty/metrics.jsonl: empty"),
        (broken, "broken/metrics.jsonl:4: not JSON"),
        (nofield, "nofield/metrics.jsonl:2: 'train' record without a numeric 'loss'"),
        (badval, "badval/metrics.jsonl:5: 'eval' record without a numeric 'loss'"),
    ]


def test_bad_input_is_one_line_naming_the_file(tmp_path, capsys):
    good, _ = make_run(tmp_path, "good")
    for run, msg in bad_runs(tmp_path):
        assert cli.run_command("plot", plot_cmd.main, [str(good), str(run), "--out", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("megamemo plot: error: ") and msg in err, err
    assert not (tmp_path / "x.png").exists()


def test_registered_command(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-m", "megamemo", "plot", str(tmp_path / "nowhere")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "nowhere/metrics.jsonl: no such file" in r.stderr, r.stderr
    d, _ = make_run(tmp_path, "ok")
    r = subprocess.run(
        [sys.executable, "-m", "megamemo", "plot", str(d)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and (d / "metrics.png").is_file(), r.stderr


def test_interruptions_are_marked_and_goodput_reported(tmp_path, capsys):
    """make_run's run with a first start at t0 = 1.7e9 - 9 (process start; training from t0 + 4), each step 0.5 s of
    its own, and two interruptions after it (at steps 5 and 9); a third one, older than the first start, belongs to
    an earlier run in the directory and is neither drawn nor counted. By hand: 12 steps x 0.5 s = 6 s productive over
    1.7e9 + 12 - t0 = 21 s: goodput 28.6 %."""
    d, recs = make_run(tmp_path, "lamemo")
    t0 = 1.7e9 - 9
    recs = [{"kind": "start", "time": t0, "ready": t0 + 4, "step": 0}] + [
        dict(r, seconds=0.5) if r["kind"] == "train" else r for r in recs
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    fails = [
        {"time": t0 - 100, "step": 3, "kind": "crash", "seconds_lost": 1.0},
        {"time": 1.7e9 + 5.5, "step": 5, "kind": "crash", "seconds_lost": 2.0},
        {"time": 1.7e9 + 9.5, "step": 9, "kind": "hang", "seconds_lost": 1.5},
    ]
    (d / "interruptions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fails))
    run = plot.load_run(d)
    assert [r["step"] for r in run.interruptions] == [5, 9]
    assert run.goodput["goodput"] == pytest.approx(6 / 21) and run.goodput["lost_s"] == 3.5
    fig, drawn = plot.figure([run], "steps")
    assert [ln.get_xdata()[0] for ln in drawn[run.name, "interruption"]] == [5, 9]
    assert [ln.get_linestyle() for ln in drawn[run.name, "interruption"]] == ["--", "--"]
    assert "dashed: interrupted" in fig.axes[0].get_title()
    assert drawn[run.name, "train"].get_label() == "lamemo train (goodput 28.6%)"
    cum = dict(
        zip([r["step"] for r in of(recs, "train")], accumulate(r["tokens"] for r in of(recs, "train")), strict=True)
    )
    fig, drawn = plot.figure([run], "tokens")
    assert [ln.get_xdata()[0] for ln in drawn[run.name, "interruption"]] == [cum[5], cum[9]]
    assert plot_cmd.main([str(d), "--out", str(tmp_path / "g.png")]) == 0
    out = capsys.readouterr().out
    assert "[plot] lamemo: 12 steps, 3 evaluations, 1 resumes, 1 skipped steps, 2 interruptions;" in out
    assert (
        "[plot] lamemo: goodput 28.6%: 6.0 s of training steps in 21.0 s since the first start (1 start, "
        "start-ups 4.0 s; 2 interruptions, 3.5 s lost;" in out
    ), out

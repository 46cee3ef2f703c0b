"""Progress output (megamemo/util/progress.py): a tqdm bar when stderr is a terminal, the plain periodic lines of
`megamemo prepare` / `megamemo eval` otherwise. The commands are run with stderr on a real pseudo-terminal."""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers.eval_fixtures import one_thread, tiny_checkpoint  # noqa: F401 (one_thread: autouse)
from helpers.fixture_data import ENWIK8
from helpers.shards import enwik8_slice_shards

from megamemo.data import build, corpora
from megamemo.eval import evaluate
from megamemo.interop.load import open_model
from megamemo.util.progress import BAR_REDRAW_S, Progress

REPO = Path(__file__).resolve().parents[2]
BAR = re.compile(r"\d+%\|[^|]*\|")  # tqdm's "42%|####      |"


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Tty(io.StringIO):
    def isatty(self):
        return True


# ---- the helper ----------------------------------------------------------------------------------------------
def test_plain_lines_every_interval_with_lazy_fields():
    clock, lines, calls = Clock(), [], []
    p = Progress(
        "[job]",
        total=10,
        unit="seg",
        every=2.5,
        log=lines.append,
        stream=io.StringIO(),
        clock=clock,
        line=lambda p: f"{p.n}/{p.total} x={p.info['x']} {p.rate:.1f}/s",
    )
    assert not p.is_bar
    for i in range(1, 11):
        clock.t = float(i)
        p.update(1, x=lambda i=i: calls.append(i) or i * 10)
    p.close()
    assert lines == ["3/10 x=30 1.0/s", "6/10 x=60 1.0/s", "9/10 x=90 1.0/s"]
    assert calls == [3, 6, 9]  # the lazy field is evaluated only for the lines shown


def test_default_line_and_update_to():
    clock, lines = Clock(), []
    p = Progress("[prepare] train", total=200, unit="B", every=0, log=lines.append, stream=io.StringIO(), clock=clock)
    clock.t = 4.0
    p.update_to(50)
    assert lines == ["[prepare] train: 50/200 B (25%), 12.5 B/s"]


def test_bar_on_a_terminal():
    clock, stream, calls = Clock(), Tty(), []
    with Progress(
        "[eval]",
        total=8,
        unit="seg",
        every=0,
        stream=stream,
        clock=clock,
        log=lambda m: pytest.fail(f"a plain line on a terminal: {m}"),
    ) as p:
        assert p.is_bar
        for i in range(1, 9):
            clock.t = i * BAR_REDRAW_S / 2
            p.update(1, tokens=i * 100, nll=lambda i=i: calls.append(i) or 1.5)
    out = stream.getvalue()
    assert BAR.search(out) and "100%|" in out and "8/8" in out, out
    assert "tokens=800, nll=1.5" in out, out
    assert len(calls) <= 5  # redrawn at most every BAR_REDRAW_S (and once at close)


def test_bar_choice_follows_the_stream():
    assert not Progress("x", stream=io.StringIO()).is_bar
    assert Progress("x", stream=Tty()).is_bar
    assert not Progress("x", stream=Tty(), bar=False).is_bar
    assert Progress("x", stream=io.StringIO(), bar=True).is_bar


# ---- prepare ---------------------------------------------------------------------------------------------------
def test_prepare_progress_lines(tmp_path):
    """Five blocks of 2^18 input bytes read (stats["input_bytes"], as the corpus readers report them): one
    line per block with progress_every=0, in the format prepare has always printed."""
    from megamemo.data.vocab import Vocab

    block = 1 << 18

    def gen(stats):
        for _ in range(5):
            stats["input_bytes"] = stats.get("input_bytes", 0) + block
            yield np.full(block // 2, 7, dtype=np.int64)  # two input bytes per token

    corpus = corpora.Corpus(
        "synthetic", "bytes", Vocab.identity_bytes(), {"kind": "bytes"}, {"train": gen}, {"train": 5 * block}
    )
    lines = []
    build(corpus, tmp_path / "out", chunk_tokens=4096, shard_bytes="64K", log=lines.append, progress_every=0)
    pat = re.compile(
        r"\[prepare\] train: ([\d.]+) MiB read \((\d+)%\), ([\d,]+) tokens, (\d+) shards, [\d.]+ MiB/s"
        r"(, ETA \d+m\d\ds)?"
    )
    got = [pat.fullmatch(ln) for ln in lines if "MiB read" in ln]
    assert len(got) == 5 and all(got), lines
    assert all(m.group(5) for m in got[:-1]) and not got[-1].group(5)  # the remaining time, until the end
    assert [(m.group(1), m.group(2), m.group(3)) for m in got] == [
        (f"{k * 0.25:.1f}", f"{k * 20}", f"{k * block // 2:,}") for k in range(1, 6)
    ]
    assert int(got[-1].group(4)) >= 1


def run_tty(cmd: list[str], env: dict) -> tuple[int, str, str]:
    """Run cmd with stderr on a pseudo-terminal: (returncode, stdout, what the terminal received)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    chunks = []

    def reader():
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    t = threading.Thread(target=reader)
    t.start()
    out, _ = proc.communicate(timeout=300)
    t.join(timeout=30)
    os.close(master)
    return proc.returncode, out, b"".join(chunks).decode(errors="replace")


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")


def test_prepare_bar_on_terminal_lines_otherwise(tmp_path):
    cmd = [sys.executable, "-m", "megamemo", "prepare", "enwik8", "--raw", str(ENWIK8), "--out"]
    rc, _, term = run_tty(cmd + [str(tmp_path / "a")], env())
    assert rc == 0, term
    assert BAR.search(term) and "[prepare] train" in term and "100%|" in term, term
    r = subprocess.run(cmd + [str(tmp_path / "b")], cwd=REPO, env=env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert not BAR.search(r.stderr) and "\r" not in r.stderr, r.stderr
    assert "[prepare] train: 180,000 tokens in 1 shards" in r.stderr


# ---- eval ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt_and_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    shards = enwik8_slice_shards(root / "shards")
    ckpt, _ = tiny_checkpoint(root / "ckpt")
    return ckpt, shards


def test_eval_progress_lines(ckpt_and_shards):
    ckpt, shards = ckpt_and_shards
    model, _ = open_model(ckpt, "cpu")
    lines = []
    reader = evaluate.open_batches(shards, "valid", 4, 12)
    out = evaluate.evaluate(model, reader, log=lines.append, log_every=0, total_segments=reader.steps_per_epoch)
    reader.close()
    pat = re.compile(r"\[eval\] segment (\d+)/(\d+): ([\d,]+) tokens, [\d,]+ tokens/s, running nll ([\d.]+)")
    parsed = [pat.fullmatch(ln) for ln in lines]
    assert all(parsed) and len(parsed) == out["segments"], lines
    last = parsed[-1]
    assert int(last.group(1)) == int(last.group(2)) == out["segments"]
    assert int(last.group(3).replace(",", "")) == out["tokens"]
    assert float(last.group(4)) == pytest.approx(out["nll"], abs=5e-5)  # printed with 4 decimals: half a unit
    n = out["segments"]
    for max_segments, end in ((3, 3), (n + 50, n)):  # --max-segments: the sooner of it and the split's end
        lines.clear()
        reader = evaluate.open_batches(shards, "valid", 4, 12)
        evaluate.evaluate(
            model,
            reader,
            log=lines.append,
            log_every=0,
            total_segments=reader.steps_per_epoch,
            max_segments=max_segments,
        )
        reader.close()
        assert [pat.fullmatch(ln).group(1, 2) for ln in lines] == [(str(k), str(end)) for k in range(1, end + 1)]


def test_eval_bar_on_terminal_lines_otherwise(ckpt_and_shards):
    ckpt, shards = ckpt_and_shards
    cmd = [
        sys.executable,
        "-m",
        "megamemo",
        "eval",
        "--ckpt",
        str(ckpt),
        "--data",
        str(shards),
        "--split",
        "valid",
        "--batch-size",
        "4",
    ]
    rc, out, term = run_tty(cmd, env())
    assert rc == 0, term
    assert BAR.search(term) and "[eval]" in term and "100%|" in term and "nll=" in term, term
    assert "valid bpc" in out
    r = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert not BAR.search(r.stderr + r.stdout) and "\r" not in r.stderr, r.stderr

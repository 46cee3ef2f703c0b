"""Files megamemo reads that someone else may have written: nothing in them runs, nothing damaged is used.
* a pickle whose unpickling would run code (it would create a file), put where a checkpoint's tensors or a
  reference file belong, is refused by resume, convert, eval and reference-score / import-reference with one
  line, and the file it would create never appears, even with the commit marker's checksums made to match;
  the same for a single-device checkpoint given to eval, generate and analyze;
* a flipped byte in a single-device checkpoint is refused by eval and generate, naming the file;
* `megamemo prepare` refuses an empty or too-short corpus, naming it, and leaves no output directory."""

from __future__ import annotations

import json
import os
import subprocess
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import forked
from helpers.errors import failed_with_one_line
from test_train_runs import run

from megamemo.checkpoint.store import MARKER
from megamemo.util.files import file_sha256

pytestmark = (
    pytest.mark.multiproc
)  # starts training or distributed worker processes (`-m 'not multiproc'`: the fast subset)

REPO = Path(__file__).resolve().parents[2]


class Payload:
    """Unpickling this calls os.system: it would create `path`."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def evil_pickle(dest: Path, payload: Path) -> None:
    torch.save({"state_dict": {"w": Payload(payload)}, "config": {}, "inputs": Payload(payload)}, dest)


def megamemo(*args, timeout=180) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
    )
    env.pop("MEGAMEMO_DEBUG", None)
    return forked.run_megamemo(args, env, REPO, timeout)


# refused: a failed command whose one error line (among its log lines) names the bad file
refused = partial(failed_with_one_line, among_logs=True)


@pytest.fixture(scope="module")
def trained(tiny_cfg, shards, tmp_path_factory):
    """One process, 2 steps, a committed checkpoint at step 2, and its single-device conversion."""
    root = tmp_path_factory.mktemp("untrusted")
    run(
        1,
        tiny_cfg,
        shards,
        root / "run",
        "--max-steps",
        "2",
        "--save-every",
        "2",
        "--set",
        "checkpoint.probe=false",
        "--set",
        "log.tensorboard=false",
        "--set",
        "checkpoint.async_save=false",
    )
    out = megamemo("convert", "to-single", "--ckpt", root / "run", "--out", root / "single")
    assert out.returncode == 0, out.stderr[-3000:]
    return root


def _copy_run(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


def _swap_in_pickle(ckpt: Path, payload: Path) -> Path:
    """Replace the checkpoint's first tensor file with a malicious pickle, and make the marker agree."""
    target = sorted(ckpt.glob("*.safetensors"))[0]
    evil_pickle(target, payload)
    marker = json.loads((ckpt / MARKER).read_text())
    marker["files"][target.name].update(bytes=target.stat().st_size, sha256=file_sha256(target))
    (ckpt / MARKER).write_text(json.dumps(marker))
    return target


def test_a_pickle_in_a_checkpoint_runs_nothing_on_resume_or_convert(trained, tiny_cfg, shards, tmp_path):
    """The marker made to vouch for the pickle, so that the reader itself must refuse it (a checksum mismatch is
    moved aside before anything is read: tests/runtime/test_reliability.py)."""
    run_dir = _copy_run(trained / "run", tmp_path / "run")
    payload = tmp_path / "PWNED"
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    bad = _swap_in_pickle(ckpt, payload)

    out = megamemo("convert", "to-single", "--ckpt", run_dir, "--out", tmp_path / "single")
    refused(out, bad.name)
    assert not (tmp_path / "single").exists()

    out = megamemo(
        "train",
        "--config",
        tiny_cfg,
        "--data",
        shards,
        "--run-dir",
        run_dir,
        "--max-steps",
        "3",
        "--set",
        "checkpoint.probe=false",
        "--set",
        "log.tensorboard=false",
    )
    refused(out, bad.name)
    assert not payload.exists()


def test_a_pickle_as_a_single_checkpoint_or_reference_file_runs_nothing(trained, shards, tmp_path):
    payload = tmp_path / "PWNED"
    single = _copy_run(trained / "single", tmp_path / "single")
    model = single / "model.safetensors"
    evil_pickle(model, payload)
    doc = json.loads((single / "config.json").read_text())
    doc["files"]["model.safetensors"].update(bytes=model.stat().st_size, sha256=file_sha256(model))
    (single / "config.json").write_text(json.dumps(doc))
    refused(megamemo("eval", "--ckpt", single, "--data", shards, "--split", "valid"), "model.safetensors")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the ")
    refused(
        megamemo(
            "generate",
            "--ckpt",
            single,
            "--data",
            shards,
            "--prompt-file",
            prompt,
            "--max-new-tokens",
            "4",
            "--out",
            tmp_path / "generated.txt",
        ),
        "model.safetensors",
    )
    refused(
        megamemo(
            "analyze",
            "--ckpt",
            single,
            "--data",
            shards,
            "--out",
            tmp_path / "analysis",
            "--segments",
            "4",
            "--batch-size",
            "2",
        ),
        "model.safetensors",
    )
    assert not payload.exists() and not (tmp_path / "generated.txt").exists()
    assert not (tmp_path / "analysis").exists() or not any((tmp_path / "analysis").iterdir())

    ref = tmp_path / "reference.pt"
    evil_pickle(ref, payload)
    refused(megamemo("reference-score", ref, "--out", tmp_path / "scores.pt"), "reference.pt")
    refused(megamemo("convert", "import-reference", ref, "--out", tmp_path / "imported"), "reference.pt")
    assert not payload.exists() and not (tmp_path / "scores.pt").exists() and not (tmp_path / "imported").exists()
    torch.load(ref, weights_only=False)  # the payload is real: an unrestricted load runs it
    assert payload.exists()


def test_a_flipped_byte_in_a_single_checkpoint_is_refused(trained, shards, tmp_path):
    single = _copy_run(trained / "single", tmp_path / "single")
    model = single / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x10
    model.write_bytes(bytes(data))
    refused(megamemo("eval", "--ckpt", single, "--data", shards, "--split", "valid"), "model.safetensors", "sha256")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the ")
    refused(
        megamemo("generate", "--ckpt", single, "--data", shards, "--prompt-file", prompt, "--max-new-tokens", "8"),
        "model.safetensors",
        "sha256",
    )


@pytest.mark.parametrize("kind,content", [("enwik8", b""), ("enwik8", b"x"), ("text", b"")])
def test_prepare_refuses_an_empty_or_too_short_corpus(tmp_path, kind, content):
    raw = tmp_path / "corpus.txt"
    raw.write_bytes(content)
    out_dir = tmp_path / "shards"
    out = megamemo("prepare", kind, "--raw", raw, "--out", out_dir)
    line = refused(out, "corpus.txt")
    assert "empty or too short" in line
    assert not out_dir.exists()

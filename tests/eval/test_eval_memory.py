"""`megamemo eval --memory FILE` and `megamemo generate --memory FILE`: starting from the memory that `convert
--memory` writes continues the streams it was saved from.

The memory here is built by hand (the model called segment by segment over the first K segments of each stream)
and written as convert writes it (save_single's memory.safetensors, Memory.state_dict() form):
  * eval of the rest of the streams from that memory = the scores of those segments in one hand loop over the
    whole streams (and differs from the score from an empty memory);
  * generate from one stream's memory = generate with that stream's past text put before the prompt;
  * a memory that does not fit (streams, model, rows, not a memory) is refused in one line naming the file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers.bounds import sum_bound
from helpers.eval_fixtures import one_thread, tiny_checkpoint  # noqa: F401 (one_thread: autouse fixture)
from helpers.fixture_data import ENWIK8

from megamemo import cli
from megamemo.checkpoint.single import save_single
from megamemo.commands import eval as evaluate
from megamemo.commands import generate
from megamemo.data import build
from megamemo.data.corpora import from_arrays
from megamemo.data.vocab import Vocab
from megamemo.model import Memory, generation

B, L, K, N_SEG = 3, 12, 2, 6  # streams, tgt_len, segments in memory, segments in all


@pytest.fixture(scope="module")
def streams(tmp_path_factory):
    """B streams of N_SEG * L + 1 bytes; split 'valid' holds them whole, 'test' their part from row K * L on (the
    reader cuts a split into B contiguous columns, so each column of 'test' is the tail of the same column)."""
    raw = np.frombuffer(ENWIK8.read_bytes()[: B * (N_SEG * L + 1)], dtype=np.uint8).reshape(B, -1)
    arrays = {"train": raw.reshape(-1), "valid": raw.reshape(-1), "test": raw[:, K * L :].reshape(-1)}
    out = tmp_path_factory.mktemp("streams") / "shards"
    build(
        from_arrays(arrays, Vocab.identity_bytes(), "enwik8"),
        out,
        chunk_tokens=1000,
        shard_bytes=2000,
        log=lambda m: None,
    )
    return out, torch.from_numpy(raw.astype(np.int64)).t()  # [time, B]


def _with_memory(ckpt_dir, model, memory: Memory):
    vocab = Vocab.identity_bytes()
    save_single(
        ckpt_dir,
        model.cfg,
        model.state_dict(),
        memory=memory,
        meta={"vocab": {"kind": vocab.kind, "symbols": vocab.symbols}},
    )
    return ckpt_dir / "memory.safetensors"


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
@pytest.mark.parametrize("variant", ["lamemo", "xl"])
def test_eval_from_the_saved_memory_continues_the_streams(streams, tmp_path, variant):
    shards, data = streams
    _, model = tiny_checkpoint(tmp_path / "weights", variant)
    mem, rest, tokens = None, 0.0, 0
    with torch.no_grad():
        for k in range(N_SEG):
            nll, mem = model(data[k * L : (k + 1) * L], data[k * L + 1 : (k + 1) * L + 1], mem)
            if k == K - 1:
                saved = mem
            if k >= K:
                rest += nll.double().sum().item()
                tokens += nll.numel()
    memory = _with_memory(tmp_path / "ck", model, saved)
    res = {}
    for name, extra in (("from", ["--memory", str(memory)]), ("empty", []), ("dir", ["--memory", str(memory.parent)])):
        out = tmp_path / f"{name}.json"
        assert (
            evaluate.main(
                [
                    "--ckpt",
                    str(tmp_path / "ck"),
                    "--data",
                    str(shards),
                    "--split",
                    "test",
                    "--batch-size",
                    str(B),
                    "--json",
                    str(out),
                ]
                + extra
            )
            == 0
        )
        res[name] = json.loads(out.read_text())
    assert res["from"]["tokens"] == tokens == (N_SEG - K) * L * B and res["from"]["memory"] == str(memory)
    # the same model, kernels and shapes in one process: the per-token fp32 values are equal bit for bit; only the
    # fp64 totals' order differs: 2 N u64 relative to the (positive) mean
    assert res["from"]["nll"] == pytest.approx(rest / tokens, rel=sum_bound(tokens, 1.0, torch.float64), abs=0)
    assert abs(res["empty"]["nll"] - res["from"]["nll"]) > 1e-4  # the memory matters (far above that)
    assert res["dir"]["nll"] == res["from"]["nll"]  # the converted directory names it too


def test_generate_from_one_streams_memory_continues_it(tmp_path):
    _, model = tiny_checkpoint(tmp_path / "weights", "lamemo")
    past, prompt = list(b"<page>\n  <title>Anarchism</title>\n"[: 2 * L]), list(b"  <id>12</id>\n")
    mem_len = generation.default_mem_len(model)
    mem = None
    with torch.no_grad():  # the decoder's own steps over the past: segments of tgt_len, its memory length
        for i in range(0, len(past), L):
            _, mem = model(torch.tensor(past[i : i + L])[:, None], None, mem, mem_len=mem_len)
    memory = _with_memory(tmp_path / "ck", model, mem)
    (tmp_path / "prompt").write_bytes(bytes(prompt))
    (tmp_path / "whole").write_bytes(bytes(past + prompt))
    got = {}
    for name, extra in (
        ("from", ["--prompt-file", str(tmp_path / "prompt"), "--memory", str(memory)]),
        ("whole", ["--prompt-file", str(tmp_path / "whole")]),
        ("empty", ["--prompt-file", str(tmp_path / "prompt")]),
    ):
        out = tmp_path / f"{name}.json"
        assert (
            generate.main(
                [
                    "--ckpt",
                    str(tmp_path / "ck"),
                    "--max-new-tokens",
                    "20",
                    "--greedy",
                    "--json",
                    str(out),
                    "--out",
                    str(tmp_path / f"{name}.txt"),
                ]
                + extra
            )
            == 0
        )
        got[name] = json.loads(out.read_text())["new_ids"]
    assert got["from"] == got["whole"] and len(got["from"]) == 20
    assert got["from"] != got["empty"]


def test_a_memory_that_does_not_fit_is_refused_by_name(streams, tmp_path, capsys):
    shards, data = streams
    _, model = tiny_checkpoint(tmp_path / "weights", "xl")
    with torch.no_grad():
        _, mem = model(data[:L], data[1 : L + 1])
    memory = _with_memory(tmp_path / "ck", model, mem)
    lamemo, _ = tiny_checkpoint(tmp_path / "lamemo", "lamemo")
    model_file = tmp_path / "ck" / "model.safetensors"
    base = ["--data", str(shards), "--split", "test", "--memory", str(memory)]
    for args, says, names in (
        (["--ckpt", str(tmp_path / "ck"), "--batch-size", "2"], "memory of 3 streams, the run has 2", memory),
        (["--ckpt", str(lamemo), "--batch-size", str(B)], "are not this model's (lamemo", memory),
        (
            ["--ckpt", str(tmp_path / "ck"), "--batch-size", str(B), "--mem-len", "4"],
            "12 rows is longer than the run's mem_len 4",
            memory,
        ),
        (
            ["--ckpt", str(tmp_path / "ck"), "--batch-size", str(B), "--memory", str(model_file)],
            "not a memory file",
            model_file,
        ),
    ):
        assert cli.run_command("eval", evaluate.main, base + args) == 2
        err = capsys.readouterr().err
        assert says in err and str(names) in err, err
        assert len(err.strip().splitlines()) == 1, err
    (tmp_path / "prompt").write_bytes(b"<page>")
    assert (
        cli.run_command(
            "generate",
            generate.main,
            ["--ckpt", str(tmp_path / "ck"), "--prompt-file", str(tmp_path / "prompt"), "--memory", str(memory)],
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "memory of 3 streams, the run has 1 (generate continues one" in err and str(memory) in err, err

"""`megamemo eval`: the score is the spec's exact token mean, at the training lengths and at longer memory, and
the metric follows the corpus (bpc for bytes, perplexity for words)."""

import json
import math

import numpy as np
import pytest
import torch
from helpers.bounds import sum_bound
from helpers.eval_fixtures import one_thread, reference_nll, tiny_checkpoint, word_shards  # noqa: F401 (one_thread: autouse fixture)
from helpers.shards import SMALL, sized

from megamemo import cli
from megamemo.checkpoint.single import load_single
from megamemo.commands import eval as evaluate
from megamemo.data import read_split
from megamemo.kernels import apply_kernels
from megamemo.model import MemTransformerLM

shards = sized(SMALL)


def REL(tokens):
    """The relative difference of two fp64 means of the same `tokens` positive fp32 values summed in other orders."""
    return sum_bound(tokens, 1.0, torch.float64)


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
@pytest.mark.parametrize("variant", ["lamemo", "xl", "rpe"])
def test_eval_equals_the_reference_loop(shards, tmp_path, variant):
    ckpt, _ = tiny_checkpoint(tmp_path / "ck", variant)
    out = tmp_path / "e.json"
    assert (
        evaluate.main(
            ["--ckpt", str(ckpt), "--data", str(shards), "--split", "valid", "--batch-size", "7", "--json", str(out)]
        )
        == 0
    )
    got = json.loads(out.read_text())
    model, _ = load_single(ckpt)
    apply_kernels(model, "auto", "cpu")  # the path `megamemo eval` takes on this CPU: the same sums, bit for bit
    want, tokens = reference_nll(model, read_split(shards, "valid"), 7, 12)
    assert got["tokens"] == tokens == (6000 // 7 - 1) * 7
    # the same model, path and shapes in one process: the per-token fp32 values are equal bit for bit, only the
    # fp64 totals' order differs: 2 N u64 relative to the (positive) mean, ~1.3e-12 (REL below); bpc one division more
    assert got["nll"] == pytest.approx(want, rel=REL(tokens), abs=0)
    assert got["bpc"] == pytest.approx(want / math.log(2), rel=REL(tokens + 1), abs=0)
    assert (got["tgt_len"], got["mem_len"], got["batch_size"], got["split"]) == (12, 12, 7, "valid")


@pytest.mark.parametrize("variant", ["lamemo", "xl"])
@pytest.mark.parametrize("factor", [2, 4])
def test_longer_memory_equals_a_rebuilt_model(shards, tmp_path, variant, factor):
    """mem_len 2x / 4x the training length as an evaluation override (the reference crashes unless the model is
    rebuilt): the result equals a model built with that mem_len, and memory does change the score."""
    ckpt, model = tiny_checkpoint(tmp_path / "ck", variant)
    out = tmp_path / "e.json"
    assert (
        evaluate.main(
            [
                "--ckpt",
                str(ckpt),
                "--data",
                str(shards),
                "--split",
                "test",
                "--mem-len",
                str(12 * factor),
                "--batch-size",
                "5",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    got = json.loads(out.read_text())
    rebuilt = MemTransformerLM(model.cfg.__class__.from_dict({**model.cfg.to_dict(), "mem_len": 12 * factor}))
    rebuilt.load_state_dict(model.state_dict())
    apply_kernels(rebuilt, "auto", "cpu")  # eval's path, as tiny_checkpoint's model: the same sums, bit for bit
    stream = read_split(shards, "test")
    want, _ = reference_nll(rebuilt.eval(), stream, 5, 12)
    assert got["mem_len"] == 12 * factor and math.isfinite(got["nll"])
    assert got["nll"] == pytest.approx(want, rel=REL(got["tokens"]), abs=0)  # as above: the same sums
    base, _ = reference_nll(model, stream, 5, 12)
    assert abs(got["nll"] - base) > 1e-6  # the memory length matters: far above those 2 N u64


def test_other_lengths_and_options(shards, tmp_path):
    ckpt, model = tiny_checkpoint(tmp_path / "ck", "xl")
    out = tmp_path / "e.json"
    assert (
        evaluate.main(
            [
                "--ckpt",
                str(ckpt),
                "--data",
                str(shards),
                "--split",
                "valid",
                "--tgt-len",
                "5",
                "--mem-len",
                "20",
                "--clamp-len",
                "7",
                "--same-length",
                "--batch-size",
                "4",
                "--max-segments",
                "30",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    got = json.loads(out.read_text())
    stream = read_split(shards, "valid")
    n = stream.size // 4
    data = torch.from_numpy(stream[: n * 4].astype(np.int64)).view(4, n).t()
    total, mem = 0.0, None
    with torch.no_grad():
        for s in range(30):
            nll, mem = model(
                data[5 * s : 5 * s + 5], data[5 * s + 1 : 5 * s + 6], mem, mem_len=20, clamp_len=7, same_length=True
            )
            total += nll.double().sum().item()
    assert got["tokens"] == 30 * 5 * 4 and got["segments"] == 30
    assert got["nll"] == pytest.approx(total / (30 * 5 * 4), rel=REL(600), abs=0)  # as above: the same sums


def test_word_level_corpus_reports_perplexity(tmp_path):
    data = word_shards(tmp_path / "words")
    ckpt, model = tiny_checkpoint(tmp_path / "ck", "xl", n_token=50)
    out = tmp_path / "e.json"
    assert evaluate.main(["--ckpt", str(ckpt), "--data", str(data), "--split", "test", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["metric"] == "ppl" and "bpc" not in got
    assert got["ppl"] == pytest.approx(math.exp(got["nll"]))
    want, _ = reference_nll(model, read_split(data, "test"), 10, 12)
    assert got["nll"] == pytest.approx(want, rel=REL(got["tokens"]), abs=0)  # as above: the same sums


def test_trams_flags_score_with_selection(shards, tmp_path):
    """--trams-topk/--trams-recent with pool == attended is the plain score; a smaller attended memory is not."""
    ckpt, _ = tiny_checkpoint(tmp_path / "ck", "xl")
    res = {}
    for name, extra in (
        ("plain", []),
        ("full", ["--trams-topk", "16", "--trams-recent", "8"]),
        ("sel", ["--trams-topk", "4", "--trams-recent", "4", "--trams-metric", "paper"]),
    ):
        out = tmp_path / f"{name}.json"
        assert (
            evaluate.main(
                [
                    "--ckpt",
                    str(ckpt),
                    "--data",
                    str(shards),
                    "--split",
                    "valid",
                    "--mem-len",
                    "24",
                    "--max-segments",
                    "20",
                    "--json",
                    str(out),
                ]
                + extra
            )
            == 0
        )
        res[name] = json.loads(out.read_text())
    assert res["full"]["nll"] == res["plain"]["nll"]
    assert res["sel"]["trams"] == {"pool": 24, "attend": 8, "recent": 4, "topk": 4, "metric": "paper"}
    assert res["sel"]["nll"] != res["plain"]["nll"]


def test_mem_ratio_sweep_writes_table_and_plot(shards, tmp_path):
    """Every (checkpoint, ratio) row of the sweep - JSON and table - holds the score of the spec's loop run here
    with that memory length (10 columns, the first 10 segments), and the scores do depend on the memory length."""
    a, model_a = tiny_checkpoint(tmp_path / "lamemo", "lamemo")
    b, model_b = tiny_checkpoint(tmp_path / "xl", "xl")
    plot = tmp_path / "sweep.png"
    out = tmp_path / "sweep.json"
    assert (
        evaluate.main(
            [
                "--ckpt",
                str(a),
                "--ckpt",
                str(b),
                "--data",
                str(shards),
                "--split",
                "valid",
                "--mem-ratios",
                "1,2,4",
                "--max-segments",
                "10",
                "--plot",
                str(plot),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = (tmp_path / "sweep.tsv").read_text().splitlines()
    assert len(rows) == 1 + 6 and rows[0].split("\t")[:5] == ["ckpt", "variant", "mem_ratio", "tgt_len", "mem_len"]
    assert [r.split("\t")[4] for r in rows[1:]] == ["12", "24", "48"] * 2
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in results] == ["lamemo"] * 3 + ["xl"] * 3
    stream = read_split(shards, "valid")
    for k, (model, mem_len) in enumerate((m, 12 * f) for m in (model_a, model_b) for f in (1, 2, 4)):
        want, tokens = reference_nll(model, stream, 10, 12, max_segments=10, mem_len=mem_len)
        r, row = results[k], rows[1 + k].split("\t")
        assert (r["mem_len"], r["tokens"], tokens) == (mem_len, 10 * 12 * 10, 10 * 12 * 10)
        assert r["nll"] == pytest.approx(want, rel=REL(tokens), abs=0)  # as above: the same sums
        # the table prints 6 decimals: within half a unit of the last (5e-7) of the value, 1e-6 allowed
        assert float(row[5]) == pytest.approx(want, abs=1e-6)
        assert float(row[6]) == pytest.approx(want / math.log(2), abs=1e-6)
        assert int(row[7]) == tokens
    for model_rows in (results[:3], results[3:]):
        assert len({round(r["nll"], 6) for r in model_rows}) == 3  # memory length changes every score


def test_errors_name_the_bad_input(shards, tmp_path, capsys):
    assert cli.run_command("eval", evaluate.main, ["--ckpt", str(tmp_path / "nope"), "--data", str(shards)]) == 2
    assert str(tmp_path / "nope") in capsys.readouterr().err
    ckpt, _ = tiny_checkpoint(tmp_path / "ck", "xl")
    assert cli.run_command("eval", evaluate.main, ["--ckpt", str(ckpt), "--data", str(shards), "--split", "dev"]) == 2
    assert "dev" in capsys.readouterr().err
    (ckpt / "model.safetensors").write_bytes(b"garbage")
    assert cli.run_command("eval", evaluate.main, ["--ckpt", str(ckpt), "--data", str(shards)]) == 2
    assert "model.safetensors" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--mem-len", "-5"], "--mem-len: must be >= 0 (got -5)"),
        (["--tgt-len", "-3"], "--tgt-len: must be >= 1 (got -3)"),
        (["--mem-len", "0"], "--mem-len: LaMemo needs a memory"),
    ],
)
def test_lengths_are_held_to_the_training_configs_rules(shards, tmp_path, capsys, flags, error):
    """eval, generate and the harness refuse lengths a training config would (a negative --mem-len scored as 0,
    issue 50): exit 2, one line naming the flag."""
    from megamemo.commands import generate as generate_cmd
    from megamemo.commands import harness as harness_cmd

    ckpt, _ = tiny_checkpoint(tmp_path / "ck", "lamemo")
    (tmp_path / "p.txt").write_text("some text\n")
    runs = [(evaluate.main, ["--ckpt", str(ckpt), "--data", str(shards), "--max-segments", "1"])]
    if "--mem-len" in flags:
        runs += [
            (
                generate_cmd.main,
                ["--ckpt", str(ckpt), "--prompt-file", str(tmp_path / "p.txt"), "--max-new-tokens", "2"],
            ),
            (harness_cmd.main, ["--ckpt", str(ckpt), "--text", str(tmp_path / "p.txt")]),
        ]
    for main, argv in runs:
        assert cli.run_command("eval", main, argv + flags) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and error in err[0], (argv, err)

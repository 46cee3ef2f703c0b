"""lm-evaluation-harness: `megamemo harness` reports lm-eval's bits_per_byte equal to `megamemo eval` on the same
bytes prepared as a split (batch 1), the registered model `megamemo` runs under the `lm_eval` command, the exported
directory runs under `lm_eval --model hf` with the score of megamemo's streaming eval, and the LM's loglikelihood and
generate_until agree with megamemo's scorer and greedy decoder."""

import json
import math
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.bounds import forward_bound, sum_bound
from helpers.eval_fixtures import one_thread, tiny_checkpoint  # noqa: F401 (one_thread: autouse fixture)
from helpers.fixture_data import ENWIK8

from megamemo import cli
from megamemo.commands import eval as eval_cmd
from megamemo.commands import export as export_cmd
from megamemo.commands import harness as harness_cmd
from megamemo.data import build
from megamemo.data.corpora import from_arrays
from megamemo.data.vocab import Vocab
from megamemo.export import harness
from megamemo.model.generation import generate

BYTES = {"vocab": {"kind": "bytes", "symbols": Vocab.identity_bytes().symbols}}
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
}


def utf8_text(start: int, n: int) -> bytes:
    """n bytes of the enwik8 fixture from `start`, with the pieces of characters cut at the ends dropped."""
    return ENWIK8.read_bytes()[start : start + n].decode("utf-8", errors="ignore").encode("utf-8")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ck") / "ck", "lamemo", meta=BYTES)[0]


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
def test_harness_bits_per_byte_equals_megamemo_eval_of_the_same_bytes(ckpt, tmp_path):
    text = utf8_text(50_000, 20_000)
    arrays = {
        "train": np.frombuffer(utf8_text(0, 3000), np.uint8),
        "valid": np.frombuffer(utf8_text(3000, 3000), np.uint8),
        "test": np.frombuffer(text, np.uint8),
    }
    data = tmp_path / "shards"
    build(
        from_arrays(arrays, Vocab.identity_bytes(), "enwik8"),
        data,
        chunk_tokens=1000,
        shard_bytes=4000,
        log=lambda m: None,
    )
    (tmp_path / "doc.txt").write_bytes(text)
    assert (
        eval_cmd.main(
            [
                "--ckpt",
                str(ckpt),
                "--data",
                str(data),
                "--split",
                "test",
                "--batch-size",
                "1",
                "--json",
                str(tmp_path / "eval.json"),
            ]
        )
        == 0
    )
    assert (
        harness_cmd.main(["--ckpt", str(ckpt), "--text", str(tmp_path / "doc.txt"), "--json", str(tmp_path / "h.json")])
        == 0
    )
    ev, h = json.loads((tmp_path / "eval.json").read_text()), json.loads((tmp_path / "h.json").read_text())
    assert ev["tokens"] == len(text) - 1 and h["bytes"] == len(text)
    # exactly: the same predictions (all tokens but the first, equal bit for bit: the same model, path and
    # shapes), summed over the file's bytes instead of averaged over the predicted tokens; only the fp64 totals'
    # order differs: 2 N u64 relative (rel)
    rel = sum_bound(len(text) + 2, 1.0, torch.float64)
    assert h["bits_per_byte"] == pytest.approx(ev["bpc"] * ev["tokens"] / len(text), rel=rel, abs=0)
    loglik = -h["bits_per_byte"] * math.log(2) * len(text)
    assert loglik == pytest.approx(-ev["nll"] * ev["tokens"], rel=rel, abs=0)
    words = len(re.split(r"\s+", text.decode()))
    # exp turns the exponent's error (rel times its size) into a relative error of the result
    assert h["byte_perplexity"] == pytest.approx(math.exp(-loglik / len(text)), rel=rel * (1 - loglik / len(text)))
    assert h["word_perplexity"] == pytest.approx(math.exp(-loglik / words), rel=rel * (1 - loglik / words))


@pytest.mark.parametrize("content", [b"", b" \n\t\n"])
def test_an_empty_text_is_refused(ckpt, tmp_path, capsys, content):
    (tmp_path / "empty.txt").write_bytes(content)
    assert (
        cli.run_command(
            "harness",
            harness_cmd.main,
            ["--ckpt", str(ckpt), "--text", str(tmp_path / "empty.txt"), "--json", str(tmp_path / "h.json")],
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megamemo harness: error:") and "empty.txt: empty text" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]  # no --json written


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
def test_loglikelihood_and_generate_until_agree_with_megamemo(tmp_path):
    """On a text8 (chars) model, whose every generated id decodes to text that encodes back to it."""
    t8 = Vocab.text8_alphabet()
    ck, _ = tiny_checkpoint(
        tmp_path / "ck", "lamemo", n_token=len(t8), meta={"vocab": {"kind": t8.kind, "symbols": t8.symbols}}
    )
    lm = harness.MegamemoLM(str(ck), device="cpu")

    class Req:
        def __init__(self, *args):
            self.args = args

    context = "anarchism originated as a term of abuse first used against early working class radicals "
    ids = lm.encode(context)
    greedy = generate(lm.model, ids, 30, greedy=True)
    cont = lm.vocab.decode(greedy)
    other = lm.vocab.decode([(greedy[0] + 1) % len(t8)] + greedy[1:])
    # greedy for its first 10 tokens, then one token that is not the most likely (is_greedy is about every token)
    late = greedy[:10] + [(greedy[10] + 1) % len(t8)]
    assert lm.encode(cont) == greedy and lm.encode(lm.vocab.decode(late)) == late
    (ll, is_greedy), (ll_other, not_greedy), (_, late_greedy) = lm.loglikelihood(
        [Req(context, cont), Req(context, other), Req(context, lm.vocab.decode(late))]
    )
    nll, _ = lm.score(ids + greedy)
    # the same scoring of the same tokens; the continuation's fp32 sum in another order at most (2 N u32)
    want = -float(nll[len(ids) - 1 :].sum())
    assert ll == pytest.approx(want, rel=sum_bound(len(greedy), 1.0), abs=0)
    assert is_greedy and not not_greedy and not late_greedy
    stop = cont[12:15]
    out = lm.generate_until([Req(context, {"until": [stop], "max_gen_toks": 30})])
    assert out == [cont[: cont.index(stop)]]
    rolling = lm.loglikelihood_rolling([Req(context)])
    assert rolling[0] == pytest.approx(-float(lm.score(ids)[0].sum()), rel=sum_bound(len(ids), 1.0), abs=0)


def _task(tmp: Path, text: str) -> Path:
    """An lm-eval task file over one local document (the json dataset builder reads it offline)."""
    (tmp / "doc.jsonl").write_text(json.dumps({"text": text}) + "\n")
    (tmp / "local_text.yaml").write_text(
        f"task: local_text\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp / 'doc.jsonl'}\n"
        "output_type: loglikelihood_rolling\ntest_split: test\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: bits_per_byte\n"
    )
    return tmp / "local_text.yaml"


def _lm_eval(tmp: Path, *args) -> float:
    r = subprocess.run(
        ["lm_eval", *args, "--tasks", str(tmp / "local_text.yaml"), "--output_path", str(tmp / "out")],
        env={**ENV, "HF_HOME": str(tmp / "hf_home")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(next((tmp / "out").rglob("results_*.json")).read_text())
    return res["results"]["local_text"]["bits_per_byte,none"]


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
def test_lm_eval_command_runs_model_megamemo(ckpt, tmp_path):
    text = utf8_text(30_000, 3000)
    _task(tmp_path, text.decode())
    bpb = _lm_eval(tmp_path, "--model", "megamemo", "--model_args", f"ckpt={ckpt}")
    (tmp_path / "doc.txt").write_bytes(text)
    assert (
        harness_cmd.main(["--ckpt", str(ckpt), "--text", str(tmp_path / "doc.txt"), "--json", str(tmp_path / "h.json")])
        == 0
    )
    # lm_eval adds the same per-token log-likelihoods in fp64 in its own order: 2 N u64 relative
    want = json.loads((tmp_path / "h.json").read_text())["bits_per_byte"]
    assert bpb == pytest.approx(want, rel=sum_bound(len(text), 1.0, torch.float64), abs=0)


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
def test_the_export_runs_under_lm_eval_model_hf(ckpt, tmp_path):
    """docs/export.md's `lm_eval --model hf` line: HFLM scores the document in one window after a prefix token, the
    tokenizer's BOS (a newline; without one a traceback, issue 50). The exported model carries its memory over the
    window's segments, so that is megamemo's streaming eval of prefix + document."""
    assert export_cmd.main(["hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    text = utf8_text(30_000, 1500)
    _task(tmp_path, text.decode())
    page = (Path(__file__).resolve().parents[2] / "docs" / "export.md").read_text()
    [line] = [x for x in page.splitlines() if x.startswith("lm_eval --model hf --model_args pretrained=hf/tiny")]
    words = line.split("#")[0].split()
    model_args = words[words.index("--model_args") + 1].replace("pretrained=hf/tiny", f"pretrained={tmp_path / 'hf'}")
    bpb = _lm_eval(tmp_path, "--model", "hf", "--device", "cpu", "--model_args", model_args)
    lm = harness.MegamemoLM(str(ckpt), device="cpu")
    nll, _ = lm.score([10] + lm.encode(text.decode()))
    # the exported model is another implementation of the same sums: two orders of the forward pass, per token
    # relative to its (positive) NLL and so to the total (tests/helpers/bounds.py), plus the fp32 total's N u
    rel = forward_bound(lm.model.cfg, 1.0) + sum_bound(len(text), 1.0, runs=1)
    assert bpb == pytest.approx(float(nll.sum()) / math.log(2) / len(text), rel=rel, abs=0)


def test_the_pth_hook_registers_megamemo_beside_lm_evals_own_models(tmp_path):
    """The .pth line installed into a site directory: after lm_eval.models loads, `megamemo` resolves to the LM
    class and lm-eval's own models are all still there; a Python that never imports lm_eval imports nothing."""
    from megamemo.export import lm_eval_plugin

    pth = lm_eval_plugin.install(str(tmp_path))
    assert pth.read_text().count("\n") == 1
    # -S: no site-packages .pth runs at start (the venv's own copy of the hook would hide this one); the packages
    # are put on sys.path by hand, and only the given directory's .pth files are processed (argv[2], or none)
    code = (
        "import site, sys; sys.path.append(sys.argv[1])\n"
        "[site.addsitedir(d) for d in sys.argv[2:]]; assert 'megamemo' not in sys.modules\n"
        "from lm_eval.api.registry import get_model, model_registry\n"
        "cls = get_model('megamemo'); import lm_eval.models as m\n"
        "print(cls.__module__, cls.__name__, all(k in model_registry for k in m.MODEL_MAPPING))"
    )
    env = {**ENV, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    purelib = sysconfig.get_paths()["purelib"]
    runs = [
        subprocess.run(
            [sys.executable, "-S", "-c", code, purelib, *dirs], env=env, capture_output=True, text=True, timeout=120
        )
        for dirs in ([str(tmp_path)], [])
    ]
    assert runs[0].returncode == 0, runs[0].stderr[-2000:]
    assert runs[0].stdout.split() == ["megamemo.export.harness", "MegamemoLM", "True"]
    assert runs[1].returncode != 0 and "Attempted to load model 'megamemo'" in runs[1].stderr  # without the hook


def test_the_documented_lm_eval_command_builds_the_model_with_lm_evals_device(ckpt):
    """docs/export.md's `lm_eval --model megamemo` line as lm_eval builds the model from it: --model_args plus what
    lm_eval adds to every model (its --device, `cuda:0` unless given). A device in --model_args too was a TypeError
    (issue 50); it is the same setting and wins."""
    from lm_eval.api.registry import get_model

    page = (Path(__file__).resolve().parents[2] / "docs" / "export.md").read_text()
    [line] = [x for x in page.splitlines() if x.startswith("lm_eval --model megamemo --model_args ckpt=runs/x-single")]
    words = line.split()
    model_args = re.sub(r"ckpt=[^,]+", f"ckpt={ckpt}", words[words.index("--model_args") + 1])
    given = words[words.index("--device") + 1] if "--device" in words else "cuda:0"
    for args, device in ((model_args, given), (model_args + ",device=cpu", "cuda:0"), (f"ckpt={ckpt}", "cpu")):
        lm = get_model("megamemo").create_from_arg_string(
            args, {"batch_size": 1, "max_batch_size": None, "device": device}
        )
        assert lm._device.type == "cpu" and lm.ckpt == str(ckpt)
    lm = get_model("megamemo").create_from_arg_obj(
        {"ckpt": str(ckpt), "device": "cpu", "mem_len": 5}, {"batch_size": 1, "device": "cuda:0"}
    )
    assert lm._device.type == "cpu" and lm.mem_len == 5
    assert harness.lm_eval_arguments(
        {"ckpt": "c", "device": "cpu"}, {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"}
    ) == {"ckpt": "c", "device": "cpu", "batch_size": 1}

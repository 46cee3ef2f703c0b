"""`megamemo export hf`: a tiny 2-process run, converted, and randomly initialised models of every variant (adaptive
softmax, pre-LN, same_length, clamp_len, other memory lengths, chars and words vocabularies, padded vocabularies) are
exported and loaded with transformers in a process where `import megamemo` fails (tests/helpers/hf_without_megamemo.py).
There, scored segment
by segment with the cache, the per-token NLL equals megamemo's single-device eval of the same tokens (batch 1)
within 1e-5, greedy generate() equals `megamemo generate --greedy` token for token, labels give the mean NLL, and
the exported tokenizer gives megamemo's ids. Bad input ends in one named line with nothing left behind."""

import json
import os
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import HELPERS, forked
from helpers.errors import failed_with_one_line
from helpers.eval_fixtures import one_thread, tiny_checkpoint  # noqa: F401 (one_thread: autouse)
from helpers.shards import sized

from megamemo import cli
from megamemo.commands import export as export_cmd
from megamemo.commands import generate as generate_cmd
from megamemo.data.vocab import Vocab
from megamemo.eval.evaluate import evaluate, open_batches
from megamemo.export import hf
from megamemo.interop.load import load_model

REPO = Path(__file__).resolve().parents[2]
ISOLATED = HELPERS / "hf_without_megamemo.py"
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "DS_ACCELERATOR": "cpu",
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
}
PROMPT = b"<page>\n  <title>Anarchism</title>\n  <id>12</id>\n"
BYTES = {"vocab": {"kind": "bytes", "symbols": Vocab.identity_bytes().symbols}}
TEXT8 = Vocab.text8_alphabet()
WORDS = Vocab("words", ["<eos>", "<unk>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"])

# name -> (variant, config overrides, vocabulary)
RANDOM = {
    "xl_adaptive_div2": ("xl", dict(cutoffs=[32, 96], div_val=2, tie_projs=[False, True, True]), None),
    "xl_adaptive_untied_same_length": (
        "xl",
        dict(
            cutoffs=[64],
            d_embed=24,
            tie_weight=False,
            tie_projs=[True, False],
            same_length=True,
            clamp_len=10,
            mem_len=20,
        ),
        None,
    ),
    "lamemo_xlrpe_pre_lnorm": ("lamemo_xlrpe", dict(pre_lnorm=True), None),
    "lamemo_no_interp": ("lamemo_no_interp", dict(mem_len=7), None),
    "lamemo_no_lookahead": ("lamemo_no_lookahead", dict(mem_len=20, clamp_len=15), None),
    "rpe": ("rpe", {}, None),
    "lamemo_chars": ("lamemo", dict(n_token=len(TEXT8)), TEXT8),
    "xl_words": ("xl", dict(n_token=len(WORDS)), WORDS),
    # padded vocabularies (model.n_token: auto): the padding ids masked in the full softmax and in the last cluster
    "lamemo_chars_padded": ("lamemo", dict(n_token=128, n_vocab=len(TEXT8)), TEXT8),
    "xl_adaptive_padded": (
        "xl",
        dict(n_token=384, n_vocab=256, cutoffs=[32, 96], div_val=2, tie_projs=[False, True, True]),
        None,
    ),
}
TEXTS = {"bytes": "<title>héllo</title>\n  world", "chars": "the quick brown fox", "words": "the cat sat\non a dog mat"}


def isolated(jobs: list[dict], tmp: Path) -> list[dict]:
    """Run the jobs in `python -I` with megamemo blocked; transformers' module cache in tmp."""
    (tmp / "job.json").write_text(json.dumps(jobs))
    env = {**ENV, "HF_HOME": str(tmp / "hf_home")}
    r = subprocess.run(
        [sys.executable, "-I", str(ISOLATED), str(tmp / "job.json"), str(tmp / "out.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads((tmp / "out.json").read_text())


def eval_per_token(model, batches) -> tuple[list[float], list[int]]:
    """megamemo's evaluation loop over (input, target) batches of one stream: per-token NLL, and the stream."""
    nll, stream = [], []
    batches = list(batches)
    evaluate(model, batches, on_segment=lambda n, h: nll.extend(n[:, 0].tolist()))
    for inp, _tgt in batches:
        stream += inp[:, 0].tolist()
    return nll, stream + [int(batches[-1][1][-1, 0])]


def greedy_by_megamemo(ckpt: Path, prompt_ids: list[int], n: int, tmp: Path, vocab: Vocab) -> list[int]:
    (tmp / "prompt").write_bytes(bytes(prompt_ids) if vocab.kind == "bytes" else vocab.decode(prompt_ids).encode())
    out = tmp / "gen.json"
    assert (
        generate_cmd.main(
            [
                "--ckpt",
                str(ckpt),
                "--prompt-file",
                str(tmp / "prompt"),
                "--max-new-tokens",
                str(n),
                "--greedy",
                "--json",
                str(out),
                "--out",
                str(tmp / "gen.txt"),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["prompt_ids"] == prompt_ids
    return doc["new_ids"]


shards = sized(200_000)


@pytest.fixture(scope="module")
def run_dir(shards, tmp_path_factory):
    """The issue's check: a tiny 2-process run (ZeRO-1 data parallel, lamemo), 4 steps, one committed checkpoint."""
    run = tmp_path_factory.mktemp("run") / "run"
    args = [
        "--config",
        str(REPO / "configs/tiny-cpu.yaml"),
        "--data",
        str(shards),
        "--run-dir",
        str(run),
        "--max-steps",
        "4",
        "--save-every",
        "4",
        "--set",
        "log.tensorboard=false",
    ]
    r = subprocess.run(
        [str(REPO / "launch/local.sh"), "2", *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def exported(run_dir, shards, tmp_path_factory):
    """Every model exported, and what the isolated process made of each: {name: (ckpt, model, vocab, job, out)}."""
    tmp = tmp_path_factory.mktemp("export")
    cases = {}
    out = tmp / "hf_run"
    assert export_cmd.main(["hf", "--ckpt", str(run_dir), "--out", str(out)]) == 0  # converted through to-single
    model, meta = load_model(run_dir)
    nll, stream = eval_per_token(model, open_batches(shards, "test", 1, model.cfg.tgt_len))
    cases["run"] = (
        run_dir,
        model,
        Vocab.identity_bytes(),
        {"dir": str(out), "tokens": stream, "ref_nll": nll, "bf16": True},
    )
    rng = np.random.default_rng(0)
    for name, (variant, kw, vocab) in RANDOM.items():
        vocab = vocab or Vocab.identity_bytes()
        ck, m = tiny_checkpoint(
            tmp / f"ck_{name}", variant, meta={"vocab": {"kind": vocab.kind, "symbols": vocab.symbols}}, **kw
        )
        assert export_cmd.main(["hf", "--ckpt", str(ck), "--out", str(tmp / f"hf_{name}")]) == 0
        ids = torch.from_numpy(rng.integers(0, len(vocab), 300))
        L = m.cfg.tgt_len
        batches = [
            (ids[s : s + n, None], ids[s + 1 : s + 1 + n, None]) for s in range(0, 299, L) for n in [min(L, 299 - s)]
        ]
        nll, stream = eval_per_token(m, batches)
        cases[name] = (ck, m, vocab, {"dir": str(tmp / f"hf_{name}"), "tokens": stream, "ref_nll": nll})
    jobs = []
    for m, vocab, job in (case[1:] for case in cases.values()):
        prompt = list(PROMPT) if vocab.kind == "bytes" else job["tokens"][:25]
        if vocab.kind == "words":
            prompt = [
                t for t in prompt if t != vocab.sym2idx.get("<eos>")
            ]  # a prompt file's words: <eos> only at line ends
        jobs.append(
            {
                **{k: v for k, v in job.items() if k != "ref_nll"},
                "segment": m.cfg.tgt_len,
                "prompt": prompt,
                "new": 40,
                "text": TEXTS[vocab.kind],
            }
        )
    results = isolated(jobs, tmp)
    return {name: (*cases[name], job, res) for name, job, res in zip(cases, jobs, results, strict=True)}


@pytest.mark.multiproc  # starts training processes (`-m 'not multiproc'`: the fast subset)
def test_exported_models_load_without_megamemo_and_score_as_megamemo_eval(exported):
    for name, (_ck, _model, _vocab, case, job, res) in exported.items():
        assert res["class"] == "MegamemoForCausalLM" and res["module"].startswith("transformers_modules"), name
        assert len(res["nll"]) == len(case["ref_nll"]) == len(job["tokens"]) - 1, name
        diff = np.abs(np.array(res["nll"]) - np.array(case["ref_nll"])).max()
        assert diff < 1e-5, (name, diff)


@pytest.mark.multiproc  # starts training processes (`-m 'not multiproc'`: the fast subset)
def test_the_run_scored_with_its_cache_equals_megamemo_eval_batch_1(exported, shards, tmp_path):
    from megamemo.commands import eval as eval_cmd

    run_dir, _, _, case, _, res = exported["run"]
    out = tmp_path / "eval.json"
    assert (
        eval_cmd.main(
            ["--ckpt", str(run_dir), "--data", str(shards), "--split", "test", "--batch-size", "1", "--json", str(out)]
        )
        == 0
    )
    got = json.loads(out.read_text())
    assert got["tokens"] == len(res["nll"]) == 19_999
    assert np.mean(res["nll"]) == pytest.approx(got["nll"], abs=1e-6)


@pytest.mark.multiproc  # starts training processes (`-m 'not multiproc'`: the fast subset)
def test_positions_are_computed_in_fp32_in_a_bf16_model(exported):
    res = exported["run"][-1]
    assert res["bf16_dtype"] == "torch.bfloat16" and res["bf16_positions_exact"]


@pytest.mark.multiproc  # starts training processes (`-m 'not multiproc'`: the fast subset)
def test_greedy_generate_equals_megamemo_generate_greedy(exported, tmp_path):
    for name, (ck, model, vocab, _case, job, res) in exported.items():
        if vocab.kind == "words":
            continue  # its prompt file would not give these ids back (words are re-split); bytes/chars do
        assert res["greedy"] == greedy_by_megamemo(ck, job["prompt"], 40, tmp_path, vocab), name
        assert max(res["greedy"]) < model.cfg.vocab_size, name  # never a padding id


@pytest.mark.multiproc  # starts training processes (`-m 'not multiproc'`: the fast subset)
@pytest.mark.numerics
def test_labels_give_the_mean_next_token_nll_of_the_call(exported):
    for name, (*_, res) in exported.items():
        # one set of logits, two fp32 reductions of it: transformers' cross-entropy (a log-sum-exp over the V
        # symbols, then the mean over the T targets) against log_softmax + gather + mean. Each is a recursive
        # fp32 sum, within (V + T) * u * |nll| of the exact value (u = 2**-24, fp32's unit roundoff); a label off by
        # one or a mean over the wrong count of tokens moves the loss by O(1 / T) of it or more
        bound = 2 * (res["vocab"] + res["targets"]) * 2.0**-24 * abs(res["nll_first"])
        assert abs(res["loss"] - res["nll_first"]) <= bound, (name, res["loss"], res["nll_first"], bound)


@pytest.mark.multiproc  # starts training processes (`-m 'not multiproc'`: the fast subset)
def test_exported_tokenizers_give_megamemos_ids(exported):
    from megamemo.interop.vocabulary import encode_prompt

    for name, (_ck, _model, vocab, _case, job, res) in exported.items():
        assert res["encoded"] == encode_prompt(vocab, job["text"].encode(), "text"), name
        if vocab.kind != "words":
            assert res["decoded"] == job["text"], name


def test_byte_tokenizer_maps_every_byte_to_its_id():
    """The byte -> character table in hf.py is the byte-level pre-tokenizer's, and text comes out as its UTF-8
    bytes' ids (identity vocabulary) or their positions in a smaller one (text8)."""
    from tokenizers.pre_tokenizers import ByteLevel

    table = hf._bytes_to_unicode()
    assert len(set(table)) == 256 and set(table) == set(ByteLevel.alphabet())
    tok = hf.byte_tokenizer(Vocab.identity_bytes())
    text = "".join(map(chr, range(1, 256))) + "€𝄞 \n\t"
    assert tok.encode(text).ids == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text).ids) == text
    t8 = hf.byte_tokenizer(TEXT8)
    assert t8.encode("ab z").ids == [1, 2, 0, 26]


@pytest.mark.parametrize("vocab", [Vocab.identity_bytes(), TEXT8, WORDS], ids=["bytes", "chars", "words"])
def test_exported_tokenizers_carry_the_start_token_as_bos_and_eos(tmp_path, vocab):
    """lm-eval's `--model hf` prefixes with the tokenizer's BOS (a traceback without one, issue 50) and generate()
    pads with its EOS: both are the token megamemo starts an empty context from (<eos>, a newline, a space), and
    text that spells it ("Ċ" is the newline's byte-level character) still encodes to megamemo's ids."""
    from transformers import AutoTokenizer

    from megamemo.interop.vocabulary import encode_prompt, start_symbol

    ck, _ = tiny_checkpoint(
        tmp_path / "ck", "xl", n_token=len(vocab), meta={"vocab": {"kind": vocab.kind, "symbols": vocab.symbols}}
    )
    assert export_cmd.main(["hf", "--ckpt", str(ck), "--out", str(tmp_path / "hf")]) == 0
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    start = vocab.sym2idx[start_symbol(vocab)]
    assert tok.bos_token_id == tok.eos_token_id == start, (tok.bos_token, tok.eos_token)
    text = {"bytes": "a\u010ab\nc <eos>", "chars": "the cat", "words": "the <eos> cat\nsat"}[vocab.kind]
    assert tok(text).input_ids == encode_prompt(vocab, text.encode(), "text")
    if vocab.kind == "bytes":
        assert tok.decode(tok(text).input_ids) == text


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_the_weights_are_as_readable_as_the_other_files(tmp_path, umask):
    """safetensors writes 0600; the export and a converted checkpoint give their weights the mode of every other new
    file (0666 less the umask), so colleagues on a shared cluster can read them (issue 50)."""
    old = os.umask(umask)
    try:
        ck, _ = tiny_checkpoint(tmp_path / "ck", "xl", meta=BYTES)
        assert export_cmd.main(["hf", "--ckpt", str(ck), "--out", str(tmp_path / "hf")]) == 0
    finally:
        os.umask(old)
    for d in (ck, tmp_path / "hf"):
        modes = {p.name: p.stat().st_mode & 0o777 for p in d.iterdir() if p.is_file()}
        assert modes["model.safetensors"] == modes["config.json"] == 0o666 & ~umask, (d, modes)


# ---- bad input -------------------------------------------------------------------------------------------------
def run_export(*args) -> subprocess.CompletedProcess:
    return forked.run_megamemo(["export", "hf", *args], ENV, REPO, timeout=300)


def export_in_process(capsys, *args) -> subprocess.CompletedProcess:
    rc = cli.run_command("export", export_cmd.main, ["hf", *map(str, args)])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out.out, out.err)


# refused: exit status 2 and one line that names the bad input
export_error = partial(failed_with_one_line, returncode=2, prefix="megamemo export: error:")


@pytest.mark.multiproc  # starts training processes (`-m 'not multiproc'`: the fast subset)
def test_an_uncommitted_checkpoint_is_refused(run_dir, tmp_path):
    step = next((run_dir / "checkpoints").glob("step_*"))
    copy = tmp_path / "ckpts" / step.name
    shutil.copytree(step, copy)
    (copy / "COMMITTED").unlink()
    r = run_export("--ckpt", copy, "--out", tmp_path / "out")
    export_error(r, str(copy))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpts"]


def test_a_corrupt_checkpoint_is_refused(tmp_path, capsys):
    ck, _ = tiny_checkpoint(tmp_path / "ck", "xl", meta=BYTES)
    f = ck / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    r = export_in_process(capsys, "--ckpt", ck, "--out", tmp_path / "out")
    export_error(r, "model.safetensors", "corrupt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_an_existing_output_needs_overwrite(tmp_path, capsys):
    ck, _ = tiny_checkpoint(tmp_path / "ck", "rpe", meta=BYTES)
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    export_error(export_in_process(capsys, "--ckpt", ck, "--out", out), str(out), "--overwrite")
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    r = export_in_process(capsys, "--ckpt", ck, "--out", out, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert (out / "model.safetensors").is_file() and not (out / "mine.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "out"]


def test_an_unknown_variant_is_refused(tmp_path, capsys):
    ck, _ = tiny_checkpoint(tmp_path / "ck", "xl", meta=BYTES)
    doc = json.loads((ck / "config.json").read_text())
    doc["model"]["variant"] = "mamba"
    (ck / "config.json").write_text(json.dumps(doc))
    export_error(export_in_process(capsys, "--ckpt", ck, "--out", tmp_path / "out"), "variant", "'mamba'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_a_recorded_subword_tokenizer_is_copied_and_checked(tmp_path):
    """A checkpoint recording {kind, vocab_size, file, sha256} (the subword tokenizers' record) gets that file."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from megamemo.util.files import file_sha256

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [PROMPT.decode() * 20], trainers.BpeTrainer(vocab_size=60, special_tokens=["<|endoftext|>", "<unk>"])
    )
    src = tmp_path / "tokenizer.json"
    tok.save(str(src))
    rec = {
        "kind": "bpe",
        "vocab_size": tok.get_vocab_size(),
        "file": "tokenizer.json",
        "sha256": file_sha256(src),
        "eod": "<|endoftext|>",
        "eod_id": 0,
    }
    ck, _ = tiny_checkpoint(tmp_path / "ck", "xl", n_token=tok.get_vocab_size(), meta={"tokenizer": rec})
    shutil.copyfile(src, ck / "tokenizer.json")
    assert export_cmd.main(["hf", "--ckpt", str(ck), "--out", str(tmp_path / "out")]) == 0
    got = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "out"))
    assert got("<title>Anarchism</title>")["input_ids"] == tok.encode("<title>Anarchism</title>").ids
    assert got.bos_token_id == got.eos_token_id == 0  # the record's end of document (lm-eval's prefix)
    (ck / "tokenizer.json").write_text((ck / "tokenizer.json").read_text().replace("<unk>", "<UNK>"))
    with pytest.raises(hf.ExportError, match="tokenizer.json: sha256 differs"):
        hf.export_hf(ck, hf.Request(out=str(tmp_path / "out2")))
    assert not (tmp_path / "out2").exists() and not list(tmp_path.glob(".export-*"))
    assert not list(tmp_path.glob(".out2.*"))  # nor the new directory under its temporary name


def test_the_modeling_code_ships_as_package_data():
    import tomllib

    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {p.name for g in globs["megamemo.export"] for p in (REPO / "megamemo/export").glob(g)}
    assert set(hf.CODE_FILES) <= shipped

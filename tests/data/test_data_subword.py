"""Subword corpora (`megamemo prepare text --tokenizer bpe:N|FILE --workers N`): the same bytes for any number of
workers, whole documents split by the recorded seed, the exact byte-level round trip, tokenizer.json /
SentencePiece / parquet / directory inputs, each bad input ending in one line with nothing left behind, and bits
per byte against hand-computed values. Documents: tests/fixtures/text/wiki_paragraphs.jsonl (see its README)."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers import forked
from helpers.env import cpu_env
from helpers.fixture_data import TEXT

from megamemo.data import read_split
from megamemo.data.cli import prepare_main
from megamemo.data.tokenizer import SubwordTokenizer, train_bpe

# Tolerances here: pytest.approx (default rel 1e-6) and rel=1e-12 compare float64 evaluations of the same formula
# (IEEE arithmetic, rounded alike on any CPU; numpy's sums in another order at most): they differ by a few u64
# (1.1e-16) relative, so either tolerance only says 'the same number'. Nothing here depends on a CPU's kernels.

REPO = Path(__file__).resolve().parents[2]
DOCS = TEXT / "wiki_paragraphs.jsonl"
EOD = "<|endoftext|>"
# not only ASCII: accents, CJK, an emoji, tabs, blank lines, trailing spaces, \r\n
ODD_DOCS = [
    f"doc {i}: caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001f600\tx  \n\n  y {'z' * (i % 7)} \r\n" for i in range(30)
] + ["", "   ", "\u00a0\u2028"]


def docs() -> list[str]:
    return [json.loads(line)["text"] for line in DOCS.read_text(encoding="utf-8").splitlines()]


def prepare(*args) -> int:
    return prepare_main(["text", *map(str, args), "--quiet"])


def expected_split(i: int, seed: int = 1234, ratio=(90, 5, 5)) -> str:
    """The documented rule, stated independently: per group of sum(ratio) documents a seeded permutation."""
    slot = int(np.random.default_rng([seed, i // sum(ratio)]).permutation(sum(ratio))[i % sum(ratio)])
    return "train" if slot < ratio[0] else "valid" if slot < ratio[0] + ratio[1] else "test"


def sha(p) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_a_bpe_that_saturates_below_its_size_is_said_in_one_line(tmp_path, capsys):
    """Issue 50: bpe:N on a corpus too small for N merges stops short (no pair left that occurs twice); prepare says
    so - even under --quiet - and the manifest records the size it got (what model.n_token: auto takes)."""
    assert prepare("--raw", DOCS, "--jsonl-field", "text", "--tokenizer", "bpe:60000", "--out", tmp_path / "a") == 0
    got = json.loads((tmp_path / "a" / "manifest.json").read_text())["vocab"]["size"]
    assert 257 < got < 60000
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"[prepare] warning: the BPE saturated at {got:,} of the 60,000 symbols asked for (no pair of the "
        f"train split left that occurs twice): the manifest records {got:,}; a config's model.n_token: "
        f"auto sizes its tables to it, an explicit n_token: 60000 would train {60000 - got:,} ids that "
        f"never occur"
    ], err
    assert prepare("--raw", DOCS, "--jsonl-field", "text", "--tokenizer", f"bpe:{got}", "--out", tmp_path / "b") == 0
    assert "saturated" not in capsys.readouterr().err  # the size it reached: nothing to say


@pytest.fixture(scope="module")
def bpe_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("subword")
    for w in (1, 2):
        assert (
            prepare(
                "--raw",
                DOCS,
                "--jsonl-field",
                "text",
                "--tokenizer",
                "bpe:2000",
                "--workers",
                w,
                "--out",
                base / f"w{w}",
                "--chunk-tokens",
                4096,
                "--shard-size",
                "64K",
            )
            == 0
        )
    return base / "w1", base / "w2"


def test_workers_1_and_2_write_the_same_bytes(bpe_dirs):
    one, two = bpe_dirs
    m1, m2 = (json.loads((d / "manifest.json").read_text()) for d in bpe_dirs)
    assert m1 == m2
    assert len(m1["splits"]["train"]["shards"]) >= 2  # several shards, so their order is exercised
    files = sorted(p.name for p in one.iterdir())
    assert files == sorted(p.name for p in two.iterdir())
    for name in files:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    tok = m1["tokenizer"]
    assert tok["kind"] == "subword" and tok["vocab_size"] == 2000 and tok["file"] == "tokenizer.json"
    assert tok["sha256"] == sha(one / "tokenizer.json") and tok["eod"] == EOD and tok["eod_id"] == 0
    assert m1["vocab"]["kind"] == "subword" and m1["vocab"]["file"] == "tokenizer.json"
    assert m1["dtype"] == "<u2"
    assert m1["source"]["split"]["seed"] == 1234 and m1["source"]["split"]["by"] == "whole documents"
    # the BPE was trained on the train split only: training it here on those documents gives the same file
    train_docs = [d for i, d in enumerate(docs()) if expected_split(i) == "train"]
    assert train_bpe(iter(train_docs), 2000).data == (one / "tokenizer.json").read_bytes()


def test_whole_documents_split_by_seed_and_decoded_exactly(bpe_dirs):
    d = bpe_dirs[0]
    m = json.loads((d / "manifest.json").read_text())
    tok = SubwordTokenizer.from_file(d / "tokenizer.json")
    table = tok.token_bytes()
    all_docs = docs()
    for split in ("train", "valid", "test"):
        mine = [t for i, t in enumerate(all_docs) if expected_split(i) == split]
        assert mine, split
        ids = read_split(d, split)
        assert tok.decode(ids) == "".join(t + EOD for t in mine)  # byte-level BPE: exact
        assert int((ids == 0).sum()) == len(mine) and ids[-1] == 0  # one <|endoftext|> after each
        sp = m["splits"][split]
        assert sp["n_documents"] == len(mine)
        assert sp["n_bytes"] == sum(len(t.encode("utf-8")) for t in mine)
        assert int(table[ids].sum()) == sp["n_bytes"]  # bytes per token add up
        starts = np.frombuffer((d / sp["documents"]["file"]).read_bytes(), dtype="<u8")
        assert starts.tolist() == [0] + (np.flatnonzero(ids == 0) + 1)[:-1].tolist()  # after each end token
        assert sp["documents"]["n_documents"] == len(mine)


def test_a_corpus_of_several_blocks_is_the_same_for_1_2_and_3_workers(tmp_path):
    """3.3 MB of documents: several of the 1 MiB blocks the reader cuts the input into (whole documents each,
    megamemo/data/documents.py), tokenized by 1, 2 and 3 worker processes. The shards are the same bytes, and every
    document - the last of a block and the first of the next among them - is in the split its index in the whole
    stream draws (the running index across blocks), decoded exactly, starting where the document index says, some of
    them across chunk and shard boundaries."""
    from megamemo.data.documents import BLOCK_BYTES

    rng = np.random.default_rng(36)
    words = [f"w{i}" for i in range(500)] + ["caf\u00e9", "\u65e5\u672c", "\U0001f600", "a\tb", "\n"]
    texts, size = [], 0
    while size < 3.3e6:
        texts.append(" ".join(rng.choice(words, int(rng.integers(1, 3000)))))
        size += len(json.dumps({"text": texts[-1]})) + 1
    raw = tmp_path / "big.jsonl"
    raw.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert raw.stat().st_size > 3 * BLOCK_BYTES
    tok_file = tmp_path / "t.json"
    tok_file.write_bytes(train_bpe(iter(texts[:40]), 300).data)
    outs = [tmp_path / f"w{w}" for w in (1, 2, 3)]
    for w, out in zip((1, 2, 3), outs, strict=True):
        assert (
            prepare(
                "--raw",
                raw,
                "--tokenizer",
                tok_file,
                "--workers",
                w,
                "--out",
                out,
                "--chunk-tokens",
                4096,
                "--shard-size",
                "256K",
            )
            == 0
        )
    names = sorted(p.name for p in outs[0].iterdir())
    for out in outs[1:]:
        assert sorted(p.name for p in out.iterdir()) == names
        for name in names:
            assert (out / name).read_bytes() == (outs[0] / name).read_bytes(), (out.name, name)
    m = json.loads((outs[0] / "manifest.json").read_text())
    tok = SubwordTokenizer.from_file(tok_file)
    # a BPE is trained on the documents of the train split: the same running index picks them
    from megamemo.data.documents import DocumentSplit, list_sources
    from megamemo.data.subword import _train_texts

    assert list(_train_texts(list_sources([raw]), "text", DocumentSplit(), [str(raw)])) == [
        t for i, t in enumerate(texts) if expected_split(i) == "train"
    ]
    for split in ("train", "valid", "test"):
        mine = [t for i, t in enumerate(texts) if expected_split(i) == split]
        ids = read_split(outs[0], split)
        starts = np.frombuffer((outs[0] / m["splits"][split]["documents"]["file"]).read_bytes(), "<u8").astype(int)
        assert m["splits"][split]["n_documents"] == len(mine) == starts.size
        ends = np.append(starts[1:], ids.size)
        for t, a, b in zip(mine, starts, ends, strict=True):
            assert tok.decode(ids[a:b]) == t + EOD
        if split == "train":
            shard_ends = np.cumsum([sh["n_tokens"] for sh in m["splits"][split]["shards"]])[:-1]
            assert len(shard_ends) >= 3 and all(((starts < e) & (e < ends)).any() for e in shard_ends[:3])


def test_given_tokenizer_json_parquet_and_directory_agree(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = train_bpe(iter(docs()[:200] + ODD_DOCS), 400)
    tok_file = tmp_path / "my-tokenizer.json"
    tok_file.write_bytes(tok.data)
    jsonl = tmp_path / "odd.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(ODD_DOCS)))
    pq.write_table(
        pa.table({"text": ODD_DOCS, "n": list(range(len(ODD_DOCS)))}), tmp_path / "odd.parquet", row_group_size=7
    )
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    for i, t in enumerate(ODD_DOCS):  # sorted by relative path: a-*.txt, then sub/...
        (folder / (f"a-{i:03d}.txt" if i < 20 else f"sub/b-{i:03d}.txt")).write_bytes(t.encode("utf-8"))
    outs = {}
    for name, raw in (("jsonl", jsonl), ("parquet", tmp_path / "odd.parquet"), ("folder", folder)):
        outs[name] = tmp_path / f"out-{name}"
        assert prepare("--raw", raw, "--tokenizer", tok_file, "--split", "1,1,1", "--out", outs[name]) == 0
    ms = {k: json.loads((v / "manifest.json").read_text()) for k, v in outs.items()}
    assert ms["jsonl"]["splits"] == ms["parquet"]["splits"] == ms["folder"]["splits"]
    assert ms["jsonl"]["tokenizer"]["sha256"] == sha(tok_file) == sha(outs["jsonl"] / "tokenizer.json")
    assert ms["jsonl"]["tokenizer"]["origin"] == "given my-tokenizer.json"
    for split in ("train", "valid", "test"):
        mine = [t for i, t in enumerate(ODD_DOCS) if expected_split(i, ratio=(1, 1, 1)) == split]
        assert tok.decode(read_split(outs["jsonl"], split)) == "".join(t + EOD for t in mine)


def test_sentencepiece_model(tmp_path):
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(docs()),
        model_writer=model,
        vocab_size=600,
        model_type="bpe",
        byte_fallback=True,
        num_threads=1,
        minloglevel=2,
    )
    (tmp_path / "sp.model").write_bytes(model.getvalue())
    out = tmp_path / "out"
    assert prepare("--raw", DOCS, "--tokenizer", tmp_path / "sp.model", "--out", out) == 0
    m = json.loads((out / "manifest.json").read_text())
    t = m["tokenizer"]
    assert (t["library"], t["file"], t["vocab_size"], t["eod"]) == ("sentencepiece", "tokenizer.model", 600, "</s>")
    assert t["sha256"] == sha(tmp_path / "sp.model")
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    valid = [d for i, d in enumerate(docs()) if expected_split(i) == "valid"]
    want = [i for d in valid for i in sp.encode(d) + [sp.eos_id()]]
    assert read_split(out, "valid").tolist() == want


# ---- bad input: one line, nothing left behind ---------------------------------------------------------------------
def _bad_inputs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "garbage.json").write_text("{ this is not a tokenizer")
    (tmp_path / "garbage.model").write_bytes(b"\x00\x01 not a sentencepiece model")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "nofield.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "nocol.parquet")
    return {
        "missing tokenizer": (["--raw", DOCS, "--tokenizer", tmp_path / "nope.json"], "unreadable"),
        "malformed tokenizer.json": (
            ["--raw", DOCS, "--tokenizer", tmp_path / "garbage.json"],
            "not a tokenizers tokenizer.json",
        ),
        "malformed .model": (["--raw", DOCS, "--tokenizer", tmp_path / "garbage.model"], "not a SentencePiece model"),
        "vocabulary over the dtype": (
            ["--raw", DOCS, "--tokenizer", "bpe:300", "--dtype", "u1"],
            "300 symbols does not fit the token dtype <u1",
        ),
        "no documents": (["--raw", tmp_path / "empty.jsonl", "--tokenizer", "bpe:300"], "no documents"),
        "jsonl line without the field": (
            ["--raw", tmp_path / "nofield.jsonl", "--tokenizer", "bpe:300"],
            "nofield.jsonl: line 2: no field 'text'",
        ),
        "parquet without the column": (
            ["--raw", tmp_path / "nocol.parquet", "--tokenizer", "bpe:300"],
            "has no column 'text'",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing tokenizer",
        "malformed tokenizer.json",
        "malformed .model",
        "vocabulary over the dtype",
        "no documents",
        "jsonl line without the field",
        "parquet without the column",
    ],
)
def test_bad_input_is_one_line_and_leaves_nothing(case, tmp_path, capsys):
    args, message = _bad_inputs(tmp_path)[case]
    out = tmp_path / "out"
    assert prepare(*args, "--out", out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megamemo prepare: error:") and message in err[0], err
    assert not out.exists()


def test_bad_document_in_a_worker_is_one_line_and_leaves_nothing(tmp_path, capsys):
    """A record without the field far into the file, found by a worker process after shards were written."""
    lines = [json.dumps({"text": t}) for t in docs()] * 8 + ['{"title": "no text"}']
    raw = tmp_path / "late.jsonl"
    raw.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    tok = tmp_path / "t.json"
    tok.write_bytes(train_bpe(iter(docs()[:50]), 300).data)
    assert (
        prepare(
            "--raw",
            raw,
            "--tokenizer",
            tok,
            "--workers",
            2,
            "--out",
            out,
            "--shard-size",
            "16K",
            "--chunk-tokens",
            1024,
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"late.jsonl: line {len(lines)}: no field 'text'" in err[0], err
    assert not out.exists()


# ---- bits per byte ---------------------------------------------------------------------------------------------------
def test_bits_per_byte_by_hand():
    import torch

    from megamemo.eval.evaluate import evaluate
    from megamemo.train.metrics import Metrics
    from megamemo.util.units import bits_per_byte

    assert bits_per_byte(4 * math.log(2.0), 8) == pytest.approx(0.5)  # 4 bits over 8 bytes

    class Half(torch.nn.Module):  # half a bit on every target
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, inp, tgt, mem, **kw):
            return torch.full(tgt.shape, 0.5 * math.log(2.0)), mem

    tgt = torch.tensor([[1, 2], [3, 0]])
    out = evaluate(Half(), [(tgt, tgt)], token_bytes=torch.tensor([0, 1, 2, 3]))
    # 4 tokens x 0.5 bits = 2 bits; bytes 1 + 2 + 3 + 0 = 6
    assert out["bytes"] == 6 and out["bits_per_byte"] == pytest.approx(2 / 6)
    # inputs and targets that differ, over two segments: the bytes are the scored targets' (1+2+3+0 + 2+2 = 10), not
    # the inputs' (4 x 3 + 2 x 1 = 14); 6 tokens x 0.5 bits = 3 bits
    batches = [(torch.tensor([[3, 3], [3, 3]]), tgt), (torch.tensor([[1, 1]]), torch.tensor([[2, 2]]))]
    out = evaluate(Half(), batches, token_bytes=torch.tensor([0, 1, 2, 3]))
    assert (out["tokens"], out["bytes"]) == (6, 10) and out["bits_per_byte"] == pytest.approx(3 / 10)
    m = Metrics(
        "/nonexistent",
        enabled=False,
        every=1,
        unit="ppl",
        tensorboard=False,
        start_step=0,
        bytes_per_token={"train": 4.0, "valid": 2.0},
    )
    # 2 bits per token, 4 bytes per token on train -> 0.5; 2 bytes per token on valid -> 1.0
    assert m.derived(2 * math.log(2.0))["bits_per_byte"] == pytest.approx(0.5)
    assert m.derived(2 * math.log(2.0), "valid")["bits_per_byte"] == pytest.approx(1.0)
    assert m.derived(2 * math.log(2.0))["ppl"] == pytest.approx(4.0)


# ---- the subword path end to end, 2 processes
# -------------------------------------------------------------------------
def _megamemo(*args, timeout=600):
    return forked.run_megamemo(args, cpu_env(), REPO, timeout)


def _one_error_line(r, rc: int, message: str) -> None:
    err = r.stderr.strip().splitlines()
    assert r.returncode == rc and len(err) == 1 and message in err[0], r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.multiproc  # starts training processes (`-m 'not multiproc'`: the fast subset)
def test_subword_cpu_config_trains_on_two_processes_then_eval_convert_generate(bpe_dirs, tmp_path):
    """configs/subword-cpu.yaml with launch/local.sh 2 on the bpe:2000 shards (shortened to 20 steps): train and
    validation lines and records carry bits per byte; eval --json reports bits_per_byte; to-single carries
    tokenizer.json and generate decodes with it without the data directory; data of another tokenizer is refused
    at resume, eval and generate in one line."""
    data = tmp_path / "data"
    shutil.copytree(bpe_dirs[1], data)
    other = tmp_path / "other"  # the same documents, another tokenizer (fits n_token 2000)
    assert prepare("--raw", DOCS, "--tokenizer", "bpe:1000", "--out", other) == 0
    run = tmp_path / "run"
    r = subprocess.run(
        [
            "bash",
            str(REPO / "launch" / "local.sh"),
            "2",
            "--config",
            str(REPO / "configs" / "subword-cpu.yaml"),
            "--data",
            str(data),
            "--run-dir",
            str(run),
            "--max-steps",
            "20",
            "--set",
            "checkpoint.save_every=10",
            "--set",
            "eval.every=10",
            "--set",
            "log.every=5",
            "--set",
            "log.tensorboard=false",
        ],
        cwd=REPO,
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "world 2 (env)" in out, out[-4000:]
    m = json.loads((data / "manifest.json").read_text())
    per_byte = {s: m["splits"][s]["n_bytes"] / m["splits"][s]["n_tokens"] for s in ("train", "valid")}
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train, evals = [x for x in recs if x["kind"] == "train"], [x for x in recs if x["kind"] == "eval"]
    assert len(train) == 20 and len(evals) == 2
    for x in train:
        assert x["bits_per_byte"] == pytest.approx(x["loss"] / math.log(2) / per_byte["train"], rel=1e-12)
    for x in evals:
        assert x["bits_per_byte"] == pytest.approx(x["loss"] / math.log(2) / per_byte["valid"], rel=1e-12)
    step5 = next(x for x in train if x["step"] == 5)
    assert re.search(rf"step +5 \| .* \| ppl {step5['ppl']:.4f} \| bpb {step5['bits_per_byte']:.4f} \|", out)
    assert re.search(r"eval +10 \| valid loss [0-9.]+ \| ppl [0-9.]+ \| bpb [0-9.]+ \|", out), out[-3000:]

    r = _megamemo("eval", "--ckpt", run, "--data", data, "--split", "test", "--json", tmp_path / "e.json")
    assert r.returncode == 0, r.stderr[-3000:]
    e = json.loads((tmp_path / "e.json").read_text())
    # by hand: the test split in eval's 10 contiguous columns (spec 4.3), every token of a column but its first a
    # scored target, each standing for its UTF-8 bytes
    test_ids = read_split(data, "test")
    columns = test_ids[: test_ids.size // 10 * 10].reshape(10, -1)
    table = SubwordTokenizer.from_file(data / "tokenizer.json").token_bytes()
    assert e["metric"] == "ppl" and e["tokens"] == columns[:, 1:].size
    assert e["bytes"] == int(table[columns[:, 1:]].sum()) != int(table[columns[:, :-1]].sum())
    assert e["bits_per_byte"] == pytest.approx(e["nll"] * e["tokens"] / math.log(2) / e["bytes"], rel=1e-12)
    assert f"bits_per_byte {e['bits_per_byte']:.4f}" in r.stdout

    single = tmp_path / "single"
    r = _megamemo("convert", "to-single", "--ckpt", run, "--out", single)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = json.loads((single / "config.json").read_text())
    assert cfg["tokenizer"]["file"] == "tokenizer.json" and cfg["tokenizer"]["vocab_size"] == 2000
    assert cfg["tokenizer"]["sha256"] == sha(single / "tokenizer.json") == m["tokenizer"]["sha256"]
    assert cfg["files"]["tokenizer.json"]["sha256"] == cfg["tokenizer"]["sha256"]

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The island is ")
    shutil.move(data, tmp_path / "moved")  # generate needs only the converted checkpoint
    r = _megamemo(
        "generate", "--ckpt", single, "--prompt-file", prompt, "--max-new-tokens", 6, "--json", tmp_path / "g.json"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    g = json.loads((tmp_path / "g.json").read_text())
    tok = SubwordTokenizer.from_file(single / "tokenizer.json")
    assert g["prompt_ids"] == tok.encode("The island is ") and g["text"] == tok.decode(g["new_ids"])

    mismatch = "differs from the one"
    _one_error_line(_megamemo("eval", "--ckpt", single, "--data", other, "--max-segments", 1), 2, mismatch)
    _one_error_line(_megamemo("generate", "--ckpt", single, "--data", other, "--prompt-file", prompt), 2, mismatch)
    r = _megamemo(
        "train",
        "--config",
        REPO / "configs" / "subword-cpu.yaml",
        "--data",
        other,
        "--run-dir",
        run,
        "--max-steps",
        25,
        "--set",
        "log.tensorboard=false",
    )
    _one_error_line(r, 2, "a different tokenizer")


def test_plot_shows_bits_per_byte_beside_perplexity(bpe_dirs, tmp_path):
    """A subword run (records with bits_per_byte, data.dir a subword corpus): a perplexity panel and a bits per byte
    panel whose points are the records' values."""
    import matplotlib

    matplotlib.use("Agg")
    from megamemo.eval import plot

    run = tmp_path / "run"
    run.mkdir()
    recs = [
        {"kind": "train", "step": s, "loss": 6.0 - 0.1 * s, "bits_per_byte": 3.0 - 0.05 * s, "tokens": 64}
        for s in range(1, 6)
    ] + [{"kind": "eval", "step": 5, "split": "valid", "loss": 5.6, "bits_per_byte": 2.8}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "config.yaml").write_text(f"data: {{dir: {bpe_dirs[0]}}}\nmodel: {{n_token: 2000}}\n")
    r = plot.load_run(run)
    assert r.metric == "ppl"
    fig, drawn = plot.figure([r])
    ppl_ax, bpb_ax = fig.axes
    assert ppl_ax.get_ylabel() == "perplexity (per token)" and bpb_ax.get_ylabel() == "bits per byte"
    train_line = bpb_ax.get_lines()[0]
    assert list(train_line.get_ydata()) == pytest.approx([3.0 - 0.05 * s for s in range(1, 6)])
    assert list(drawn[run.name, "train"].get_ydata()) == pytest.approx([math.exp(6.0 - 0.1 * s) for s in range(1, 6)])


@pytest.mark.parametrize("workers", [1, 2])
def test_workers_read_at_most_a_bounded_number_of_blocks_ahead(workers):
    """Memory does not grow with the corpus: when the k-th encoded block comes out, at most k + 2N + 1 blocks
    (N workers; one with no workers) have been read from the input."""
    from megamemo.data.subword import encoded_blocks

    tok = train_bpe(iter(docs()[:100]), 300)
    pulled = []

    def blocks():
        for i in range(40):
            pulled.append(i)
            yield 10, ("docs", "synthetic", i, [f"document {i} " * 50])

    ahead = []
    for k, (_, (lengths, ids, nbytes)) in enumerate(encoded_blocks(tok, blocks(), workers)):
        ahead.append(len(pulled) - (k + 1))
        assert tok.decode(ids) == f"document {k} " * 50 + EOD  # in input order
        assert lengths.tolist() == [ids.size] and nbytes.tolist() == [len(f"document {k} ") * 50]
    assert len(ahead) == 40 and max(ahead) <= (2 * workers + 1 if workers > 1 else 0)

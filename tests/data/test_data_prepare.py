"""`megamemo prepare`: split sizes, token streams and vocabularies against plain re-computations from the raw
files (the Transformer-XL / awd-lstm preprocessing written out directly here), on the repository's text
fixtures (tests/fixtures/text)."""

import collections
import glob
import json
import subprocess
import sys

import numpy as np
import pytest
import webdataset as wds
import zstandard
from helpers.fixture_data import ENWIK8, TEXT8, WIKITEXT

from megamemo.data import load_manifest, load_vocab, read_split
from megamemo.data.cli import prepare_main
from megamemo.data.corpora import split_points


def prepare(*argv):
    assert prepare_main([*map(str, argv), "--quiet"]) == 0


def xl_vocab(token_lists, special=()):
    """Transformer-XL Vocab.build_vocab: specials, then Counter.most_common order."""
    counter = collections.Counter()
    for toks in token_lists:
        counter.update(toks)
    return list(special) + [s for s, _ in counter.most_common() if s not in special]


def test_split_points_standard_enwik8():
    # the standard split of the 10^8-byte file, and the same proportions for a prefix
    assert split_points(10**8) == {
        "train": (0, 90_000_000),
        "valid": (90_000_000, 95_000_000),
        "test": (95_000_000, 10**8),
    }
    n = 4_154_063
    r = split_points(n)
    assert r["test"][1] - r["test"][0] == r["valid"][1] - r["valid"][0] == int(n * 0.05)


def test_enwik8_bytes_keeps_every_byte(tmp_path):
    raw_path = ENWIK8
    raw = raw_path.read_bytes()
    n = len(raw)
    h = n * 5 // 100
    prepare("enwik8", "--raw", raw_path, "--out", tmp_path, "--chunk-tokens", 4096, "--shard-size", "32K")
    m = load_manifest(tmp_path)
    assert m["format_version"] == 1 and m["corpus"] == "enwik8" and m["dtype"] == "<u1"
    assert m["vocab"]["size"] == 256 and len(load_vocab(tmp_path)) == 256
    expected = {"train": raw[: n - 2 * h], "valid": raw[n - 2 * h : n - h], "test": raw[n - h :]}
    assert len(m["splits"]["train"]["shards"]) > 1
    for split, data in expected.items():
        assert m["splits"][split]["n_tokens"] == len(data)
        assert read_split(tmp_path, split).tobytes() == data
        # ids back to text (what generate prints): the split's own bytes, as UTF-8 with replacement
        assert load_vocab(tmp_path).decode(read_split(tmp_path, split)) == data.decode("utf-8", errors="replace")
        for s in m["splits"][split]["shards"]:
            assert (tmp_path / s["name"]).stat().st_size == s["bytes"]


def test_enwik8_reference_matches_prep_enwik8(tmp_path):
    raw = ENWIK8.read_bytes()
    src = ENWIK8
    prepare("enwik8", "--raw", src, "--out", tmp_path / "out", "--mode", "reference")
    # prep_enwik8.py: split the raw bytes 90/5/5, write each byte as a decimal token but byte 10 as a newline;
    # Transformer-XL then reads lines, whitespace-splits, adds no <eos>: newline bytes vanish.
    n = len(raw)
    h = n * 5 // 100
    parts = [raw[: n - 2 * h], raw[n - 2 * h : n - h], raw[n - h :]]
    files = [" ".join(str(c) if c != 10 else "\n" for c in part) for part in parts]
    tokens = [[t for line in f.split("\n") for t in line.split()] for f in files]
    symbols = xl_vocab(tokens)
    assert load_vocab(tmp_path / "out").symbols == symbols
    idx = {s: i for i, s in enumerate(symbols)}
    for split, toks in zip(("train", "valid", "test"), tokens, strict=True):
        assert read_split(tmp_path / "out", split).tolist() == [idx[t] for t in toks]
    assert 10 not in {int(s) for s in symbols}


def test_text8_chars_and_reference(tmp_path):
    raw = TEXT8.read_bytes()
    src = TEXT8
    n = len(raw)
    h = n * 5 // 100
    parts = [raw[: n - 2 * h].decode(), raw[n - 2 * h : n - h].decode(), raw[n - h :].decode()]

    prepare("text8", "--raw", src, "--out", tmp_path / "chars")
    alphabet = " abcdefghijklmnopqrstuvwxyz"
    assert len(load_vocab(tmp_path / "chars")) == 27
    for split, part in zip(("train", "valid", "test"), parts, strict=True):
        assert read_split(tmp_path / "chars", split).tolist() == [alphabet.index(c) for c in part]

    # prep_text8.py: each part strip()-ed, ' ' written as '_', one symbol per character
    prepare("text8", "--raw", src, "--out", tmp_path / "ref", "--mode", "reference")
    tokens = [" ".join("_" if c == " " else c for c in part.strip()).split() for part in parts]
    symbols = xl_vocab(tokens)
    assert load_vocab(tmp_path / "ref").symbols == symbols and len(symbols) == 27
    idx = {s: i for i, s in enumerate(symbols)}
    for split, toks in zip(("train", "valid", "test"), tokens, strict=True):
        assert read_split(tmp_path / "ref", split).tolist() == [idx[t] for t in toks]
    assert parts[0].strip() != parts[0]  # the strip matters here: the prefix starts with a space


def xl_tokenize(path):
    with open(path, encoding="utf-8") as f:
        return [line.strip().split() + ["<eos>"] for line in f]


def test_wikitext103_token_counts_and_vocab(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for s in ("valid", "test"):
        (raw / f"wiki.{s}.tokens").write_bytes(WIKITEXT[s].read_bytes())
    # WikiText-103 train is not in the fixtures: stand in the valid file as train (vocab from train only)
    (raw / "wiki.train.tokens").write_bytes(WIKITEXT["valid"].read_bytes())
    prepare("wikitext-103", "--raw", raw, "--out", tmp_path / "out", "--chunk-tokens", 8192)
    m = load_manifest(tmp_path / "out")
    for s in ("valid", "test"):  # Transformer-XL's count: whitespace-split words plus one <eos> per line
        lines = WIKITEXT[s].read_text(encoding="utf-8").splitlines()
        assert m["splits"][s]["n_tokens"] == sum(len(line.split()) + 1 for line in lines) > 20_000

    valid_lines = xl_tokenize(WIKITEXT["valid"])
    count = collections.Counter(w for line in valid_lines for w in line[:-1])  # count_file: no <eos>
    symbols = ["<eos>"] + [w for w, _ in count.most_common()]
    vocab = load_vocab(tmp_path / "out")
    assert vocab.symbols == symbols and m["dtype"] == "<u2"
    idx = {s: i for i, s in enumerate(symbols)}
    assert read_split(tmp_path / "out", "valid").tolist() == [idx[w] for line in valid_lines for w in line]
    test_words = [w for line in xl_tokenize(WIKITEXT["test"]) for w in line]
    unk = idx["<unk>"]
    assert read_split(tmp_path / "out", "test").tolist() == [idx.get(w, unk) for w in test_words]
    assert m["splits"]["test"]["n_unk_mapped"] == sum(w not in idx for w in test_words) > 0

    # the round trip to text (Vocab.decode, what generate prints): one line per <eos>, words joined by one space,
    # as the Transformer-XL tokenisation normalised them; unknown test words come back as <unk>
    def text(lines, known=lambda w: w):
        return "".join(" ".join(known(w) for w in line[:-1]) + "\n" for line in lines)

    assert vocab.decode(read_split(tmp_path / "out", "valid")) == text(valid_lines)
    assert vocab.decode(read_split(tmp_path / "out", "test")) == text(
        xl_tokenize(WIKITEXT["test"]), lambda w: w if w in idx else "<unk>"
    )
    assert vocab.decode([idx["the"], idx["<eos>"], idx["of"]]) == "the\nof"  # an unfinished last line

    # a given vocabulary file replaces train; the same ids come out
    (raw / "wiki.train.tokens").unlink()
    prepare("wikitext-103", "--raw", raw, "--out", tmp_path / "given", "--vocab", tmp_path / "out/vocab.txt")
    assert sorted(load_manifest(tmp_path / "given")["splits"]) == ["test", "valid"]
    assert np.array_equal(read_split(tmp_path / "given", "valid"), read_split(tmp_path / "out", "valid"))


def test_text_corpus_bytes_jsonl_and_words(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("héllo world\nsecond line\n", encoding="utf-8")
    b = tmp_path / "b.jsonl"
    b.write_text(json.dumps({"text": "doc one"}) + "\n\n" + json.dumps({"text": "doc\ntwo", "x": 1}) + "\n")
    c = tmp_path / "c.txt"
    c.write_text("x y z\n")
    prepare("text", "--raw", a, b, "--valid", c, "--test", c, "--out", tmp_path / "bytes")
    expect = a.read_bytes() + b"doc one\n" + b"doc\ntwo\n"
    assert read_split(tmp_path / "bytes", "train").tobytes() == expect
    assert read_split(tmp_path / "bytes", "valid").tobytes() == c.read_bytes()

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("<eos>\n<unk>\nworld\ndoc\nx\n")
    prepare("text", "--raw", a, b, "--valid", c, "--test", c, "--vocab", vocab, "--out", tmp_path / "words")
    ids = {"<eos>": 0, "<unk>": 1, "world": 2, "doc": 3, "x": 4}
    words = "<unk> world <eos> <unk> <unk> <eos> doc <unk> <eos> doc <eos> <unk> <eos>".split()
    assert read_split(tmp_path / "words", "train").tolist() == [ids[w] for w in words]
    assert read_split(tmp_path / "words", "valid").tolist() == [4, 1, 1, 0]
    for d in ("bytes", "words"):  # plain text in the mix: a flat stream, no document index
        assert not any("documents" in sp for sp in load_manifest(tmp_path / d)["splits"].values())


def document_starts(d, split):
    m = load_manifest(d)
    e = m["splits"][split]["documents"]
    assert e["bytes"] == 8 * e["n_documents"] and e["dtype"] == "<u8"
    return np.frombuffer((d / e["file"]).read_bytes(), dtype="<u8").tolist()


def test_jsonl_records_are_documents_in_a_document_index(tmp_path):
    """Every jsonl record is a document: the index holds where each one starts (from the records themselves,
    byte-level with --doc-sep, and as words with an <eos> per line of the record); verify-shards checks it."""
    from megamemo.data import verify_shards

    texts = [f"record {i} " + "é" * (i % 5) + ("\nsecond line" if i % 3 == 0 else "") for i in range(120)]
    raw = tmp_path / "r.jsonl"
    raw.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare(
        "text",
        "--raw",
        raw,
        "--doc-sep",
        "||",
        "--out",
        tmp_path / "bytes",
        "--chunk-tokens",
        256,
        "--shard-size",
        "1K",
    )
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("<eos>\n<unk>\nrecord\n")
    prepare(
        "text", "--raw", raw, "--vocab", vocab, "--out", tmp_path / "words", "--chunk-tokens", 64, "--shard-size", "1K"
    )
    # whole lines 90/5/5 by byte position: a record belongs to the split its line starts in
    n = raw.stat().st_size
    cut1, cut2 = n - 2 * (n * 5 // 100), n - n * 5 // 100
    pos, mine = 0, {"train": [], "valid": [], "test": []}
    for t in texts:
        mine["train" if pos < cut1 else "valid" if pos < cut2 else "test"].append(t)
        pos += len(json.dumps({"text": t})) + 1
    for split, ts in mine.items():
        assert ts
        lengths = {
            "bytes": [len(t.encode()) + 2 for t in ts],
            "words": [len(t.split()) + t.count("\n") + 1 for t in ts],
        }
        for d, lens in lengths.items():
            assert document_starts(tmp_path / d, split) == np.concatenate(([0], np.cumsum(lens)[:-1])).tolist()
            assert read_split(tmp_path / d, split).size == sum(lens)
    assert verify_shards(tmp_path / "bytes", log=lambda m: None) == []
    f = tmp_path / "bytes" / load_manifest(tmp_path / "bytes")["splits"]["valid"]["documents"]["file"]
    f.write_bytes(f.read_bytes()[:-8])
    assert verify_shards(tmp_path / "bytes", log=lambda m: None) == [
        f"shard {f}: the document index is {f.stat().st_size} bytes, manifest.json says {f.stat().st_size + 8} "
        f"(truncated?)"
    ]


def test_an_error_mid_split_leaves_nothing_behind(tmp_path, capsys):
    """A bad record found after shards of the split were written (and one was open): one line, and the output
    directory holds exactly what it held before, no hidden partial file either."""
    raw = tmp_path / "late.jsonl"
    raw.write_text(
        "".join(json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(300)) + "{not json\n"
    )
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for args in ([], ["--vocab", tmp_path / "v.txt"]):  # byte-level and word-level, each split in sequence
        (tmp_path / "v.txt").write_text("<eos>\n<unk>\ndocument\n")
        assert (
            prepare_main(
                [
                    "text",
                    "--raw",
                    str(raw),
                    "--out",
                    str(out),
                    "--chunk-tokens",
                    "256",
                    "--shard-size",
                    "1K",
                    "--quiet",
                    *map(str, args),
                ]
            )
            == 2
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "late.jsonl: line 301, column 2: not a JSON object" in err[0], err
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_text_proportional_split_by_lines(tmp_path):
    lines = [f"line {i} " + "w" * (i % 7) + "\n" for i in range(400)]
    src = tmp_path / "t.txt"
    src.write_text("".join(lines))
    vocab = tmp_path / "v.txt"
    vocab.write_text("<eos>\n<unk>\nline\n")
    prepare("text", "--raw", src, "--vocab", vocab, "--out", tmp_path / "w")
    got = {s: read_split(tmp_path / "w", s).tolist() for s in ("train", "valid", "test")}
    # every line goes whole to the split in which its first byte lies (byte cut points 90/5/5)
    n = src.stat().st_size
    cut1, cut2 = n - 2 * (n * 5 // 100), n - n * 5 // 100
    expect = {"train": [], "valid": [], "test": []}
    pos = 0
    for line in lines:
        split = "train" if pos < cut1 else "valid" if pos < cut2 else "test"
        expect[split] += [{"line": 2}.get(w, 1) for w in line.split()] + [0]
        pos += len(line)
    assert got == expect and all(got.values())

    # byte-level plain text is cut at the exact byte
    prepare("text", "--raw", src, "--out", tmp_path / "b")
    raw = src.read_bytes()
    assert read_split(tmp_path / "b", "valid").tobytes() == raw[cut1:cut2]


def test_shards_are_webdataset_readable_and_reproducible(tmp_path):
    raw = ENWIK8
    for out in ("one", "two"):
        prepare("enwik8", "--raw", raw, "--out", tmp_path / out, "--chunk-tokens", 4096, "--shard-size", "32K")
    m1, m2 = (load_manifest(tmp_path / o) for o in ("one", "two"))
    assert m1["splits"] == m2["splits"]  # same bytes, same sha256: shards are deterministic

    urls = sorted(glob.glob(str(tmp_path / "one" / "train-*.tar")))
    assert len(urls) == len(m1["splits"]["train"]["shards"]) > 1
    dctx = zstandard.ZstdDecompressor()
    pieces, offset = [], 0
    for sample in wds.WebDataset(urls, shardshuffle=False):
        meta = json.loads(sample["json"])
        assert meta["offset"] == offset == int(sample["__key__"])
        arr = np.frombuffer(dctx.decompress(sample["tokens.zst"]), dtype=meta["dtype"])
        assert arr.size == meta["n_tokens"]
        pieces.append(arr)
        offset += arr.size
    assert np.concatenate(pieces).tobytes() == raw.read_bytes()[: m1["splits"]["train"]["n_tokens"]]


def test_python_m_megamemo_data_and_errors(tmp_path):
    raw = tmp_path / "t8"
    raw.write_bytes(TEXT8.read_bytes()[:50_000])
    r = subprocess.run(
        [sys.executable, "-m", "megamemo.data", "prepare", "text8", "--raw", str(raw), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "[prepare] train:" in r.stderr and "tokens" in r.stderr  # progress / throughput lines
    # an existing output is not overwritten silently
    assert prepare_main(["text8", "--raw", str(raw), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert prepare_main(["text8", "--raw", str(raw), "--out", str(tmp_path / "o"), "--quiet", "--overwrite"]) == 0
    # a byte outside the text8 alphabet is an error naming the file and offset
    bad = tmp_path / "bad"
    bad.write_bytes(b"abc def\nghi")
    with pytest.raises(ValueError, match=r"bad.*0x0a at byte offset 7"):
        from megamemo.data import build, corpora

        build(corpora.text8(bad), tmp_path / "bad_out", log=lambda m: None)


@pytest.mark.parametrize(
    "name, content, message",
    [
        (
            "latin1.txt",
            "caf\u00e9 au lait\nna\u00efve\n".encode("latin-1"),
            "latin1.txt: line 1, column 4: not UTF-8 (byte 0xe9",
        ),
        ("late.txt", b"ok\n" * 5000 + b"fine then \xff\n", "late.txt: line 5001, column 11: not UTF-8 (byte 0xff"),
        ("latin1.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "latin1.jsonl: line 2, column 14: not UTF-8"),
        ("fields.jsonl", b'{"text": "ok"}\n\n{"body": "b"}\n', "fields.jsonl: line 3: no field 'text'"),
        ("typed.jsonl", b'{"text": 5}\n', "typed.jsonl: line 1: field 'text' is int, not a string"),
    ],
)
@pytest.mark.parametrize("tokenizer", [[], ["--tokenizer", "bpe:300"]], ids=["bytes", "bpe"])
def test_a_bad_text_corpus_exits_2_naming_its_line_and_column(tmp_path, capsys, name, content, message, tokenizer):
    """docs/corpus.md: UTF-8 text, jsonl records with the field; anything else is exit 2 and one line naming the
    file, the line and the column (a Latin-1 text was stored as bytes, a jsonl error said "byte 0", issue 50)."""
    (tmp_path / name).write_bytes(content)
    assert (
        prepare_main(["text", "--raw", str(tmp_path / name), "--out", str(tmp_path / "out"), "--quiet", *tokenizer])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megamemo prepare: error:") and message in err[0], err
    assert not (tmp_path / "out").exists()

"""megamemo/util: the one atomic write, the one sha256, the units, the precision table, the seeding."""

from __future__ import annotations

import hashlib
import math
import os
import random

import numpy as np
import pytest
import torch

from megamemo.util import files, precision, seeding, units

# Tolerances here: pytest.approx (default rel 1e-6) and rel=1e-12 compare float64 evaluations of the same formula
# (IEEE arithmetic, rounded alike on any CPU; numpy's sums in another order at most): they differ by a few u64
# (1.1e-16) relative, so either tolerance only says 'the same number'. Nothing here depends on a CPU's kernels.


def test_atomic_write_replaces_whole_or_leaves_the_old_file(tmp_path):
    target = tmp_path / "doc.json"
    files.write_json_atomic(target, {"a": 1})
    assert target.read_text() == '{\n "a": 1\n}'

    def half_then_fail(p):
        p.write_text('{"a": ')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.write_atomic(target, half_then_fail)
    assert target.read_text() == '{\n "a": 1\n}'  # the old content, whole
    assert sorted(os.listdir(tmp_path)) == ["doc.json"]  # no temporary file left
    files.write_text_atomic(target, "new", durable=False)
    files.write_bytes_atomic(tmp_path / "b.bin", b"\x00\x01")
    assert target.read_text() == "new" and (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert sorted(os.listdir(tmp_path)) == ["b.bin", "doc.json"]


def test_sha256_of_a_file_a_descriptor_and_bytes_agree_with_hashlib(tmp_path):
    data = bytes(range(256)) * 40_000  # > one 4 MiB read block
    p = tmp_path / "x"
    p.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    fd = os.open(p, os.O_RDONLY)
    try:
        assert files.fd_sha256(fd) == want
    finally:
        os.close(fd)
    assert files.file_sha256(p) == want and files.bytes_sha256(data) == want


def test_units_by_hand():
    assert units.bits(math.log(2.0)) == pytest.approx(1.0)  # ln 2 nats = 1 bit
    assert units.metric_value(math.log(2.0) * 1.25, "bpc") == pytest.approx(1.25)
    assert units.metric_value(math.log(7.0), "ppl") == pytest.approx(7.0)
    assert units.perplexity(1e6) == math.exp(700.0)  # a diverged loss: huge, not an overflow
    assert units.bits_per_byte(10 * math.log(2.0), 5) == pytest.approx(2.0)  # 10 bits over 5 bytes
    assert math.isnan(units.bits_per_byte(1.0, 0))
    with pytest.raises(ValueError, match="unknown metric"):
        units.metric_value(1.0, "bits")


def test_precision_table():
    assert precision.NAMES == ("fp32", "bf16", "fp16") and precision.HALF == ("bf16", "fp16")
    for name in precision.NAMES:
        assert precision.torch_dtype(name).itemsize == precision.element_bytes(name)
    assert precision.torch_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        precision.torch_dtype("fp8")


def test_seeding_makes_every_default_stream_repeat():
    def draw():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    seeding.seed_default_streams(2**40 + 3)  # numpy takes it modulo 2**32
    a = draw()
    seeding.seed_default_streams(2**40 + 3)
    assert draw() == a
    seeding.seed_default_streams(4)
    assert draw() != a


def test_a_file_written_over_time_appears_whole_or_not_at_all(tmp_path):
    target = tmp_path / "shard.tar"
    f = files.AtomicFile(target)
    f.file.write(b"part one, ")
    assert not target.exists()  # hidden under a temporary name meanwhile
    f.file.write(b"part two")
    f.commit()
    assert target.read_bytes() == b"part one, part two" and os.listdir(tmp_path) == ["shard.tar"]

    g = files.AtomicFile(target)
    g.file.write(b"half")
    g.abort()
    assert target.read_bytes() == b"part one, part two" and os.listdir(tmp_path) == ["shard.tar"]

    with pytest.raises(RuntimeError):
        with files.AtomicFile(tmp_path / "other.bin") as h:
            h.file.write(b"x")
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == ["shard.tar"]
    with files.AtomicFile(tmp_path / "other.bin", durable=False) as h:
        h.file.write(b"y")
    assert (tmp_path / "other.bin").read_bytes() == b"y"


def test_a_directory_appears_whole_or_not_at_all_and_its_clean_up_on_error(tmp_path):
    target = tmp_path / "ckpt"
    with files.atomic_directory(target) as d:
        (d / "model.bin").write_bytes(b"weights")
        assert not target.exists() and d.parent == tmp_path and d.name.startswith(".ckpt.")  # hidden meanwhile
        os.mkdir(d / "sub")
    assert sorted(os.listdir(target)) == ["model.bin", "sub"] and os.listdir(tmp_path) == ["ckpt"]

    # an error inside the block: nothing new, nothing left behind, the old directory untouched
    with pytest.raises(RuntimeError, match="interrupted"):
        with files.atomic_directory(target, replace=True) as d:
            (d / "model.bin").write_bytes(b"half")
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == ["ckpt"] and (target / "model.bin").read_bytes() == b"weights"

    # an existing directory is refused unless replaced; replaced, the old one goes once the new one is in
    with pytest.raises(FileExistsError, match="ckpt: already exists"):
        with files.atomic_directory(target):
            raise AssertionError("never entered")
    assert os.listdir(tmp_path) == ["ckpt"]
    with files.atomic_directory(target, replace=True) as d:
        (d / "new.bin").write_bytes(b"new")
        assert (target / "model.bin").exists()  # the old one stays until the block is done
    assert os.listdir(target) == ["new.bin"] and os.listdir(tmp_path) == ["ckpt"]

    # a failed rename of the new directory into place removes it and puts the old one back
    original = os.rename

    def failing(src, dst, *a, **k):
        if str(dst) == str(target) and str(src).endswith(".partial"):
            raise OSError("rename refused")
        return original(src, dst, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "rename", failing)
        with pytest.raises(OSError, match="rename refused"):
            with files.atomic_directory(target, replace=True) as d:
                (d / "newer.bin").write_bytes(b"newer")
    assert os.listdir(tmp_path) == ["ckpt"] and os.listdir(target) == ["new.bin"]


def test_the_hashing_writer_and_the_manifest_entry_check(tmp_path):
    data = bytes(range(256)) * 40_000
    out = open(tmp_path / "f", "wb")
    w = files.HashingWriter(out)
    for i in range(0, len(data), 1 << 20):
        w.write(data[i : i + (1 << 20)])
    out.close()
    assert w.n == len(data) and w.hexdigest() == hashlib.sha256(data).hexdigest() == files.bytes_sha256(data)
    assert (tmp_path / "f").read_bytes() == data and files.HashingWriter().write(b"abc") == 3

    digest = hashlib.sha256(data).hexdigest()
    entry = {"bytes": len(data), "sha256": digest}
    calls = []

    def sha():
        calls.append(1)
        return digest

    assert files.entry_mismatch(entry, len(data), sha, recorded="manifest.json") is None and calls == [1]
    # the size first: the digest is not computed when the size already differs
    assert files.entry_mismatch(entry, 100, sha, recorded="manifest.json", what="the shard") == (
        f"the shard is 100 bytes, manifest.json says {len(data)} (truncated?)"
    ) and calls == [1]
    assert files.entry_mismatch(entry, len(data) + 1, sha, recorded="COMMITTED") == (
        f"the file is {len(data) + 1} bytes, COMMITTED says {len(data)}"
    )
    assert files.entry_mismatch(dict(entry, sha256="0" * 64), len(data), sha, recorded="manifest.json") == (
        f"sha256 differs: {digest} does not match manifest.json ({'0' * 64})"
    )
    # what the entry does not record, or the caller does not ask for, is not checked
    assert files.entry_mismatch({"sha256": "0" * 64}, 7, None, recorded="x") is None
    assert files.entry_mismatch({"sha256": digest}, 7, sha, recorded="x") is None

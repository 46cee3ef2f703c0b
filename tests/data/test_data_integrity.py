"""Damaged shards and manifests are errors naming the shard (and offset), from the reader and verify-shards."""

import hashlib
import io
import json
import os
import tarfile

import pytest
import zstandard
from helpers.fixture_data import ENWIK8

from megamemo.data import ManifestError, ShardError, StreamReader, build, corpora, load_manifest
from megamemo.data.cli import verify_main


@pytest.fixture
def shard_dir(tmp_path):
    raw = tmp_path / "enwik8_200k"
    raw.write_bytes(ENWIK8.read_bytes())
    out = tmp_path / "shards"
    build(corpora.enwik8(raw), out, chunk_tokens=2048, shard_bytes="16K", log=lambda m: None)
    return out


def members(path):
    with tarfile.open(path) as tf:
        return [(m.name, m.offset_data, m.size) for m in tf.getmembers()]


def read_all(d, split="train", **kw):
    r = StreamReader(d, split, batch_size=3, tgt_len=500, **kw)
    try:
        return sum(x.numel() for x, _ in r)
    finally:
        r.close()


def edit_manifest(d, fn):
    m = json.loads((d / "manifest.json").read_text())
    fn(m)
    (d / "manifest.json").write_text(json.dumps(m))


def verify_fails(d, capsys, *needles):
    assert verify_main([str(d)]) == 1
    err = capsys.readouterr().err
    for s in needles:
        assert s in err, err
    return err


def test_clean_shards_verify(shard_dir, capsys):
    assert verify_main([str(shard_dir)]) == 0
    assert "all shards match" in capsys.readouterr().out
    assert read_all(shard_dir) > 0


def test_truncated_tar(shard_dir, capsys):
    shard = load_manifest(shard_dir)["splits"]["train"]["shards"][2]
    path = shard_dir / shard["name"]
    name, off, size = members(path)[5]
    os.truncate(path, off + size // 2)  # cut inside a chunk's zstd data
    with pytest.raises(ShardError, match=rf"{shard['name']}.*bytes, manifest.json says {shard['bytes']}"):
        read_all(shard_dir)
    verify_fails(shard_dir, capsys, shard["name"], "truncated tar", f"header at byte {off - 512}")
    # even if the manifest is edited to the new size, the structure check finds the cut and its offset
    edit_manifest(shard_dir, lambda m: m["splits"]["train"]["shards"][2].update(bytes=path.stat().st_size))
    with pytest.raises(
        ShardError,
        match=rf"{shard['name']}: truncated tar: member '{name}' \(header at byte "
        rf"{off - 512}\)",
    ):
        read_all(shard_dir)


def test_broken_zstd_frame(shard_dir, capsys):
    shard = load_manifest(shard_dir)["splits"]["train"]["shards"][1]
    path = shard_dir / shard["name"]
    zst = [(n, o, s) for n, o, s in members(path) if n.endswith(".tokens.zst")]
    name, off, size = zst[3]
    data = bytearray(path.read_bytes())
    for k in range(off + size // 2, off + size // 2 + 8):  # flip bytes in the middle of the frame
        data[k] ^= 0x5A
    path.write_bytes(bytes(data))
    token_offset = int(name.split(".")[0])
    for prefetch in (0, 2):  # also through the background thread
        with pytest.raises(
            ShardError,
            match=rf"{shard['name']}: chunk at token offset {token_offset} "
            rf"\(byte {off}\): broken zstd frame",
        ):
            read_all(shard_dir, prefetch=prefetch)
    verify_fails(shard_dir, capsys, shard["name"], "sha256")


def test_wrong_token_count(shard_dir, capsys):
    m = load_manifest(shard_dir)
    shard = m["splits"]["train"]["shards"][0]
    path = shard_dir / shard["name"]
    # rebuild the tar with chunk 2 holding 100 tokens fewer, and make the manifest agree on size and sha256,
    # so that only the token count is wrong
    buf = io.BytesIO()
    with tarfile.open(path) as src, tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as dst:
        for info in src.getmembers():
            payload = src.extractfile(info).read()
            if info.name == "000000004096.tokens.zst":
                raw = zstandard.ZstdDecompressor().decompress(payload)
                payload = zstandard.ZstdCompressor(write_checksum=True).compress(raw[:-100])
                info.size = len(payload)
            dst.addfile(info, io.BytesIO(payload))
    path.write_bytes(buf.getvalue())
    edit_manifest(
        shard_dir,
        lambda mm: mm["splits"]["train"]["shards"][0].update(
            bytes=len(buf.getvalue()), sha256=hashlib.sha256(buf.getvalue()).hexdigest()
        ),
    )
    with pytest.raises(
        ShardError,
        match=rf"{shard['name']}: chunk at token offset 4096 .* holds 1948 tokens .*"
        rf"expected 2048",
    ):
        read_all(shard_dir)
    verify_fails(shard_dir, capsys, shard["name"], "token offset 4096", "expected 2048")


def test_manifest_mismatches(shard_dir, capsys):
    m = load_manifest(shard_dir)
    shards = m["splits"]["train"]["shards"]
    # a shard's sha256 no longer matches its file: verify-shards and a sha256-verifying reader say which
    edit_manifest(shard_dir, lambda mm: mm["splits"]["train"]["shards"][1].update(sha256="0" * 64))
    verify_fails(shard_dir, capsys, shards[1]["name"], "sha256")
    with pytest.raises(ShardError, match=rf"{shards[1]['name']}: sha256"):
        read_all(shard_dir, verify="sha256")
    edit_manifest(shard_dir, lambda mm: mm["splits"]["train"]["shards"][1].update(sha256=shards[1]["sha256"]))
    assert verify_main([str(shard_dir)]) == 0
    capsys.readouterr()

    # token counts that do not tile the split: the manifest itself is rejected, naming the field
    edit_manifest(shard_dir, lambda mm: mm["splits"]["train"]["shards"][1].update(n_tokens=shards[1]["n_tokens"] + 1))
    with pytest.raises(ManifestError, match=r"shards\[1\]"):
        read_all(shard_dir)
    verify_fails(shard_dir, capsys, "manifest.json", "shards[1]")
    edit_manifest(shard_dir, lambda mm: mm["splits"]["train"]["shards"][1].update(n_tokens=shards[1]["n_tokens"]))

    # a missing shard file
    (shard_dir / shards[3]["name"]).rename(shard_dir / "elsewhere.tar")
    with pytest.raises(ShardError, match=rf"{shards[3]['name']}: missing"):
        read_all(shard_dir)
    verify_fails(shard_dir, capsys, shards[3]["name"], "missing")
    (shard_dir / "elsewhere.tar").rename(shard_dir / shards[3]["name"])

    # shards swapped on disk (same sizes are unlikely; the member keys give it away even when sizes agree)
    a, b = shards[0], shards[1]
    (shard_dir / a["name"]).write_bytes((shard_dir / b["name"]).read_bytes())
    edit_manifest(shard_dir, lambda mm: mm["splits"]["train"]["shards"][0].update(bytes=b["bytes"]))
    with pytest.raises(ShardError, match=rf"{a['name']}: unexpected tar member '{int(b['offset']):012d}"):
        read_all(shard_dir)

    # an unsupported format version
    edit_manifest(shard_dir, lambda mm: mm.update(format_version=99))
    with pytest.raises(ManifestError, match="format_version 99"):
        read_all(shard_dir)


def test_corrupt_tar_header(shard_dir, capsys):
    shard = load_manifest(shard_dir)["splits"]["valid"]["shards"][0]
    path = shard_dir / shard["name"]
    _, off, _ = members(path)[4]
    data = bytearray(path.read_bytes())
    data[off - 512 + 130] ^= 0x01  # a digit of the size field of member 4's header
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=rf"{shard['name']}: corrupt tar header at byte {off - 512}"):
        read_all(shard_dir, split="valid")
    verify_fails(shard_dir, capsys, shard["name"])

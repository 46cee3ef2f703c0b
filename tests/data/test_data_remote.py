"""Shard directories on object storage, against a real S3-protocol server on loopback (moto's standalone server,
started by a fixture; AWS_ENDPOINT_URL and dummy credentials in the environment): batches from s3:// equal the
local directory's, the cache holds only verified shards under its size limit (least recently used evicted),
damaged / missing / truncated objects are named with their chunk, a stopped server gives retries then a named
error (reader and `megamemo train`), a 2-process training run from s3:// equals the local one across a kill -9,
http:// and gs:// (a GCS emulator on loopback) read like local, credentials in URLs are refused, and blends mix
local and s3:// sources, reading a remote document index through the verified cache."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers.fixture_data import ENWIK8
from helpers.loopback_s3 import LoopbackS3
from helpers.loopback_s3 import upload as upload_to

from megamemo import cli
from megamemo.data import ShardError, StreamReader, build, corpora
from megamemo.data.remote import RemoteOptions, RemoteShards, StoreUnavailableError

BUCKET = "megamemo-test"


def upload(local: Path, prefix: str, damage=None) -> str:
    return upload_to(local, BUCKET, prefix, damage)


@contextlib.contextmanager
def serving(server_class=LoopbackS3):
    """A loopback object-store server, with its client variables (AWS_* or STORAGE_EMULATOR_HOST) pointing at it;
    both undone at the end."""
    server = server_class()
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def s3_server():
    with serving() as server:
        yield server


@pytest.fixture(scope="module")
def local_shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("remote_src") / "enwik8"
    build(corpora.enwik8(ENWIK8), out, chunk_tokens=4096, shard_bytes="16K", log=lambda m: None)
    return out


@pytest.fixture(scope="module")
def remote_shards(s3_server, local_shards) -> str:
    return upload(local_shards, "enwik8")


def opts(tmp_path: Path, lines: list | None = None, **kw) -> RemoteOptions:
    return RemoteOptions(cache_dir=str(tmp_path / "cache"), log=(lines.append if lines is not None else print), **kw)


def batches(reader, limit=None):
    out = []
    for k, (x, y) in enumerate(reader):
        if limit is not None and k >= limit:
            break
        out.append((x.clone(), y.clone()))
    return out


def test_s3_batches_equal_local_and_the_cache_holds_verified_shards(local_shards, remote_shards, tmp_path):
    kw = dict(batch_size=6, tgt_len=700, roll=True, seed=3, epochs=2, prefetch=2)
    expect = batches(StreamReader(local_shards, "train", **kw))
    with StreamReader(remote_shards, "train", remote_options=opts(tmp_path), **kw) as r:
        got = batches(r)
        fetched = r.cache_info()["fetched_bytes"]
    assert len(got) == len(expect) > 0
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expect, strict=True))
    entries = r.manifest["splits"]["train"]["shards"]
    assert fetched == sum(e["bytes"] for e in entries)  # each shard fetched once, for both epochs
    cached = sorted(p.name for p in (tmp_path / "cache" / "sha256").glob("*.tar"))
    assert cached == sorted(f"{e['sha256']}.tar" for e in entries)
    for e in entries:  # named by content, and the content is the shard's
        assert (tmp_path / "cache" / "sha256" / f"{e['sha256']}.tar").read_bytes() == (
            local_shards / e["name"]
        ).read_bytes()
    assert not list((tmp_path / "cache").rglob("*.partial"))
    with StreamReader(remote_shards, "train", remote_options=opts(tmp_path), **kw) as again:  # warm cache
        assert len(batches(again, 5)) == 5 and again.cache_info()["fetched_bytes"] == 0


def test_cache_limit_evicts_least_recently_used(local_shards, remote_shards, tmp_path):
    store = RemoteShards(remote_shards, opts(tmp_path, cache_size=0))
    entries = store.manifest["splits"]["train"]["shards"][:4]
    store.close()
    limit = entries[0]["bytes"] + entries[1]["bytes"] + entries[2]["bytes"]
    store = RemoteShards(remote_shards, opts(tmp_path, cache_size=limit))
    try:
        path = lambda e: tmp_path / "cache" / "sha256" / f"{e['sha256']}.tar"  # noqa: E731
        past = time.time() - 3600
        for k, e in enumerate(entries[:3]):  # used in this order, an hour ago: explicit times, no clock races
            os.close(store.open(e, "test"))
            os.utime(path(e), (past + k, past + k))
        os.close(store.open(entries[0], "test"))  # used again: now the most recent
        assert path(entries[0]).stat().st_mtime > past + 2
        os.close(store.open(entries[3], "test"))  # over the limit: entries[1], least recently used, goes
        assert [path(e).exists() for e in entries] == [True, False, True, True]
        total = sum(p.stat().st_size for p in (tmp_path / "cache" / "sha256").glob("*.tar"))
        assert total <= limit
    finally:
        store.close()


def test_a_cached_shard_damaged_in_place_is_fetched_again(local_shards, remote_shards, tmp_path, monkeypatch):
    """A cached file keeps its size when damaged in place (a bad disk block, a stray write): a process hashes every
    cached file the first time it uses it, so a later process finds the damage, says so in one line and fetches the
    shard again; the reader gets the shard's true bytes."""
    from megamemo.data import remote

    lines: list[str] = []
    store = RemoteShards(remote_shards, opts(tmp_path, lines))
    entry = store.manifest["splits"]["train"]["shards"][1]
    want = (local_shards / entry["name"]).read_bytes()
    cached = tmp_path / "cache" / "sha256" / f"{entry['sha256']}.tar"
    try:
        os.close(store.open(entry, "test"))
        assert cached.read_bytes() == want and store.fetched_bytes == entry["bytes"]
        os.close(store.open(entry, "test"))  # verified: used again without a fetch or a line
        assert store.fetched_bytes == entry["bytes"] and not lines
    finally:
        store.close()
    damaged = bytearray(want)
    damaged[len(damaged) // 2] ^= 0x01
    cached.write_bytes(bytes(damaged))  # same size, one bit off
    monkeypatch.setattr(remote, "_VERIFIED", set())  # a new process: nothing of the cache verified yet
    store = RemoteShards(remote_shards, opts(tmp_path, lines))
    try:
        fd = store.open(entry, "test")
        try:
            assert os.pread(fd, len(want) + 1, 0) == want
        finally:
            os.close(fd)
        assert store.fetched_bytes == entry["bytes"]  # fetched again, once
    finally:
        store.close()
    assert cached.read_bytes() == want
    assert len(lines) == 1 and lines[0] == (
        f"[data] cache {cached}: its sha256 does not match "
        f"{remote_shards}/{entry['name']}'s in manifest.json (damaged in place); "
        f"fetching it again"
    ), lines


@pytest.mark.parametrize("corpus", ["bytes", "subword"])
def test_a_damaged_vocabulary_or_tokenizer_file_is_named(corpus, s3_server, local_shards, tmp_path):
    """The vocabulary file (vocab.file: the byte vocabulary, a subword corpus's tokenizer.json) is fetched with the
    manifest and checked against its sha256 before anything reads it: a flipped byte is one error naming the object."""
    import json

    from megamemo.data import ManifestError
    from megamemo.data.cli import prepare_main

    src = local_shards
    if corpus == "subword":
        raw = tmp_path / "docs.jsonl"
        raw.write_text(
            "".join(
                json.dumps({"text": f"document {i}: " + "words and more words " * (i % 9 + 1)}) + "\n"
                for i in range(200)
            )
        )
        src = tmp_path / "subword"
        assert prepare_main(["text", "--raw", str(raw), "--tokenizer", "bpe:300", "--out", str(src), "--quiet"]) == 0
    vocab = json.loads((src / "manifest.json").read_text())["vocab"]
    assert vocab["file"] == ("tokenizer.json" if corpus == "subword" else vocab["file"]) and vocab["sha256"]
    url = upload(src, f"vocab-{corpus}", flip_a_byte(vocab["file"]))
    with pytest.raises(ManifestError) as e:
        RemoteShards(url, opts(tmp_path))
    assert str(e.value) == f"{url}/{vocab['file']}: sha256 does not match manifest.json field vocab.sha256"
    assert not list((tmp_path / "cache" / "meta").rglob(vocab["file"]))  # never staged
    good = upload(src, f"vocab-{corpus}-good")
    store = RemoteShards(good, opts(tmp_path))  # the control: the same, undamaged
    store.close()
    assert (store.meta_dir / vocab["file"]).read_bytes() == (src / vocab["file"]).read_bytes()


def flip_a_byte(target: str):
    def damage(name, data):
        if name != target:
            return data
        b = bytearray(data)
        b[len(b) // 2] ^= 0xFF
        return bytes(b)

    return damage


def test_damaged_missing_and_truncated_objects_are_named(local_shards, remote_shards, tmp_path):
    import json

    m = json.loads((local_shards / "manifest.json").read_text())
    second = m["splits"]["train"]["shards"][1]
    url = upload(local_shards, "corrupt", flip_a_byte(second["name"]))
    reader = StreamReader(url, "train", batch_size=1, tgt_len=4096, remote_options=opts(tmp_path))
    with pytest.raises(ShardError) as e:
        batches(reader)
    msg = str(e.value)
    assert f"{url}/{second['name']}" in msg and "sha256" in msg and "does not match manifest.json" in msg
    assert f"chunk at token offset {second['offset']}" in msg
    assert "\n" not in msg
    reader.close()
    assert not (tmp_path / "cache" / "sha256" / f"{second['sha256']}.tar").exists()  # never used, never kept
    assert not list((tmp_path / "cache").rglob("*.partial"))

    url = upload(local_shards, "missing", lambda n, d: None if n == second["name"] else d)
    with pytest.raises(ShardError, match=f"shard {url}/{second['name']}: missing"):
        StreamReader(url, "train", batch_size=1, tgt_len=64, remote_options=opts(tmp_path))
    url = upload(local_shards, "short", lambda n, d: d[:-700] if n == second["name"] else d)
    with pytest.raises(
        ShardError,
        match=f"shard {url}/{second['name']}: the object is .* manifest.json says {second['bytes']} \\(truncated\\?\\)",
    ):
        StreamReader(url, "train", batch_size=1, tgt_len=64, remote_options=opts(tmp_path))


def test_store_down_mid_read_retries_then_names_the_error(local_shards, tmp_path):
    with serving() as server:  # its own server: stopping it must not disturb the other tests
        url = upload(local_shards, "down")
        lines: list[str] = []
        reader = StreamReader(
            url,
            "train",
            batch_size=1,
            tgt_len=2048,
            block_tokens=2048,
            remote_options=opts(tmp_path, lines, retries=2, retry_backoff_s=0.01),
        )
        it = iter(reader)
        next(it)  # reading: the first shard is here, the read-ahead fetches the second
        assert reader.source.remote._pending or len(list((tmp_path / "cache" / "sha256").glob("*.tar"))) <= 2
        server.stop()
        with pytest.raises(StoreUnavailableError) as e:
            for _ in it:
                pass
        reader.close()
    msg = str(e.value)
    assert msg.startswith(f"object store unavailable: {url}/train-") and "chunk at token offset" in msg
    assert "the store did not answer after 3 tries" in msg and "\n" not in msg
    retries = [ln for ln in lines if "retry" in ln]
    assert [ln.split("retry ")[1].split(" ")[0] for ln in retries][:2] == ["1/2", "2/2"]
    assert all(ln.startswith(f"[data] {url}/train-") and "\n" not in ln for ln in retries)


# ---- training from s3:// ---------------------------------------------------------------------------------------
@pytest.mark.multiproc  # starts training processes (`-m 'not multiproc'`: the fast subset)
def test_two_process_training_from_s3_equals_local_across_kill9(local_shards, remote_shards, tmp_path):
    """`megamemo train` on 2 ranks from s3://bucket/prefix: the per-step losses of the local directory's run,
    bit for bit, also when one rank is killed -9 mid-run and the job resumes from the remote directory."""
    from test_train_runs import TINY, assert_no_corrupt_checkpoint, committed_steps, launch, logs, losses, run, wait

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    args = ["--max-steps", "20", "--save-every", "2", "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    ref_dir, run_dir = tmp_path / "local", tmp_path / "s3"
    run(2, cfg, local_shards, ref_dir, *args)

    procs = launch(2, cfg, remote_shards, run_dir, *args)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().count('"kind": "train"') >= 7):
        assert time.time() < deadline and procs[0].poll() is None, logs(run_dir)[-3000:]
        time.sleep(0.02)
    procs[1].send_signal(signal.SIGKILL)
    assert wait(procs, 120)[1] == -signal.SIGKILL
    resume_step = committed_steps(run_dir)[-1]
    assert 2 <= resume_step < 20
    run(2, cfg, remote_shards, run_dir, *args)
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{resume_step:08d}'}" in logs(run_dir)
    assert sorted(losses(run_dir)) == list(range(1, 21))
    assert losses(run_dir) == losses(ref_dir)
    assert_no_corrupt_checkpoint(run_dir)
    assert "testing" not in (run_dir / "config.yaml").read_text()  # no credentials in what the run wrote


@pytest.mark.multiproc  # starts training processes (`-m 'not multiproc'`: the fast subset)
def test_training_with_the_store_down_ends_with_a_named_error(local_shards, tmp_path):
    """The server stops after the first commit; with a cache of one byte nothing is kept on disk, so the next fetch
    (the training reader's, when the next epoch starts again at the first chunk; the probe keeps its reader from
    save to save) meets the stopped store: retries, one line each, then one error line naming the object and chunk,
    no traceback, the committed checkpoints intact."""
    from test_train_runs import TINY, assert_no_corrupt_checkpoint, committed_steps, launch, logs, wait

    with serving() as server:
        url = upload(local_shards, "down-train")
        cfg = tmp_path / "tiny.yaml"
        cfg.write_text(TINY)
        run_dir = tmp_path / "run"
        procs = launch(
            1,
            cfg,
            url,
            run_dir,
            "--max-steps",
            "1000",
            "--save-every",
            "3",
            "--set",
            f"data.cache_dir={tmp_path / 'cache'}",
            "--set",
            "data.cache_size=1B",
            "--set",
            "data.retries=2",
            "--set",
            "data.retry_backoff_s=0.05",
        )
        deadline = time.time() + 120
        while not committed_steps(run_dir) if (run_dir / "checkpoints").exists() else True:
            assert time.time() < deadline and procs[0].poll() is None, logs(run_dir)[-3000:]
            time.sleep(0.05)
        server.stop()
        assert wait(procs, 120) == [2]
    out = logs(run_dir)
    assert "Traceback" not in out
    errors = [ln for ln in out.splitlines() if ln.startswith("megamemo train: error:")]
    assert len(errors) == 1 and f"object store unavailable: {url}/train-" in errors[0]
    assert "chunk at token offset" in errors[0]
    assert "the store did not answer after 3 tries" in errors[0]
    assert len([ln for ln in out.splitlines() if ln.startswith(f"[data] {url}/") and "retry" in ln]) >= 2
    assert committed_steps(run_dir)
    assert_no_corrupt_checkpoint(run_dir)


def test_blend_of_a_local_and_a_remote_source(local_shards, remote_shards, tmp_path):
    """data.blend mixes local and s3:// sources: the same batches as the blend of the two local directories."""
    from megamemo.data.blend import BlendReader

    kw = dict(batch_size=4, tgt_len=512, seed=2)
    local = BlendReader([(local_shards, 1), (local_shards, 3)], "train", **kw)
    mixed = BlendReader([(local_shards, 1), (remote_shards, 3)], "train", remote_options=opts(tmp_path), **kw)
    for k in range(60):
        x, y = local.get_batch(0, k)
        xm, ym = mixed.get_batch(0, k)
        assert torch.equal(x, xm) and torch.equal(y, ym)
    assert mixed.cache_info()["fetched_bytes"] > 0
    assert abs(mixed.token_mix(60)[1] - 0.75) < 0.2
    mixed.close()


def test_http_directory_reads_like_the_local_one(local_shards, tmp_path):
    """https:// and http:// go through fsspec's HTTP filesystem (no listing: sizes and sha256 checked on fetch);
    here python's http.server on 127.0.0.1 serves the shard directory."""
    import socket
    import subprocess
    import sys

    from megamemo.runtime.dist import free_port

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", "-b", "127.0.0.1", str(port), "-d", str(local_shards.parent)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}/{local_shards.name}"
        deadline = time.time() + 20
        while True:  # until the server listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.time() < deadline and server.poll() is None
                time.sleep(0.05)
        with StreamReader(url, "train", 4, 512, remote_options=opts(tmp_path)) as r:
            got = batches(r)
    finally:
        server.terminate()
        server.wait(10)
    expect = batches(StreamReader(local_shards, "train", 4, 512))
    assert len(got) == len(expect) and all(torch.equal(a[0], b[0]) for a, b in zip(got, expect, strict=True))


def test_gs_directory_reads_like_the_local_one_and_a_corrupted_object_is_named(local_shards, tmp_path):
    """gs:// through gcsfs against a GCS emulator on 127.0.0.1 (gcp-storage-emulator; STORAGE_EMULATOR_HOST)."""
    import json

    from helpers.loopback_gcs import LoopbackGCS
    from helpers.loopback_gcs import upload as upload_gs

    with serving(LoopbackGCS):
        url = upload_gs(local_shards, BUCKET, "enwik8")
        kw = dict(batch_size=4, tgt_len=512, roll=True, seed=1)
        with StreamReader(url, "train", remote_options=opts(tmp_path), **kw) as r:
            got = batches(r)
            assert r.cache_info()["fetched_bytes"] > 0
        second = json.loads((local_shards / "manifest.json").read_text())["splits"]["train"]["shards"][1]
        bad = upload_gs(local_shards, BUCKET, "corrupt", flip_a_byte(second["name"]))
        with pytest.raises(ShardError) as e:
            batches(StreamReader(bad, "train", batch_size=1, tgt_len=4096, remote_options=opts(tmp_path / "b")))
    expect = batches(StreamReader(local_shards, "train", **kw))
    assert len(got) == len(expect) and all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expect, strict=True)
    )
    msg = str(e.value)
    assert msg.startswith(f"shard {bad}/{second['name']}: chunk at token offset {second['offset']}")
    assert "does not match manifest.json" in msg and "\n" not in msg


def test_eval_and_analyze_take_an_s3_directory(local_shards, remote_shards, tmp_path, monkeypatch, capsys):
    """`megamemo eval --data s3://...` scores exactly as from the local directory (read through the verified cache
    in $XDG_CACHE_HOME/megamemo/shards), `megamemo analyze` records the same attention, and a missing object is
    one error line naming it."""
    import json

    from helpers.eval_fixtures import tiny_checkpoint

    from megamemo.commands import analyze
    from megamemo.commands import eval as evaluate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    ckpt, _ = tiny_checkpoint(tmp_path / "ck", "lamemo")
    results = {}
    for name, data in (("local", local_shards), ("s3", remote_shards)):
        out = tmp_path / f"{name}.json"
        assert (
            evaluate.main(
                [
                    "--ckpt",
                    str(ckpt),
                    "--data",
                    str(data),
                    "--split",
                    "test",
                    "--batch-size",
                    "3",
                    "--max-segments",
                    "40",
                    "--json",
                    str(out),
                ]
            )
            == 0
        )
        assert (
            analyze.main(
                [
                    "--ckpt",
                    str(ckpt),
                    "--data",
                    str(data),
                    "--segments",
                    "4",
                    "--batch-size",
                    "2",
                    "--out",
                    str(tmp_path / f"an-{name}"),
                ]
            )
            == 0
        )
        results[name] = (json.loads(out.read_text()), json.loads((tmp_path / f"an-{name}/analysis.json").read_text()))
    (ev_local, an_local), (ev_s3, an_s3) = results["local"], results["s3"]
    assert ev_s3["tokens"] == ev_local["tokens"] == 40 * 12 * 3 and ev_s3["nll"] == ev_local["nll"]
    assert an_s3["models"][0]["attention_by_distance"] == an_local["models"][0]["attention_by_distance"]
    assert list((tmp_path / "xdg" / "megamemo" / "shards" / "sha256").glob("*.tar"))

    test_shard = json.loads((local_shards / "manifest.json").read_text())["splits"]["test"]["shards"][0]["name"]
    url = upload(local_shards, "missing-eval", lambda n, d: None if n == test_shard else d)
    capsys.readouterr()
    assert cli.run_command("eval", evaluate.main, ["--ckpt", str(ckpt), "--data", url, "--split", "test"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"megamemo eval: error: shard {url}/{test_shard}: missing (listed in manifest.json)"
    ]


def test_credentials_in_a_url_are_refused_without_echoing_them(tmp_path):
    from megamemo.data import ManifestError

    for url in ("s3://AKIAEXAMPLE:s3cr3t@bucket/prefix", "https://host/shards?X-Amz-Signature=s3cr3t"):
        with pytest.raises(ManifestError, match="credentials in the URL") as e:
            StreamReader(url, "train", 2, 8, remote_options=opts(tmp_path))
        assert "s3cr3t" not in str(e.value) and "AKIAEXAMPLE" not in str(e.value)


def test_train_names_a_missing_object_before_building_anything(local_shards, s3_server, tmp_path, capsys):
    from test_train_runs import TINY

    from megamemo.commands.train import main

    url = upload(local_shards, "missing-cli", lambda n, d: None if n == "train-000002.tar" else d)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    assert (
        main(
            [
                "--config",
                str(cfg),
                "--data",
                url,
                "--run-dir",
                str(tmp_path / "run"),
                "--set",
                f"data.cache_dir={tmp_path / 'cache'}",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.strip().splitlines() == [
        f"megamemo train: error: shard {url}/train-000002.tar: missing (listed in manifest.json)"
    ]
    assert not (tmp_path / "run").exists()


def test_a_blend_resumes_with_a_source_moved_to_s3(local_shards, remote_shards, tmp_path):
    from megamemo.data.blend import BlendReader

    kw = dict(batch_size=2, tgt_len=256, seed=4)
    before = BlendReader([(local_shards, 2), (local_shards, 1)], "train", **kw)
    want = [before.get_batch(0, k) for k in range(9, 14)]
    state = dict(before.state_dict(), step=9)
    after = BlendReader([(local_shards, 2), (remote_shards, 1)], "train", remote_options=opts(tmp_path), **kw)
    after.load_state_dict(state)
    it = iter(after)
    for x, y in want:
        xa, ya = next(it)
        assert torch.equal(x, xa) and torch.equal(y, ya)
    after.close()


def test_a_blend_reads_the_document_index_of_an_s3_source_through_the_verified_cache(tmp_path):
    """A corpus of documents on s3://: the blend's batches equal the local directory's (whole documents), the
    document index is fetched once into the cache, named by its sha256; a damaged index object is named."""
    import json

    import numpy as np
    from test_data_blend import doc_source

    from megamemo.data.blend import BlendReader

    local = tmp_path / "docs"
    doc_source(local, 3, 0, 300, 200)
    url = upload(local, "docs")
    entry = json.loads((local / "manifest.json").read_text())["splits"]["train"]["documents"]
    kw = dict(batch_size=4, tgt_len=128, seed=6)
    want = BlendReader([(local, 1)], "train", **kw)
    with BlendReader([(url, 1)], "train", remote_options=opts(tmp_path), **kw) as got:
        assert got.units[0].kind == "documents" and np.array_equal(got.units[0].starts, want.units[0].starts)
        for k in range(40):
            assert all(torch.equal(x, y) for x, y in zip(got.get_batch(0, k), want.get_batch(0, k), strict=True))
    cached = tmp_path / "cache" / "sha256" / f"{entry['sha256']}.bin"
    assert cached.read_bytes() == (local / entry["file"]).read_bytes()

    def damage(name, data):
        return data[:8] + bytes([data[8] ^ 1]) + data[9:] if name == entry["file"] else data

    bad = upload(local, "docs-bad", damage)
    with pytest.raises(
        ShardError,
        match=f"shard {bad}/{entry['file']}: document index of split train: sha256 .* does not match manifest.json",
    ):
        BlendReader([(bad, 1)], "train", remote_options=opts(tmp_path / "other"), **kw)
    assert not list((tmp_path / "other").rglob("*.bin")) and not list((tmp_path / "other").rglob("*.partial"))


@pytest.mark.multiproc  # starts training processes (`-m 'not multiproc'`: the fast subset)
def test_training_on_a_blend_of_local_and_s3_logs_its_token_mix(local_shards, remote_shards, tmp_path):
    from test_train_runs import TINY, launch, logs, losses, wait

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(
        TINY.replace(
            "data: {batch_size: 4, roll: true}",
            f"data: {{batch_size: 4, blend: [{{dir: {local_shards}, weight: 3}}, "
            f"{{dir: '{remote_shards}', weight: 1}}]}}",
        )
    )
    run_dir = tmp_path / "run"
    procs = launch(
        1,
        cfg,
        "",
        run_dir,
        "--max-steps",
        "10",  # --data "": the blend, not a directory
        "--set",
        f"data.cache_dir={tmp_path / 'cache'}",
    )
    assert wait(procs, 120) == [0], logs(run_dir)[-3000:]
    assert sorted(losses(run_dir)) == list(range(1, 11))
    mix = [ln for ln in logs(run_dir).splitlines() if ln.startswith("[data] blend token mix")]
    assert len(mix) == 1 and mix[0].startswith(f"[data] blend token mix over steps 1-10: {local_shards} ")
    assert f"(weight 75.0%), {remote_shards} " in mix[0] and mix[0].endswith("(weight 25.0%)")

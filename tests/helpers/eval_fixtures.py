"""Small shard directories and checkpoints shared by the eval / generate / analyze tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.tiny import tiny_config
from megamemo.checkpoint.single import save_single
from megamemo.data import build
from megamemo.data.corpora import from_arrays
from megamemo.data.vocab import Vocab
from megamemo.kernels import apply_kernels
from megamemo.model import MemTransformerLM


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small models on a shared 2-core machine: one intra-op thread is many times faster than contended two."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def word_shards(out: Path, n_words: int = 50, n_tokens: int = 3000, seed: int = 0) -> Path:
    """A word-level corpus (random ids over a made-up vocabulary): eval must report perplexity."""
    rng = np.random.default_rng(seed)
    vocab = Vocab("words", ["<eos>", "<unk>"] + [f"w{i}" for i in range(n_words - 2)])
    arrays = {s: rng.integers(0, n_words, n_tokens) for s in ("train", "valid", "test")}
    build(from_arrays(arrays, vocab, "words"), out, chunk_tokens=500, shard_bytes=4000, log=lambda m: None)
    return out


# the eval tests' model: byte vocabulary, wider than helpers.tiny's TINY, segments of 12
EVAL_SIZE = dict(n_token=256, d_model=32, d_head=16, d_inner=64, dropout=0.1, tgt_len=12, mem_len=12)


def eval_record(ckpt: Path, data: Path, out: Path, *args: str) -> dict:
    """`megamemo eval --ckpt CKPT --data DATA --json OUT ARGS` in this process; its record (of the one split)."""
    from megamemo.commands import eval as evaluate

    assert evaluate.main(["--ckpt", str(ckpt), "--data", str(data), *args, "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    return rec[0] if isinstance(rec, list) else rec


def tiny_checkpoint(out: Path, variant="lamemo", seed=0, meta=None, **kw) -> tuple[Path, MemTransformerLM]:
    torch.manual_seed(seed)
    cfg = tiny_config(variant, **{**EVAL_SIZE, **kw})
    model = MemTransformerLM(cfg)
    with torch.no_grad():  # sharper than the 0.02 init, so memory and selection matter to the scores
        for p in model.parameters():
            p.mul_(8.0) if p.dim() == 2 else None
    save_single(out, cfg, model.state_dict(), meta=meta)
    apply_kernels(model, "auto", "cpu")  # the path `megamemo eval` takes on this CPU: the same sums, bit for bit
    return out, model.eval()


def reference_nll(
    model, stream: np.ndarray, batch_size: int, tgt_len: int, max_segments: int = 0, **overrides
) -> tuple[float, int]:
    """Spec §4.3 written out: columns of a [n_step, B] view, segments of tgt_len rows (last one shorter), memory
    carried, total += seq_len * segment mean, result total / sum(seq_len); max_segments > 0: the first ones only."""
    n_step = stream.size // batch_size
    data = torch.from_numpy(stream[: n_step * batch_size].astype(np.int64)).view(batch_size, n_step).t()
    total, length, mem = 0.0, 0, None
    with torch.no_grad():
        for k, i in enumerate(range(0, n_step - 1, tgt_len)):
            if max_segments and k == max_segments:
                break
            seq_len = min(tgt_len, n_step - 1 - i)
            nll, mem = model(data[i : i + seq_len], data[i + 1 : i + 1 + seq_len], mem, **overrides)
            total += seq_len * nll.double().mean().item()
            length += seq_len
    return total / length, length * batch_size

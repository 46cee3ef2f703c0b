"""The single-device checkpoint: what `convert to-single` writes and `eval`/`generate`/`analyze` load.

    DIR/config.json          {"format": "megamemo-single", "version": 1, "model": ModelConfig dict, "meta": {...},
                              "files": {name: {"bytes", "sha256"}}: checked before anything is loaded}
    DIR/model.safetensors    the model's state_dict (tied weights stored once; no pickled code anywhere)
    DIR/memory.safetensors   optional: the memory of chosen streams (Memory.state_dict() form)

Loading it needs nothing but megamemo (or, by hand: build MemTransformerLM(ModelConfig(**config["model"]))
and load_state_dict(safetensors.torch.load_file(...))).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from megamemo.checkpoint.state import read_json
from megamemo.model import Memory, MemTransformerLM, ModelConfig
from megamemo.util.errors import MegamemoError
from megamemo.util.files import atomic_directory, entry_mismatch, file_sha256, save_tensors

FORMAT, VERSION = "megamemo-single", 1


class SingleCheckpointError(MegamemoError, ValueError):
    pass


def save_single(
    out_dir,
    model_cfg: ModelConfig,
    state_dict: dict,
    memory: Memory | None = None,
    meta: dict | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write atomically (util.files.atomic_directory: DIR appears whole or not at all; an existing DIR is an error,
    nothing is overwritten)."""
    out = Path(out_dir)
    if out.exists():
        raise SingleCheckpointError(f"{out}: already exists; refusing to overwrite")
    tensors = {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous().cpu()
        for k, v in state_dict.items()
    }
    with atomic_directory(out) as tmp:
        save_tensors(tensors, tmp / "model.safetensors")
        if memory is not None:
            save_tensors({k: v.contiguous().cpu() for k, v in memory.state_dict().items()}, tmp / "memory.safetensors")
        write_config(tmp, model_cfg, meta or {})
    return out


def write_config(directory: Path, model_cfg: ModelConfig, meta: dict) -> None:
    """config.json, recording the size and sha256 of the directory's tensor files (written before it) and of the
    subword tokenizer's file when meta records one (also as a top-level "tokenizer": {kind, vocab_size, file,
    sha256, ...}, the file beside config.json)."""
    paths = sorted(Path(directory).glob("*.safetensors"))
    tok = meta.get("tokenizer")
    tok = tok if isinstance(tok, dict) else {}
    if tok.get("kind") == "subword" and (Path(directory) / str(tok.get("file"))).is_file():
        paths.append(Path(directory) / tok["file"])
    files = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in paths}
    doc = {"format": FORMAT, "version": VERSION, "model": model_cfg.to_dict(), "meta": meta, "files": files}
    if tok:
        doc["tokenizer"] = tok
    (Path(directory) / "config.json").write_text(json.dumps(doc, indent=2, sort_keys=True))


def verify_file(path: Path) -> Path:
    """`path` (a file of a single-device checkpoint) after checking it against the size and sha256 its config.json
    recorded; a checkpoint written before checksums were recorded is read as it is."""
    doc = read_json(path.parent / "config.json", SingleCheckpointError)
    entry = (doc.get("files") or {}).get(path.name)
    if not path.is_file():
        raise SingleCheckpointError(f"{path}: missing")
    if entry is not None and (
        problem := entry_mismatch(
            entry,
            path.stat().st_size,
            lambda: file_sha256(path),
            recorded=str(path.parent / "config.json"),
            what="size",
        )
    ):
        raise SingleCheckpointError(f"{path}: {problem}: the file changed after it was written (corrupt)")
    return path


_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_streaming(
    path: Path,
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    produce: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
    """A safetensors file written one tensor at a time: the header (names, dtypes, shapes, offsets) first, then
    each tensor as `produce(name)` returns it. Peak memory is one tensor, where safetensors' own save_file wants
    every tensor at once (a whole 7B model in host memory). The format: 8 bytes of little-endian header length,
    the JSON header padded with spaces to 8 bytes, then the data; safetensors' loaders read the result."""
    header: dict[str, object] = {}
    offset = 0
    for name, dtype, shape in specs:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, dtype, shape in specs:
            t = produce(name)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise SingleCheckpointError(
                    f"{path}: {name} came as {t.dtype} {list(t.shape)}, the header says {dtype} {list(shape)}"
                )
            f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())


def model_from_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> MemTransformerLM:
    """The model holding the tensors of `sd` themselves (built on the meta device: no second copy in memory)."""
    with torch.device("meta"):
        model = MemTransformerLM(cfg)
    model.load_state_dict(sd, assign=True)
    return model.eval()


def read_config(path) -> tuple[ModelConfig, dict]:
    p = Path(path) / "config.json"
    if not p.is_file():
        raise SingleCheckpointError(f"{p}: missing (not a megamemo single-device checkpoint)")
    cfg = read_json(p, SingleCheckpointError)
    if cfg.get("format") != FORMAT or cfg.get("version") != VERSION:
        raise SingleCheckpointError(
            f"{p}: format {cfg.get('format')!r} v{cfg.get('version')!r}, expected {FORMAT!r} v{VERSION}"
        )
    return ModelConfig.from_dict(cfg["model"], where=f"{p}:model"), cfg.get("meta", {})


def load_single(path, map_location="cpu") -> tuple[MemTransformerLM, dict]:
    """-> (model in eval mode, meta). Raises SingleCheckpointError naming the file on any mismatch."""
    cfg, meta = read_config(path)
    f = verify_file(Path(path) / "model.safetensors")
    try:
        sd = load_file(str(f), device=str(map_location))
    except Exception as e:
        raise SingleCheckpointError(f"{f}: unreadable ({type(e).__name__}: {e})") from e
    model = MemTransformerLM(cfg)
    expected = model.state_dict()
    missing, extra = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    bad = [k for k in set(sd) & set(expected) if sd[k].shape != expected[k].shape]
    if missing or extra or bad:
        raise SingleCheckpointError(
            f"{f}: does not match {Path(path) / 'config.json'}: missing {missing}, "
            f"unexpected {extra}, wrong shapes {sorted(bad)}"
        )
    dtype = next(iter(sd.values())).dtype if sd else torch.float32
    model = model.to(dtype)
    model.load_state_dict(sd)
    return model.eval(), meta


def load_memory(path) -> Memory | None:
    """The memory `convert --memory` wrote: PATH a single-device checkpoint directory (None when it holds no
    memory.safetensors) or a memory file. A file beside a config.json that records it is checked against its size
    and sha256 first; an unreadable one raises SingleCheckpointError naming it."""
    f = Path(path)
    if f.is_dir():
        f = f / "memory.safetensors"
        if not f.is_file():
            return None
    if not f.is_file():
        raise SingleCheckpointError(f"{f}: missing")
    if (f.parent / "config.json").is_file():
        verify_file(f)
    try:
        return Memory.from_state_dict(load_file(str(f)))
    except Exception as e:
        raise SingleCheckpointError(f"{f}: not a memory file ({type(e).__name__}: {e})") from None

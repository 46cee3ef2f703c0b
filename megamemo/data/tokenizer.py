"""Subword tokenizers: a Hugging Face `tokenizers` file (tokenizer.json) or a SentencePiece model (.model).

    tok = SubwordTokenizer.from_file("tokenizer.json")     # or "spm.model"; TokenizerError names a bad file
    tok = train_bpe(train_texts, 32000)                    # byte-level BPE, deterministic, <|endoftext|> = id 0
    tok.encode_batch(texts) -> [[ids]], tok.decode(ids) -> str, tok.eod_id, len(tok), tok.token_bytes()

The prepared directory stores the tokenizer file beside the shards (``tokenizer.json`` or ``tokenizer.model``)
and the manifest records it (`record()`)::

    "tokenizer": {"kind": "subword", "vocab_size": V, "file": "tokenizer.json", "sha256": ..., "library":
                  "tokenizers" | "sentencepiece", "model": "BPE" | ..., "eod": "<|endoftext|>", "eod_id": 0,
                  "origin": "bpe:N trained on the train split" | "given FILE"}

`token_bytes()` is the number of UTF-8 bytes of text each id stands for (0 for special tokens): exact for
byte-level tokenizers (their symbols are bytes), the piece's text for other ones. Bits per byte divide a score's
total NLL by the bytes of its scored tokens (megamemo/units.py).

The library is the field's standard (Rust, fast, deterministic training); SentencePiece models are read with
`sentencepiece` itself because `tokenizers`' converter needs a protobuf file downloaded at run time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from megamemo.util.errors import MegamemoError
from megamemo.util.files import bytes_sha256

KIND = "subword"
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")
HF_FILE, SPM_FILE = "tokenizer.json", "tokenizer.model"


class TokenizerError(MegamemoError, ValueError):
    """A tokenizer file that cannot be read or used; the message names the file."""


def single_threaded() -> None:
    """tokenizers' own thread pool off: `--workers N` means N processes (and fork stays safe)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def byte_level_alphabet() -> dict[str, int]:
    """The printable character byte-level BPE writes for each byte value -> that byte. Bytes that are visible
    Latin-1 characters stand for themselves; the others (controls, space, 0x7f-0xa0, 0xad) take the characters
    from U+0100 on, in byte order."""
    visible = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in visible:
            table[chr(b)] = b
        else:
            table[chr(0x100 + extra)] = b
            extra += 1
    return table


class SubwordTokenizer:
    kind = KIND

    def __init__(self, library: str, impl, data: bytes, where: str, origin: str = ""):
        self.library, self.impl, self.data, self.where, self.origin = library, impl, data, where, origin
        self.sha256 = bytes_sha256(data)
        self.file_name = HF_FILE if library == "tokenizers" else SPM_FILE
        if library == "tokenizers":
            self.vocab_size = impl.get_vocab_size(with_added_tokens=True)
            spec = json.loads(data)
            self.model = (spec.get("model") or {}).get("type", "?")
            self.byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
            self.specials = {t["id"] for t in spec.get("added_tokens") or [] if t.get("special")}
            found = [t for t in EOD_CANDIDATES if impl.token_to_id(t) is not None]
            self.eod = found[0] if found else None
            self.eod_id = impl.token_to_id(self.eod) if found else None
        else:
            self.vocab_size = impl.get_piece_size()
            self.model, self.byte_level = "sentencepiece", False
            self.specials = {i for i in range(self.vocab_size) if impl.is_control(i) or impl.is_unknown(i)}
            self.eod_id = impl.eos_id() if impl.eos_id() >= 0 else None
            self.eod = impl.id_to_piece(self.eod_id) if self.eod_id is not None else None
        if self.vocab_size < 1:
            raise TokenizerError(f"{where}: the tokenizer has an empty vocabulary")

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path, origin: str | None = None) -> SubwordTokenizer:
        p = Path(path)
        try:
            data = p.read_bytes()
        except OSError as e:
            raise TokenizerError(f"tokenizer {p}: unreadable: {e.strerror or e}") from None
        return cls.from_bytes(
            data,
            "sentencepiece" if p.suffix == ".model" else "tokenizers",
            str(p),
            origin if origin is not None else f"given {p.name}",
        )

    @classmethod
    def from_bytes(cls, data: bytes, library: str, where: str, origin: str = "") -> SubwordTokenizer:
        impl: Any  # a tokenizers.Tokenizer or a SentencePieceProcessor
        if library == "tokenizers":
            from tokenizers import Tokenizer  # heavy: only for a tokenizers file (byte/char/word data need none)

            try:
                impl = Tokenizer.from_str(data.decode("utf-8"))
                json.loads(data)
            except Exception as e:  # the Rust parser raises a bare Exception
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise TokenizerError(f"tokenizer {where}: not a tokenizers tokenizer.json file ({first})") from None
        elif library == "sentencepiece":
            import sentencepiece  # heavy: only for a SentencePiece .model file

            impl = sentencepiece.SentencePieceProcessor()
            try:
                impl.LoadFromSerializedProto(data)
            except Exception as e:
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise TokenizerError(f"tokenizer {where}: not a SentencePiece model ({first})") from None
        else:
            raise TokenizerError(f"tokenizer {where}: unknown library {library!r}")
        return cls(library, impl, data, where, origin)

    def require_eod(self) -> int:
        if self.eod_id is None:
            raise TokenizerError(
                f"tokenizer {self.where}: no end-of-document token (one of "
                f"{', '.join(EOD_CANDIDATES)}, or a SentencePiece eos piece) to put between "
                f"documents"
            )
        return self.eod_id

    # ---- use ----------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.vocab_size

    @property
    def dtype(self) -> np.dtype:
        for dt in ("<u1", "<u2", "<u4"):
            if self.vocab_size - 1 <= np.iinfo(np.dtype(dt)).max:
                return np.dtype(dt)
        return np.dtype("<u8")

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.library == "tokenizers":  # the _fast variant skips offsets (same ids, ~20% faster)
            encode = getattr(self.impl, "encode_batch_fast", self.impl.encode_batch)
            return [e.ids for e in encode(texts, add_special_tokens=False)]
        return self.impl.encode(texts)

    def decode(self, ids, skip_special: bool = False) -> str:
        ids = [int(i) for i in ids]
        if self.library == "tokenizers":
            return self.impl.decode(ids, skip_special_tokens=skip_special)
        return self.impl.decode(ids)

    def token_bytes(self) -> np.ndarray:
        """int64[V]: UTF-8 bytes of text each id stands for (special tokens 0)."""
        out = np.zeros(self.vocab_size, dtype=np.int64)
        if self.library == "tokenizers":
            alpha = byte_level_alphabet() if self.byte_level else None
            for i in range(self.vocab_size):
                if i in self.specials:
                    continue
                piece = self.impl.id_to_token(i) or ""
                if alpha is not None:
                    out[i] = len(piece)  # one character per byte
                else:
                    out[i] = len(_piece_text(piece).encode("utf-8"))
            return out
        for i in range(self.vocab_size):
            if i in self.specials:
                continue
            out[i] = 1 if self.impl.is_byte(i) else len(_piece_text(self.impl.id_to_piece(i)).encode("utf-8"))
        return out

    def record(self) -> dict:
        """What the manifest and a converted checkpoint record about this tokenizer."""
        return {
            "kind": KIND,
            "vocab_size": self.vocab_size,
            "file": self.file_name,
            "sha256": self.sha256,
            "library": self.library,
            "model": self.model,
            "byte_level": self.byte_level,
            "eod": self.eod,
            "eod_id": self.eod_id,
            "origin": self.origin,
        }

    def save(self, directory: str | Path) -> Path:
        p = Path(directory) / self.file_name
        p.write_bytes(self.data)
        return p


def _piece_text(piece: str) -> str:
    """A piece's text: SentencePiece's and Metaspace's ▁ is a space, a byte-fallback piece <0xNN> one byte."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return "x"
    return piece.replace("\u2581", " ")


def parse_spec(spec: str) -> tuple[str, int | str]:
    """`bpe:N` -> ("bpe", N); anything else is a file -> ("file", path)."""
    if spec.startswith("bpe:"):
        try:
            n = int(spec[4:])
        except ValueError:
            n = 0
        if n < 257:
            raise TokenizerError(
                f"--tokenizer {spec}: bpe:N needs an integer N >= 257 (256 byte symbols and <|endoftext|>)"
            )
        return "bpe", n
    return "file", spec


def train_bpe(texts: Iterable[str], vocab_size: int) -> SubwordTokenizer:
    """A byte-level BPE of `vocab_size` symbols (<|endoftext|> = id 0, then the 256 bytes, then merges) trained on
    `texts`. Deterministic: the same texts in the same order give the same tokenizer.json, byte for byte."""
    # heavy: only when a BPE is trained (`prepare text --tokenizer bpe:N`)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOD_CANDIDATES[0]],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    data = tok.to_str().encode("utf-8")
    return SubwordTokenizer.from_bytes(data, "tokenizers", HF_FILE, f"bpe:{vocab_size} trained on the train split")


def load_recorded(directory: str | Path, record: dict, where: str) -> SubwordTokenizer:
    """The tokenizer a manifest or checkpoint `record` names, from `directory`, checked against its sha256."""
    if not isinstance(record, dict) or not isinstance(record.get("file"), str) or "/" in record["file"]:
        raise TokenizerError(f"{where}: field tokenizer.file is missing or not a plain file name")
    p = Path(directory) / record["file"]
    tok = SubwordTokenizer.from_file(p, record.get("origin", ""))
    if record.get("sha256") and tok.sha256 != record["sha256"]:
        raise TokenizerError(
            f"tokenizer {p}: sha256 {tok.sha256[:12]}... differs from {where} field "
            f"tokenizer.sha256 ({record['sha256'][:12]}...)"
        )
    if record.get("vocab_size") is not None and len(tok) != record["vocab_size"]:
        raise TokenizerError(
            f"tokenizer {p}: {len(tok)} symbols, {where} field tokenizer.vocab_size says {record['vocab_size']}"
        )
    return tok


def same_tokenizer(a: dict | None, b: dict | None) -> bool:
    """Whether two records name the same tokenizer (by sha256 for subword ones, by kind otherwise)."""
    a, b = a or {}, b or {}
    if a.get("kind") == KIND or b.get("kind") == KIND:
        return a.get("kind") == b.get("kind") and a.get("sha256") == b.get("sha256")
    return True

"""Vocabularies: one symbol per line (the Transformer-XL `vocab_file` format), plus how symbols map to input.

Three kinds:
* ``bytes``: each symbol is a byte value written in decimal ("32", "101", ...), the symbols of awd-lstm's
  ``prep_enwik8.py``. Encoding is a 256-entry lookup table over raw bytes.
* ``chars``: each symbol is one ASCII character, with ``_`` standing for the space (``prep_text8.py``).
* ``words``: whitespace-separated words; ``<eos>`` closes every line; unknown words map to ``<unk>`` when the
  vocabulary has it.

Frequency-ordered vocabularies follow Transformer-XL's ``Vocab.build_vocab``: specials first, then symbols by
decreasing count, ties in order of first occurrence (``Counter.most_common`` is a stable sort).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megamemo.util.files import bytes_sha256

KINDS = ("bytes", "chars", "words")


def word_level(kind: str | None) -> bool:
    """Whether a manifest's tokenizer kind is word-level: scored in perplexity (bits per token), where byte- and
    character-level corpora are scored in bits per character."""
    return kind in ("words", "word")


def per_token(kind: str | None) -> bool:
    """Whether a tokenizer kind is scored in per-token perplexity: word-level and subword ("subword") corpora;
    subword ones also in bits per byte (`bits_per_byte`). Byte and character corpora: bits per character."""
    return word_level(kind) or kind == "subword"


def unit_of(kind: str | None) -> str:
    """The headline unit of a tokenizer kind: "ppl" (per-token perplexity) or "bpc" (bits per character)."""
    return "ppl" if per_token(kind) else "bpc"


TEXT8_ALPHABET = "_abcdefghijklmnopqrstuvwxyz"  # '_' is the space, as in prep_text8.py


def frequency_order(counts: dict, first_seen: dict | None = None) -> list:
    """Symbols by decreasing count, ties by first occurrence.

    ``counts`` must iterate in first-occurrence order (a plain dict filled while scanning does), unless
    ``first_seen`` gives each symbol's first position explicitly."""
    items = list(counts.items())
    if first_seen is not None:
        items.sort(key=lambda kv: first_seen[kv[0]])
    items.sort(key=lambda kv: -kv[1])  # stable: equal counts keep first-occurrence order
    return [sym for sym, _ in items]


@dataclass
class Vocab:
    kind: str
    symbols: list[str]
    sym2idx: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"vocab kind must be one of {KINDS}, got {self.kind!r}")
        self.sym2idx = {}
        for i, s in enumerate(self.symbols):
            if not s or any(c.isspace() for c in s):
                raise ValueError(f"vocab symbol {i} ({s!r}) is empty or contains whitespace")
            if s in self.sym2idx:
                raise ValueError(f"vocab symbol {s!r} appears twice (ids {self.sym2idx[s]} and {i})")
            self.sym2idx[s] = i
        self._lut = self._byte_table() if self.kind in ("bytes", "chars") else None

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def identity_bytes(cls) -> Vocab:
        """Token id == byte value, 256 symbols."""
        return cls("bytes", [str(b) for b in range(256)])

    @classmethod
    def text8_alphabet(cls) -> Vocab:
        return cls("chars", list(TEXT8_ALPHABET))

    @classmethod
    def load(cls, path: str | Path, kind: str) -> Vocab:
        """Read one symbol per line (first whitespace-separated field, as Transformer-XL does)."""
        symbols = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                parts = line.split()
                if not parts:
                    raise ValueError(f"{path}:{lineno}: empty line in vocabulary file")
                symbols.append(parts[0])
        if not symbols:
            raise ValueError(f"{path}: vocabulary file is empty")
        try:
            return cls(kind, symbols)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def save(self, path: str | Path) -> str:
        """Write the vocabulary; returns the sha256 of the file."""
        data = "".join(s + "\n" for s in self.symbols).encode("utf-8")
        Path(path).write_bytes(data)
        return bytes_sha256(data)

    # ---- properties ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.symbols)

    @property
    def dtype(self) -> np.dtype:
        """Smallest little-endian unsigned integer type holding every id."""
        n = len(self.symbols)
        for dt in ("<u1", "<u2", "<u4"):
            if n - 1 <= np.iinfo(np.dtype(dt)).max:
                return np.dtype(dt)
        return np.dtype("<u8")

    @property
    def unk_id(self) -> int | None:
        return self.sym2idx.get("<unk>")

    # ---- byte-level kinds ---------------------------------------------------------------------------
    def symbol_byte(self, sym: str) -> int:
        if self.kind == "bytes":
            b = int(sym)
            if not 0 <= b <= 255 or str(b) != sym:
                raise ValueError(f"byte vocabulary symbol {sym!r} is not a decimal byte value")
            return b
        if len(sym) != 1 or ord(sym) > 127:
            raise ValueError(f"char vocabulary symbol {sym!r} is not one ASCII character")
        return 32 if sym == "_" else ord(sym)

    def _byte_table(self) -> np.ndarray:
        lut = np.full(256, -1, dtype=np.int64)
        for i, s in enumerate(self.symbols):
            lut[self.symbol_byte(s)] = i
        return lut

    @property
    def byte_table(self) -> np.ndarray:
        """int64[256]: id of each byte value, -1 where the byte is not in the vocabulary."""
        if self._lut is None:
            raise TypeError(f"a {self.kind!r} vocabulary has no byte table")
        return self._lut

    def encode_bytes(self, raw: np.ndarray, where: str = "input", base: int = 0) -> np.ndarray:
        """uint8 array -> ids; a byte outside the vocabulary is an error naming its offset (base + index)."""
        ids = self.byte_table[raw]
        if ids.size and ids.min() < 0:
            k = int(np.argmax(ids < 0))
            raise ValueError(
                f"{where}: byte 0x{int(raw[k]):02x} at byte offset {base + k} is not in the {self.kind} vocabulary"
            )
        return ids

    # ---- word kind ----------------------------------------------------------------------------------
    def encode_words(self, words: list[str], where: str = "input") -> tuple[list[int], int]:
        """Word ids and the number of words mapped to <unk> (an unknown word without <unk> is an error)."""
        get = self.sym2idx.get
        ids = [get(w, -1) for w in words]
        n_unk = 0
        if -1 in ids:
            unk = self.unk_id
            for i, v in enumerate(ids):
                if v == -1:
                    if unk is None:
                        raise ValueError(f"{where}: word {words[i]!r} is not in the vocabulary and it has no <unk>")
                    ids[i] = unk
                    n_unk += 1
        return ids, n_unk

    # ---- decoding -----------------------------------------------------------------------------------
    def decode(self, ids) -> str:
        """Text of a sequence of ids (bytes are decoded as UTF-8 with replacement)."""
        ids = [int(i) for i in ids]
        if self.kind == "words":  # <eos> ends a line
            lines: list[str] = []
            words: list[str] = []
            for i in ids:
                if self.symbols[i] == "<eos>":
                    lines.append(" ".join(words) + "\n")
                    words = []
                else:
                    words.append(self.symbols[i])
            return "".join(lines) + " ".join(words)
        raw = bytes(self.symbol_byte(self.symbols[i]) for i in ids)
        return raw.decode("utf-8", errors="replace")

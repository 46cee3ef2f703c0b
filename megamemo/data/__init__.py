"""megamemo data pipeline: raw corpora -> zstd webdataset shards -> contiguous, rank-sharded, resumable batches.

See megamemo/data/README.md. Main entry points:
    StreamReader      batches laid out as Transformer-XL's LMOrderedIterator, sharded over ranks, exact resume
    build, corpora    `megamemo prepare` in Python
    verify_shards     `megamemo verify-shards` in Python
"""

from .shard_reader import load_vocab, read_split, verify_shards
from .shards import ManifestError, ShardError, build, load_manifest
from .vocab import Vocab

__all__ = [
    "StreamReader",
    "ShardError",
    "ManifestError",
    "build",
    "load_manifest",
    "load_vocab",
    "read_split",
    "verify_shards",
    "Vocab",
]


def __getattr__(name):  # StreamReader imports torch; `megamemo prepare` should not pay for that
    if name == "StreamReader":
        from .stream import StreamReader  # torch: see the line above

        return StreamReader
    raise AttributeError(f"module 'megamemo.data' has no attribute {name!r}")

"""Download the standard enwik8 (Hutter prize: the first 10^8 bytes of a 2006 English Wikipedia dump) and check it.

The zip is fetched from its canonical home, unpacked, and checked against published facts about the file:
its size (100,000,000 bytes) and the sha256 digests of its first 150,000 and 1,000,000 bytes.
"""

from __future__ import annotations

import hashlib
import io
import sys
import urllib.request
import zipfile
from pathlib import Path

URL = "http://mattmahoney.net/dc/enwik8.zip"
SIZE = 100_000_000
PREFIX_SHA256 = {
    150_000: "3803c167dfeb4a91936ac52011be24639822204896b8d0a4658e0480f0f5dc1f",
    1_000_000: "369b688978f649681136198fb96db14c1616756260c55fb4b65e9bc049552cad",
}


def check(path: Path) -> None:
    data = path.read_bytes()
    if len(data) != SIZE:
        raise SystemExit(f"{path}: {len(data)} bytes, enwik8 has {SIZE}")
    for n, digest in PREFIX_SHA256.items():
        got = hashlib.sha256(data[:n]).hexdigest()
        if got != digest:
            raise SystemExit(f"{path}: sha256 of the first {n} bytes is {got}, enwik8's is {digest}")


def main(out_dir: str) -> None:
    out = Path(out_dir) / "enwik8"
    if out.exists():
        check(out)
        print(f"[fetch] {out} present and checked")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"[fetch] downloading {URL}")
    with urllib.request.urlopen(URL, timeout=120) as r:
        blob = r.read()
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        tmp = out.with_suffix(".part")
        tmp.write_bytes(z.read("enwik8"))
    check(tmp)
    tmp.rename(out)
    print(f"[fetch] {out}: {SIZE:,} bytes, checksums match")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "data/raw")

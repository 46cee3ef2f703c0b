"""Which counter-based generator keyed dropout masks use (train.dropout_masks: keyed, megamemo/kernels/keyed.py):
the three with a published design and a published BigCrush record, each written in eager torch integer ops and
checked against its known answers, timed per random byte beside torch's own CPU generator (mt19937, what stream
masks draw from).

    python bench/keyed_rng.py [--threads 1] [--bytes 2097152 262144]

  * Philox-4x32-10 (Salmon et al. 2011; Random123, cuRAND): 128 bits per counter; megamemo's two forms
    (megamemo/kernels/philox.py: int64 only, and the eager CPU form on int32 words);
  * Threefry-2x32-20 (the same paper; JAX's generator): 64 bits per counter, adds, rotations and xors;
  * Squares (Widynski 2020), four 64-bit rounds: 32 bits per counter (64-bit products wrap in int64).
Known answers: Random123's kat_vectors for Philox and Threefry; Squares against the paper's C statement run in
Python integers. On this machine (1 thread, two runs) Philox's CPU form was the cheapest per byte (1.7-2.8 ns, Squares
3.0-3.8, Threefry 6.6-7.1, mt19937 0.4), which is why the masks use it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megamemo.kernels.philox import MASK, philox, philox_words32

ROT = (13, 15, 26, 6, 17, 29, 16, 24)  # Threefry-2x32's rotation constants
PARITY = 0x1BD11BDA


def threefry2x32(x0, x1, k0: int, k1: int, rounds: int = 20):
    ks = (k0, k1, PARITY ^ k0 ^ k1)
    x0, x1 = (x0 + ks[0]) & MASK, (x1 + ks[1]) & MASK
    for i in range(rounds):
        x0 = (x0 + x1) & MASK
        x1 = ((x1 << ROT[i % 8]) | (x1 >> (32 - ROT[i % 8]))) & MASK
        x1 = x1 ^ x0
        if i % 4 == 3:
            j = i // 4 + 1
            x0, x1 = (x0 + ks[j % 3]) & MASK, (x1 + ks[(j + 1) % 3] + j) & MASK
    return x0, x1


def _rot32(x):
    """x rotated by 32 bits: its two 32-bit halves swapped (int64)."""
    return x.view(torch.int32).unflatten(-1, (-1, 2)).flip(-1).flatten(-2).view(torch.int64)


def squares32(ctr, key: int):
    """Squares' 32-bit output (key as a signed 64-bit value)."""
    x = ctr * key
    y, z = x, x + key
    x = _rot32(x * x + y)
    x = _rot32(x * x + z)
    x = _rot32(x * x + y)
    return (x * x + z).view(torch.int32).unflatten(-1, (-1, 2))[..., 1]


def squares_reference(ctr: int, key: int) -> int:
    m = (1 << 64) - 1
    x = y = (ctr * key) & m
    z = (y + key) & m
    rot = lambda v: ((v >> 32) | (v << 32)) & m  # noqa: E731
    x = rot((x * x + y) & m)
    x = rot((x * x + z) & m)
    x = rot((x * x + y) & m)
    return ((x * x + z) & m) >> 32


def check_known_answers() -> None:
    t = lambda *v: [torch.tensor([x]) for x in v]  # noqa: E731
    ctr, key = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)
    want = [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]
    assert [int(w) for w in philox(*t(*ctr), *key)] == want
    assert [int(w.view(torch.uint32)) for w in philox_words32(*t(*ctr), *key)] == want
    assert [int(w) for w in threefry2x32(*t(0x243F6A88, 0x85A308D3), 0x13198A2E, 0x03707344)] == [
        0xC4923A9C,
        0x483DF7A0,
    ]
    key64 = 0xC8E4FD154CE32F6D
    ctrs = [0, 1, 2, 12345678901, 2**40 + 7]
    got = squares32(torch.tensor(ctrs), key64 - (1 << 64))
    assert [int(g) & MASK for g in got] == [squares_reference(c, key64) for c in ctrs]


def best(f, reps=20) -> float:
    f()
    out = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        out = min(out, time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bytes", type=int, nargs="+", default=[1 << 21, 1 << 18])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    check_known_answers()
    print(f"known answers: Philox-4x32-10 (both forms), Threefry-2x32-20, Squares: ok; {args.threads} thread(s)")
    for n in args.bytes:
        c16, c8, c4 = torch.arange(n // 16), torch.arange(n // 8), torch.arange(n // 4)
        cands = {
            "mt19937 (torch random_)": lambda n=n: torch.empty(n // 8, dtype=torch.int64).random_(-(2**63), None),
            "Philox-4x32-10, int64": lambda c16=c16: philox(c16, c16, c16, c16, 1, 2),
            "Philox-4x32-10, CPU form": lambda c16=c16: philox_words32(c16, c16, c16, c16, 1, 2),
            "Threefry-2x32-20": lambda c8=c8: threefry2x32(c8, c8, 1, 2),
            "Squares (4 rounds)": lambda c4=c4: squares32(c4, 0x4CE32F6D),
        }
        for name, f in cands.items():
            dt = best(f)
            print(f"{n:>9} bytes  {name:<26} {dt * 1e3:8.3f} ms  {dt / n * 1e9:6.3f} ns/byte")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""megamemo.data.stats: the unigram baseline (against hand-computed values) and the prompt excerpt."""

import math

import numpy as np
import pytest
from helpers.fixture_data import ENWIK8

from megamemo.data.cli import prepare_main
from megamemo.data.stats import entropy_bits, excerpt, unigram_baseline, unigram_bits

# Tolerances here: pytest.approx (default rel 1e-6) and rel=1e-12 compare float64 evaluations of the same formula
# (IEEE arithmetic, rounded alike on any CPU; numpy's sums in another order at most): they differ by a few u64
# (1.1e-16) relative, so either tolerance only says 'the same number'. Nothing here depends on a CPU's kernels.


def test_unigram_bits_add_one_by_hand():
    # fitted on [0, 0, 1] over 2 symbols: counts + 1 = [3, 2] -> p = [0.6, 0.4]
    # scoring [0, 1]: -(log2 0.6 + log2 0.4) / 2 = (0.7369656 + 1.3219281) / 2
    assert unigram_bits([0, 0, 1], [0, 1], 2) == pytest.approx(1.0294468, abs=1e-6)
    # a symbol never seen in the fitted tokens still has mass: [0, 0] over 4 symbols -> p(3) = 1 / 6
    assert unigram_bits([0, 0], [3], 4) == pytest.approx(math.log2(6))
    # without smoothing an unseen symbol is an error, not an infinity
    with pytest.raises(ValueError, match="probability 0"):
        unigram_bits([0, 0], [3], 4, smoothing=0.0)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        unigram_bits([0, 2], [0], 2)


def test_entropy_bits_by_hand():
    assert entropy_bits([0, 1], 2) == pytest.approx(1.0)
    assert entropy_bits([0, 0, 0, 1], 256) == pytest.approx(0.8112781, abs=1e-6)  # -(.75 log2 .75 + .25 log2 .25)
    assert entropy_bits([7] * 5, 256) == 0.0
    # the split's own entropy bounds any unigram fitted elsewhere from below
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 20, 1000), rng.integers(0, 20, 1000)
    assert entropy_bits(b, 20) <= unigram_bits(a, b, 20)


def test_baseline_and_excerpt_on_prepared_enwik8(tmp_path):
    assert prepare_main(["enwik8", "--raw", str(ENWIK8), "--out", str(tmp_path), "--quiet"]) == 0
    raw = ENWIK8.read_bytes()
    h = len(raw) * 5 // 100
    train, test = raw[: len(raw) - 2 * h], raw[len(raw) - h :]
    r = unigram_baseline(tmp_path)
    p = (np.bincount(np.frombuffer(train, np.uint8), minlength=256) + 1.0) / (len(train) + 256)
    want = -np.mean(np.log2(p[np.frombuffer(test, np.uint8)]))
    assert r["bits"] == pytest.approx(want, rel=1e-9)
    assert r["tokens"] == len(test) and r["fit_tokens"] == len(train) and r["unit"] == "bpc"
    assert 3.0 < r["self_entropy"] < r["bits"] < 8.0
    # the excerpt starts on a line and holds the split's own bytes
    x = excerpt(tmp_path, "test", start=100, n_tokens=64)
    k = test.index(b"\n", 99) + 1
    assert x == test[k : k + 64]
    assert excerpt(tmp_path, "test", start=0, n_tokens=10) == test[:10]
    assert excerpt(tmp_path, "test", start=10**9, n_tokens=50) == test[-50:]  # past the end: the last 50

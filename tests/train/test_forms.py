"""How `model.attention: auto` picks the layers' form on CUDA (megamemo/train/forms.py), run on the CPU with the
device's capability faked: the candidates it may time, that a form that fails to run or to agree with eager is
skipped in one line and never chosen however fast it would be, that the fastest passing form wins, that flex is
never a candidate below sm80 or under train.deterministic, and which compiled forms train.compile allows (under
tensor parallelism too: there the attention regions are compiled, not the layers)."""

from __future__ import annotations

import types

import pytest

from megamemo.kernels import apply as kernels_apply
from megamemo.kernels import attention_in_use
from megamemo.kernels.form_check import Form
from megamemo.model import MemTransformerLM, ModelConfig
from megamemo.model.attention import causal_attention, lookahead_attention
from megamemo.train import forms
from megamemo.train.config import from_dict as load_dict


def _run(**train):
    cfg = ModelConfig(
        variant="lamemo",
        n_token=40,
        n_layer=2,
        d_model=32,
        n_head=2,
        d_head=16,
        d_inner=64,
        dropout=0.0,
        tgt_len=8,
        mem_len=8,
    )
    return load_dict({"model": cfg.to_dict(), "train": {"compile": "off", **train}})


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(forms, "capability", lambda device: (9, 0))


@pytest.fixture
def clock(monkeypatch):
    """The start-up timing's clock made virtual (form_check reads time.perf_counter): a `_slow` function advances it
    by a second a call, so a slowed form is slower by whole seconds whatever else the machine runs."""
    from megamemo.kernels import form_check

    now = [0.0]
    monkeypatch.setattr(form_check, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    return now


def _slow(fn, clock):
    def slowed(*a, **kw):
        clock[0] += 1.0
        return fn(*a, **kw)

    return slowed


def test_a_form_that_fails_is_skipped_and_never_chosen_however_fast(sm90, clock, monkeypatch):
    """eager is slowed down; fused is made to raise (a compile error), then to be fast and wrong: neither is ever
    chosen, each is named in the one start-up line, and the real flex (no backward on the CPU) is skipped too."""
    monkeypatch.setitem(
        kernels_apply._ATTENTION_FUNCTIONS, "eager", (_slow(causal_attention, clock), _slow(lookahead_attention, clock))
    )

    def broken(*a, **kw):
        raise RuntimeError("InductorError: planted compile failure")

    def wrong(q, k, v, r, u, vb, *a, **kw):  # fast, and off by a plausible slip
        return causal_attention(q, k, v, r, u, vb * 1.05, *a, **kw)

    for fused, says in (
        (broken, "fused failed at B=2 L=8 M=8 float32: RuntimeError: InductorError: planted"),
        (wrong, "fused vs eager at B=2 L=8 M=8 float32: worst"),
    ):
        monkeypatch.setitem(kernels_apply._ATTENTION_FUNCTIONS, "fused", (fused, lookahead_attention))
        run, lines = _run(), []
        model = MemTransformerLM(run.model)
        chosen = forms.choose_form(run, model, "cuda", 2, lines.append)
        assert chosen == Form("eager", False), lines
        assert len(lines) == 1 and lines[0].startswith("[train] attention: eager, eager layers"), lines
        assert "skipped " + says in lines[0] and "skipped flex failed at" in lines[0], lines
        assert "eager " in lines[0] and " ms" in lines[0], lines


def test_the_fastest_form_that_agrees_is_chosen(sm90, clock, monkeypatch):
    """fused (a correct one: eager's own functions) against a slowed eager: fused wins, and the model computes in
    it."""
    monkeypatch.setitem(kernels_apply._ATTENTION_FUNCTIONS, "fused", (causal_attention, lookahead_attention))
    monkeypatch.setitem(
        kernels_apply._ATTENTION_FUNCTIONS, "eager", (_slow(causal_attention, clock), _slow(lookahead_attention, clock))
    )
    run, lines = _run(), []
    model = MemTransformerLM(run.model)
    chosen = forms.choose_form(run, model, "cuda", 2, lines.append)
    assert chosen == Form("fused", False) and attention_in_use(model) == "fused", lines
    assert lines[0].startswith("[train] attention: fused, eager layers") and "fused " in lines[0], lines


def test_pick_takes_the_fastest_finite_time_and_eager_when_none():
    fs = [Form("eager"), Form("fused"), Form("flex"), Form("fused", True)]
    inf = float("inf")
    assert forms.pick(fs, [3.0, 2.0, 1.0, inf]) == Form("flex")
    assert forms.pick(fs, [3.0, 2.0, inf, 1.5]) == Form("fused", True)
    assert forms.pick(fs, [3.0, 3.0, inf, inf]) == Form("eager")  # a tie keeps the earlier
    assert forms.pick(fs, [inf, inf, inf, inf]) == Form("eager")


@pytest.mark.parametrize(
    "cap,deterministic,flex", [((7, 0), False, False), ((8, 0), False, True), ((9, 0), True, False)]
)
def test_flex_is_never_a_candidate_below_sm80_or_under_determinism(cap, deterministic, flex, monkeypatch):
    monkeypatch.setattr(forms, "capability", lambda device: cap)
    got, skipped = forms.candidates(_run(deterministic=deterministic), "cuda", print)
    assert (Form("flex") in got) == flex and Form("fused") in got and got[0] == Form("eager")
    if not flex:
        assert any(s.startswith("flex: ") for s in skipped), skipped


def test_compiled_candidates_follow_train_compile(sm90):
    def compiled(run):
        return {f.compiled for f in forms.candidates(run, "cuda", print)[0]}

    assert compiled(_run(compile="off")) == {False}
    assert compiled(_run(compile="auto")) == {False, True}
    assert compiled(_run(compile="on")) == {True}
    tp2 = load_dict({"model": _run().model.to_dict(), "parallel": {"tp": 2}, "train": {"compile": "auto"}})
    assert compiled(tp2) == {False, True}  # under TP compiled means the attention regions (compiler.py)


def test_auto_on_the_cpu_is_eager_without_a_check(monkeypatch):
    def must_not_run(*a, **kw):
        raise AssertionError("no start-up check on the CPU")

    monkeypatch.setattr(forms, "check_form", must_not_run)
    run = _run()
    model = MemTransformerLM(run.model)
    assert forms.choose_form(run, model, "cpu", 2, print) == Form("eager", False)
    assert attention_in_use(model) == "eager"

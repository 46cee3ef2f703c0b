"""`model.n_token: auto` and padded vocabularies (megamemo/config/vocab.py, model.n_vocab).

auto takes the vocabulary from the data's manifest (text8's 27 characters here) and pads the tables to a multiple of
128 x tp; an explicit n_token is used as given, one too small for the data is a one-line error. A padded model is
the unpadded one with extra rows that nothing sees: hand-built pairs (the same real rows, the padding rows set to
values that would dominate if they leaked) give the same NLL, log-probabilities, gradients and bits per byte, for
the full softmax (tied, untied), the adaptive softmax (padding inside its last cluster) and a pipeline stage's output
bias; generation never emits a padding id. A resumed auto run keeps its checkpoint's tables under another tp."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from helpers.bounds import backward_bound, sum_bound
from helpers.fixture_data import TEXT8

from megamemo.config.run import ConfigError
from megamemo.model import MemTransformerLM, ModelConfig
from megamemo.train.config import load
from megamemo.train.vocab import adopt_checkpoint_vocab, padded_vocab

SMALL = dict(n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=32, dropout=0.0, tgt_len=6, mem_len=6)
# padded against unpadded: everything below the output layer has the same shapes and values; the output's logits
# (d_model terms each) and the log-softmax's normaliser (the V real terms; padding adds exact zeros) run in other
# GEMM shapes, so other orders: two orders of d_model + V terms, relative to the log-probabilities' size (fp32)
OUT_TERMS = SMALL["d_model"] + 27
VOCAB_KEYS = ("word_emb.emb_layers.", "crit.out_weights.", "crit.out_bias")


@pytest.fixture(scope="module")
def text8_shards(tmp_path_factory):
    """Character shards of the text8 fixture: a vocabulary of 27 symbols (a-z and space)."""
    from megamemo.data.cli import prepare_main

    out = tmp_path_factory.mktemp("text8") / "shards"
    assert prepare_main(["text8", "--raw", str(TEXT8), "--out", str(out), "--quiet"]) == 0
    return out


def config_file(tmp_path, n_token="auto", tp=1, data=None, extra=""):
    p = tmp_path / "run.yaml"
    p.write_text(
        f"model: {{variant: lamemo, n_token: {n_token}, n_layer: 1, d_model: 16, n_head: 2, d_head: 8, "
        f"d_inner: 32, tgt_len: 8, mem_len: 8{extra}}}\n"
        f"data: {{dir: '{'' if data is None else data}', batch_size: 4}}\nparallel: {{tp: {tp}}}\n"
    )
    return p


# ---- resolution -------------------------------------------------------------------------------------------------
def test_padded_vocab_by_hand():
    assert padded_vocab(24973, 1) == (25088, 24973)  # 196 x 128
    assert padded_vocab(24973, 2) == (25088, 24973)  # 98 x 256
    assert padded_vocab(24973, 4) == (25088, 24973)  # 49 x 512
    assert padded_vocab(24973, 8) == (25600, 24973)  # 25 x 1024
    assert padded_vocab(27, 1) == (128, 27) and padded_vocab(27, 2) == (256, 27)
    assert padded_vocab(256, 1) == (256, None) and padded_vocab(256, 2) == (256, None)  # nothing to pad
    assert padded_vocab(256, 4) == (512, 256)
    assert padded_vocab(32000, 2) == (32000, None) and padded_vocab(32000, 4) == (32256, 32000)


@pytest.mark.parametrize("tp, n_token", [(1, 128), (2, 256)])
def test_auto_takes_the_manifest_vocabulary_padded_for_tp(tp, n_token, text8_shards, tmp_path):
    cfg = load(config_file(tmp_path, tp=tp, data=text8_shards))
    assert (cfg.model.n_token, cfg.model.n_vocab, cfg.model.vocab_size, cfg.n_token_auto) == (n_token, 27, 27, True)
    assert cfg.model.n_token % (128 * tp) == 0
    written = cfg.to_dict()["model"]  # the run's config.yaml: the resolved numbers
    assert (written["n_token"], written["n_vocab"]) == (n_token, 27)
    # --data (data.dir through --set) is what the manifest is read from
    cfg = load(config_file(tmp_path, tp=tp), [f"data.dir={text8_shards}"])
    assert cfg.model.n_token == n_token


def test_auto_with_a_vocabulary_already_a_multiple_pads_nothing(shards, tmp_path):
    cfg = load(config_file(tmp_path, tp=2, data=shards))  # enwik8 bytes: 256 symbols
    assert (cfg.model.n_token, cfg.model.n_vocab) == (256, None) and "n_vocab" not in cfg.model.to_dict()
    explicit = load(config_file(tmp_path, n_token=256, tp=2, data=shards))
    assert cfg.model_fingerprint() == explicit.model_fingerprint()  # the same identity as n_token: 256


def test_an_explicit_n_token_wins(text8_shards, tmp_path):
    cfg = load(config_file(tmp_path, data=text8_shards), ["model.n_token=27"])
    assert (cfg.model.n_token, cfg.model.n_vocab, cfg.n_token_auto) == (27, None, False)
    from megamemo.train.data import check_data_dir

    assert check_data_dir(cfg)["vocab"]["size"] == 27  # the corpus's 27 symbols fit n_token 27 exactly


def test_a_too_small_explicit_n_token_is_one_line(text8_shards, tmp_path, capsys):
    from megamemo.commands import train as cli

    cfg_file = config_file(tmp_path, n_token=20, data=text8_shards)
    assert cli.main(["--config", str(cfg_file), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "model.n_token: 20 is smaller than the vocabulary of" in err and "(27 symbols)" in err, err
    assert not (tmp_path / "run").exists()
    cfg_file = config_file(tmp_path, n_token=128, data=text8_shards, extra=", n_vocab: 20")  # padded, too few symbols
    assert cli.main(["--config", str(cfg_file), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model.n_vocab: 20 is smaller than the vocabulary of" in err, err


def test_an_explicit_n_token_above_the_datas_vocabulary_is_one_warning_naming_the_unused_ids(
    text8_shards, tmp_path, capsys
):
    """Issue 50: an explicit n_token larger than the corpus's vocabulary (a 32k config over a BPE that saturated
    early) trains rows no target ever is: the run starts, with one warning line naming them; auto and an exact
    n_token say nothing."""
    from helpers import forked
    from helpers.runs_cache import REPO

    from megamemo.train.data import check_data_dir, unused_ids

    run = ["--max-steps", "0", "--set", "eval.every=0", "--set", "log.tensorboard=false"]
    cfg_file = config_file(tmp_path, n_token=64, data=text8_shards)
    # in its own process: a training run in this one would leave its process group and rendezvous port behind
    env = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
    )
    r = forked.run_megamemo(["train", "--config", cfg_file, "--run-dir", tmp_path / "run", *run], env, REPO, 180)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    warned = [line for line in out.splitlines() if "warning" in line]
    assert warned == [
        "[train] warning: model.n_token: 64 symbols, but the data's vocabulary has 27: ids 27..63 (37) "
        "never occur and are trained in the softmax unseen (model.n_token: auto sizes the tables to "
        "the data)"
    ], out
    padded = load(config_file(tmp_path, n_token=128, data=text8_shards, extra=", n_vocab: 28"))
    assert "model.n_vocab: 28 symbols" in unused_ids(padded, check_data_dir(padded)) and "id 27 (1)" in unused_ids(
        padded, check_data_dir(padded)
    )
    for n_token in ("auto", 27):
        cfg = load(config_file(tmp_path, n_token=n_token, data=text8_shards))
        assert unused_ids(cfg, check_data_dir(cfg)) is None


@pytest.mark.parametrize("extra, data, key", [("", None, "model.n_token"), (", n_vocab: 20", "TEXT8", "model.n_vocab")])
def test_auto_errors_name_the_key(extra, data, key, text8_shards, tmp_path):
    with pytest.raises(ConfigError) as e:
        load(config_file(tmp_path, data=text8_shards if data else None, extra=extra))
    assert str(e.value).startswith(key + ":") and "\n" not in str(e.value), e.value
    with pytest.raises(ConfigError, match=r"^model\.n_token: auto: cannot read the vocabulary from data\.dir"):
        load(config_file(tmp_path, data=tmp_path / "nowhere"))


def test_model_config_checks_n_vocab():
    with pytest.raises(ValueError, match=r"^model\.n_vocab: must be in \[1, n_token=128\]"):
        ModelConfig(n_token=128, n_vocab=129).validate()
    with pytest.raises(ValueError, match=r"^model\.cutoffs: .*inside \(0, 27\)"):
        ModelConfig(n_token=128, n_vocab=27, cutoffs=[10, 27]).validate()  # a last cluster of padding only
    assert ModelConfig(n_token=128, n_vocab=27, cutoffs=[10, 26]).validate().vocab_size == 27


# ---- a padded model is the unpadded one -------------------------------------------------------------------------
def padded_pair(V=27, N=128, seed=0, **kw):
    """(unpadded model, padded model with the same real rows and everything else; its padding rows and their output
    biases set large, so any leak of them into the softmax would show)."""
    torch.manual_seed(seed)
    small = MemTransformerLM(ModelConfig(n_token=V, **SMALL, **kw)).train()
    big = MemTransformerLM(ModelConfig(n_token=N, n_vocab=V, **SMALL, **kw)).train()
    sd, want = small.state_dict(), big.state_dict()
    with torch.no_grad():
        for k, t in want.items():
            s = sd[k]
            if t.shape == s.shape:
                t.copy_(s)
                continue
            assert k.startswith(VOCAB_KEYS), k  # only the vocabulary's tables differ in size
            t.copy_(torch.cat([s, torch.full((t.size(0) - s.size(0), *t.shape[1:]), 5.0)], 0))
    big.load_state_dict(want)
    return small, big


def data(V, L=6, B=3, n=3, seed=1):
    x = torch.randint(0, V, (n * L + 1, B), generator=torch.Generator().manual_seed(seed))
    return [(x[i * L : (i + 1) * L], x[i * L + 1 : (i + 1) * L + 1]) for i in range(n)]


CASES = {
    "tied": {},
    "untied": dict(tie_weight=False),
    "adaptive": dict(cutoffs=[10, 20], div_val=2, tie_projs=[False, True, False]),
}


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
@pytest.mark.parametrize("case", list(CASES))
def test_padded_model_scores_and_learns_as_the_unpadded_one(case):
    V = 27
    small, big = padded_pair(V, **CASES[case])
    mem_s = mem_b = None
    for inp, tgt in data(V):
        nll_s, mem_s = small(inp, tgt, mem_s)
        nll_b, mem_b = big(inp, tgt, mem_b)
        tol = sum_bound(OUT_TERMS, float(nll_s.abs().max()))  # 7.6e-5 here, measured <= 4.8e-7 at both ISAs
        assert torch.allclose(nll_b, nll_s, rtol=0, atol=tol), (case, (nll_b - nll_s).abs().max())
        (nll_s.mean()).backward()
        (nll_b.mean()).backward()
    gs, gb = dict(small.named_parameters()), dict(big.named_parameters())
    for k, p in gb.items():
        g, ref = p.grad, gs[k].grad
        if g.shape != ref.shape:  # the vocabulary's tables: real rows as unpadded, padding rows untouched
            assert torch.equal(g[ref.size(0) :], torch.zeros_like(g[ref.size(0) :])), (case, k)
            g = g[: ref.size(0)]
        # the output's difference carried through the backward pass, 3 segments of 6 x 3 tokens
        # (tests/helpers/bounds.py)
        tol = backward_bound(small.cfg, float(ref.abs().max()), tokens=54)
        assert torch.allclose(g, ref, rtol=0, atol=tol), (case, k, (g - ref).abs().max())
    with torch.no_grad():  # log-probabilities: the unpadded ones, then -inf for every padding id
        small.eval(), big.eval()
        lp_s, _ = small(data(V)[0][0])
        lp_b, _ = big(data(V)[0][0])
    assert lp_b.shape[-1] == 128 and torch.all(lp_b[..., V:] == -math.inf)
    tol = sum_bound(OUT_TERMS, float(lp_s.abs().max()))
    assert torch.allclose(lp_b[..., :V], lp_s, rtol=0, atol=tol)
    # probabilities <= 1: their log's error, plus a sum of V of them (V u)
    assert torch.allclose(lp_b.exp().sum(-1), torch.ones(lp_b.shape[:2]), rtol=0, atol=tol + sum_bound(V, 1.0))


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
def test_bits_per_byte_of_a_padded_model_are_the_unpadded_ones():
    from megamemo.eval.evaluate import evaluate

    V = 27
    small, big = padded_pair(V)
    token_bytes = torch.arange(1, V + 1)  # any byte counts: bits per byte = NLL / ln 2 / bytes
    a = evaluate(small.eval(), data(V, n=4), token_bytes=token_bytes)
    b = evaluate(big.eval(), data(V, n=4), token_bytes=token_bytes)
    assert a["tokens"] == b["tokens"] and a["bytes"] == b["bytes"]
    # positive per-token NLLs, each within 2 (d_model + V) u of its own size: their mean is within that relative
    # (5.1e-6; the fp64 sums add nothing at this size)
    assert b["bits_per_byte"] == pytest.approx(a["bits_per_byte"], rel=sum_bound(OUT_TERMS, 1.0), abs=0)
    assert b["nll"] == pytest.approx(a["nll"], rel=sum_bound(OUT_TERMS, 1.0), abs=0)


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
def test_pipeline_output_bias_masks_the_padding():
    from megamemo.parallel.pipeline import OutBiasPipe, StageContext, mean_nll

    V, N = 27, 128
    cfg = ModelConfig(n_token=N, n_vocab=V, **SMALL)
    out = OutBiasPipe(cfg, StageContext(cfg))
    with torch.no_grad():
        out.out_bias.normal_(generator=torch.Generator().manual_seed(0)).add_(
            torch.cat([torch.zeros(V), torch.full((N - V,), 9.0)])
        )
    logits = torch.randn(4, 2, N, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, V, (4, 2), generator=torch.Generator().manual_seed(2))
    got = out(logits)
    assert torch.all(got[..., V:] == -math.inf)
    want = torch.nn.functional.cross_entropy((logits[..., :V] + out.out_bias[:V]).reshape(-1, V), labels.reshape(-1))
    # fp32, the same bias added; the log-softmax over V real terms (the padding's exp is an exact 0) and the mean
    # of 8 in other orders: 2 (V + 8) u of the largest -log p
    scale = float(-torch.log_softmax((logits[..., :V] + out.out_bias[:V]).double(), -1).max())
    assert torch.allclose(mean_nll(got, labels), want, rtol=0, atol=sum_bound(V + 8, scale))


# ---- generation -------------------------------------------------------------------------------------------------
def test_generation_never_emits_a_padding_id():
    from megamemo.model.generation import generate

    V = 27
    _, big = padded_pair(V)
    with torch.no_grad():  # padding rows that would win every draw were they not masked
        big.crit.out_bias[V:] = 50.0
    prompt = data(V)[0][0][:, 0].tolist()
    sampled, dists = generate(big, prompt, 200, top_p=1.0, temperature=3.0, seed=4, return_logprobs=True)
    greedy = generate(big, prompt, 30, greedy=True)
    assert max(sampled) < V and max(greedy) < V
    assert len(set(sampled)) > 15  # a hot temperature: many symbols drawn, never a padding one
    assert all(torch.all(d[V:] == -math.inf) for d in dists)


# ---- resume under another tp ------------------------------------------------------------------------------------
def test_a_resumed_auto_run_keeps_its_checkpoints_padding(text8_shards, tmp_path):
    saved = load(config_file(tmp_path, tp=1, data=text8_shards)).model.to_dict()  # padded to 128 under tp 1
    cfg = load(config_file(tmp_path, tp=2, data=text8_shards))  # 256 under tp 2
    said = adopt_checkpoint_vocab(cfg, saved)
    assert (cfg.model.n_token, cfg.model.n_vocab) == (128, 27) and "128 rows for the 27 symbols" in said
    assert cfg.model.to_dict() == saved
    fresh = lambda: load(config_file(tmp_path, tp=2, data=text8_shards))  # noqa: E731
    for other in (
        {**saved, "n_vocab": 26},  # another vocabulary
        {**saved, "d_model": 32},  # another model
        {**saved, "n_token": 129, "n_vocab": 27},
    ):  # rows that do not split over tp 2
        cfg = fresh()
        assert adopt_checkpoint_vocab(cfg, other) is None and cfg.model.n_token == 256, other
    cfg = load(config_file(tmp_path, tp=2, data=text8_shards))
    assert adopt_checkpoint_vocab(cfg, dataclasses.replace(cfg.model).to_dict()) is None  # the same: nothing to do


# ---- a whole run: train under TP 2, convert, evaluate, generate, resume under TP 1 -------------------------------
RUN = """
model: {variant: lamemo, n_token: auto, n_layer: 2, d_model: 32, n_head: 2, d_head: 16, d_inner: 64,
        dropout: 0.0, tgt_len: 8, mem_len: 8}
data: {batch_size: 4}
optim: {lr: 2.0e-3}
train: {max_steps: 4}
checkpoint: {save_every: 2, keep_last: 10}
log: {every: 1, tensorboard: false}
"""


@pytest.mark.multiproc
@pytest.mark.numerics
def test_an_auto_run_converts_evaluates_generates_and_resumes_under_another_tp(text8_shards, tmp_path):
    import json

    import yaml
    from helpers.eval_fixtures import reference_nll
    from test_train_runs import logs, losses, run

    from megamemo.commands import convert
    from megamemo.commands import eval as eval_cmd
    from megamemo.commands import generate as generate_cmd
    from megamemo.data import read_split
    from megamemo.interop import load

    cfg_file = tmp_path / "t8.yaml"
    cfg_file.write_text(RUN)
    run_dir = tmp_path / "run"
    run(2, cfg_file, text8_shards, run_dir, "--tp", "2", timeout=300)
    model_cfg = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]
    assert (model_cfg["n_token"], model_cfg["n_vocab"]) == (256, 27)  # 27 characters, 128 x 2 rows

    # converted to one checkpoint: the padded tables whole, the padding masked
    single = tmp_path / "single"
    assert convert.main(["to-single", "--ckpt", str(run_dir), "--out", str(single)]) == 0
    doc = json.loads((single / "config.json").read_text())
    assert (doc["model"]["n_token"], doc["model"]["n_vocab"]) == (256, 27)
    padded, _ = load.load_model(single)

    # eval: the converted model's test-split NLL is that of its unpadded restatement (its first 27 rows), by the
    # evaluation's spec written out
    out = tmp_path / "eval.json"
    assert (
        eval_cmd.main(
            [
                "--ckpt",
                str(single),
                "--data",
                str(text8_shards),
                "--split",
                "test",
                "--batch-size",
                "2",
                "--max-segments",
                "6",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    got = json.loads(out.read_text())
    unpadded = MemTransformerLM(ModelConfig(**{**doc["model"], "n_token": 27, "n_vocab": None})).eval()
    unpadded.load_state_dict({k: (v[:27] if k.startswith(VOCAB_KEYS) else v) for k, v in padded.state_dict().items()})
    want, tokens = reference_nll(unpadded, read_split(text8_shards, "test"), 2, 8, max_segments=6)
    # the output layer's d_model + 27 terms in two orders, relative to the (positive) mean NLL
    rel = sum_bound(doc["model"]["d_model"] + 27, 1.0)
    assert got["tokens"] == tokens and got["nll"] == pytest.approx(want, rel=rel, abs=0), (got, want, rel)

    # generate: only the 27 characters, at a hot temperature (the CLI decodes them with the data's vocabulary)
    (tmp_path / "prompt").write_text("the quick brown fox ")
    gen = tmp_path / "gen.json"
    assert (
        generate_cmd.main(
            [
                "--ckpt",
                str(single),
                "--prompt-file",
                str(tmp_path / "prompt"),
                "--max-new-tokens",
                "200",
                "--temperature",
                "3.0",
                "--top-p",
                "1.0",
                "--json",
                str(gen),
                "--out",
                str(tmp_path / "gen.txt"),
            ]
        )
        == 0
    )
    new = json.loads(gen.read_text())["new_ids"]
    assert len(new) == 200 and max(new) < 27 and len(set(new)) > 15

    # resumed in place by one process (tp 1 would pad to 128): the checkpoint's 256 rows are kept
    run(1, cfg_file, text8_shards, run_dir, "--max-steps", "6", timeout=300)
    text = logs(run_dir)
    assert "model.n_token: auto keeps the checkpoint's 256 rows for the 27 symbols" in text and "resumed from" in text
    assert sorted(losses(run_dir)) == list(range(1, 7))

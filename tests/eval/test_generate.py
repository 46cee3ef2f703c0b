"""`megamemo generate`: seeded sampling is reproducible, the first token is drawn from the model's next-token
distribution for the prompt, and carrying memory gives what re-encoding the whole context gives (XL)."""

import json

import pytest
import torch
from helpers.bounds import forward_bound, unit_roundoff
from helpers.eval_fixtures import one_thread, tiny_checkpoint, word_shards  # noqa: F401 (one_thread: autouse fixture)

from megamemo import cli
from megamemo.commands import generate as generate_cmd
from megamemo.interop.vocabulary import encode_prompt
from megamemo.model import generation as gen_mod
from megamemo.model.generation import Decoder, generate, nucleus_probs

pytestmark = pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)

PROMPT = b"<page>\n  <title>Anarchism</title>\n  <id>12</id>\n  <revision>\n"


@pytest.mark.parametrize("variant", ["lamemo", "xl", "rpe"])
def test_first_token_distribution_is_the_models_next_token_distribution(tmp_path, variant):
    _, model = tiny_checkpoint(tmp_path / "ck", variant)
    ids = list(PROMPT)
    c = model.cfg
    mem_len = c.mem_len + c.tgt_len - 1
    # the model's own forward over the prompt in training-length segments, memory carried
    mem, last = None, None
    with torch.no_grad():
        if c.has_memory:
            for i in range(0, len(ids), c.tgt_len):
                chunk = torch.tensor(ids[i : i + c.tgt_len])[:, None]
                lp, mem = model(chunk, None, mem, mem_len=mem_len)
                last = lp[-1, 0]
        else:
            lp, _ = model(torch.tensor(ids[-c.tgt_len :])[:, None])
            last = lp[-1, 0]
    new, dists = generate(model, ids, 3, top_p=1.0, seed=0, return_logprobs=True)
    # generate() and the Decoder cut the prompt into other segments than the loop above: the same sums in other
    # shapes, so other orders. fp32, two orders of the forward pass's reductions (tests/helpers/bounds.py): at max|log
    # p|
    tol = forward_bound(c, float(last.abs().max()), klen=mem_len + c.tgt_len)
    assert torch.allclose(dists[0], last, atol=tol, rtol=0), (float((dists[0] - last).abs().max()), tol)
    assert torch.allclose(Decoder(model).feed(ids), last, atol=tol, rtol=0)
    # and the sampler draws from exactly that distribution when top_p = 1: probabilities <= 1 from one exp and a
    # normaliser of n_token terms each, so within 2 u + n_token u of exp(last), plus exp's gain on the log-probs' tol
    tol_p = tol + (2 + c.n_token) * unit_roundoff()
    assert torch.allclose(nucleus_probs(dists[0]), last.exp(), atol=tol_p, rtol=0)


def test_fixed_seed_is_reproducible(tmp_path):
    _, model = tiny_checkpoint(tmp_path / "ck", "lamemo")
    a = generate(model, list(PROMPT), 40, top_p=0.95, seed=7)
    b = generate(model, list(PROMPT), 40, top_p=0.95, seed=7)
    c = generate(model, list(PROMPT), 40, top_p=0.95, seed=8)
    assert a == b and len(a) == 40
    assert a != c


def test_xl_carried_memory_equals_reencoding_the_whole_context(tmp_path):
    """With memory at least as long as the text, one-token segments with carried memory give the same next-token
    distributions as one forward pass over prompt + generated tokens."""
    _, model = tiny_checkpoint(tmp_path / "ck", "xl")
    ids = list(PROMPT)
    new, dists = generate(model, ids, 25, top_p=0.9, seed=3, mem_len=200, return_logprobs=True)
    full = torch.tensor(ids + new[:-1])[:, None]
    with torch.no_grad():
        lp, _ = model(full, None, None, mem_len=0)
    # one-token segments against one pass: other shapes, so other orders of the same sums; fp32, two orders of a
    # forward pass over up to 200 keys (tests/helpers/bounds.py), at the log-probabilities' size
    for k, d in enumerate(dists):
        want = lp[len(ids) - 1 + k, 0]
        tol = forward_bound(model.cfg, float(want.abs().max()), klen=200 + 1)
        assert torch.allclose(d, want, atol=tol, rtol=0), (k, float((d - want).abs().max()), tol)


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    lp = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
    # allclose's default rtol 1e-5 (fp32): a log, a division by the temperature, an exp and a 4-term normaliser
    # each round once, on log-probabilities up to |lp / T| = 4.2: about (3 + 4 + 4.2) u = 6.7e-7, well inside
    assert torch.allclose(nucleus_probs(lp, 0.75), torch.tensor([2 / 3, 1 / 3, 0, 0]))
    assert torch.allclose(nucleus_probs(lp, 0.76), torch.tensor([0.5, 0.25, 0.125, 0]) / 0.875)
    assert torch.allclose(nucleus_probs(lp, 0.1), torch.tensor([1.0, 0, 0, 0]))
    assert torch.allclose(nucleus_probs(lp, 1.0, temperature=0.5), torch.tensor([16, 4, 1, 1]) / 22.0)
    g = torch.Generator().manual_seed(0)
    probs = nucleus_probs(lp, 0.76)
    draws = torch.bincount(torch.tensor([gen_mod.sample(probs, g) for _ in range(20000)]), minlength=4)
    # sampling noise, not rounding: the frequency of a probability-p outcome in 20000 draws has standard deviation
    # sqrt(p (1 - p) / 20000) <= 0.0036; 0.015 is 4 of them (and the seeded draws are the same on any CPU)
    assert torch.allclose(draws / 20000.0, probs, atol=0.015, rtol=0)
    with pytest.raises(ValueError, match="top_p"):
        nucleus_probs(lp, 0.0)


def test_cli_uses_the_checkpoint_vocabulary_and_is_reproducible(tmp_path, capsys):
    symbols = [str(b) for b in range(256)]
    ckpt, _ = tiny_checkpoint(tmp_path / "ck", "lamemo", meta={"vocab": {"kind": "bytes", "symbols": symbols}})
    (tmp_path / "prompt.txt").write_bytes(PROMPT)
    outs = []
    for k in range(2):
        js = tmp_path / f"g{k}.json"
        assert (
            generate_cmd.main(
                [
                    "--ckpt",
                    str(ckpt),
                    "--prompt-file",
                    str(tmp_path / "prompt.txt"),
                    "--max-new-tokens",
                    "30",
                    "--top-p",
                    "0.95",
                    "--seed",
                    "5",
                    "--json",
                    str(js),
                ]
            )
            == 0
        )
        outs.append(json.loads(js.read_text()))
        printed = capsys.readouterr().out
        assert printed.rstrip("\n") == outs[-1]["text"].rstrip("\n")
    assert outs[0] == outs[1] and len(outs[0]["new_ids"]) == 30
    assert outs[0]["prompt_ids"] == list(PROMPT)
    assert outs[0]["text"] == bytes(outs[0]["new_ids"]).decode("utf-8", errors="replace")


def test_word_vocabulary_from_the_shards_and_errors(tmp_path, capsys):
    data = word_shards(tmp_path / "words")
    from megamemo.data import load_vocab

    v = load_vocab(data)
    assert encode_prompt(v, b"w1 w2\nw3 zzz\nw4", "p") == [
        v.sym2idx["w1"],
        v.sym2idx["w2"],
        0,
        v.sym2idx["w3"],
        v.unk_id,
        0,
        v.sym2idx["w4"],
    ]
    ckpt, _ = tiny_checkpoint(tmp_path / "ck", "xl", n_token=50)
    (tmp_path / "p.txt").write_text("w1 w2 w3\n")
    assert (
        generate_cmd.main(
            [
                "--ckpt",
                str(ckpt),
                "--prompt-file",
                str(tmp_path / "p.txt"),
                "--max-new-tokens",
                "5",
                "--data",
                str(data),
            ]
        )
        == 0
    )
    assert len(capsys.readouterr().out.split()) >= 1
    assert (
        cli.run_command("generate", generate_cmd.main, ["--ckpt", str(ckpt), "--prompt-file", str(tmp_path / "p.txt")])
        == 2
    )
    assert "--data" in capsys.readouterr().err

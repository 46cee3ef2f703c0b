"""`megamemo convert import-reference`: thu-coai/LaMemo and kimiyoung/transformer-xl weights become a megamemo
single-device checkpoint whose per-token NLL over 4 segments with memory carried equals the reference code's own
(tests/fixtures/reference, 1e-5); a bare state_dict needs --config; bad inputs write nothing."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.bounds import forward_bound
from helpers.fixture_data import reference_file

from megamemo import cli
from megamemo.checkpoint.single import load_single
from megamemo.commands import convert


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
@pytest.mark.parametrize("name", ["lamemo_at3_tgt8_mem8", "txl_tgt8_mem8"])
def test_imported_reference_reproduces_the_reference_nll(name, tmp_path):
    src = reference_file(name)
    out = tmp_path / "single"
    assert convert.main(["import-reference", str(src), "--out", str(out)]) == 0
    g = torch.load(src, weights_only=True)
    model, meta = load_single(out)
    assert meta["imported_from"].startswith(g["reference"].split("@")[0])
    mem = None
    with torch.no_grad():
        for k, (x, y, want) in enumerate(zip(g["inputs"], g["targets"], g["nll"], strict=True)):
            nll, mem = model(x, y, mem)
            # the reference's own fp32 run, other kernels: two orders of the forward pass's sums, once per segment
            # the memory carried (tests/helpers/bounds.py, as tests/model/test_model_reference.py)
            tol = (k + 1) * forward_bound(model.cfg, float(want.abs().max()))
            assert torch.allclose(nll, want, atol=tol, rtol=0), float((nll - want).abs().max())
    assert mem.length == g["config"]["mem_len"]


@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
def test_bare_state_dict_needs_its_constructor_config(tmp_path, capsys):
    g = torch.load(reference_file("txl_tgt8_mem8"), weights_only=True)
    torch.save(g["state_dict"], tmp_path / "sd.pt")
    (tmp_path / "cfg.json").write_text(json.dumps(g["config"]))
    out = tmp_path / "single"
    assert (
        cli.run_command("convert", convert.main, ["import-reference", str(tmp_path / "sd.pt"), "--out", str(out)]) == 2
    )
    assert "no constructor config" in capsys.readouterr().err and not out.exists()
    assert (
        convert.main(
            ["import-reference", str(tmp_path / "sd.pt"), "--out", str(out), "--config", str(tmp_path / "cfg.json")]
        )
        == 0
    )
    model, _ = load_single(out)
    with torch.no_grad():
        nll, _ = model(g["inputs"][0], g["targets"][0])
    assert torch.allclose(nll, g["nll"][0], atol=forward_bound(model.cfg, float(g["nll"][0].abs().max())), rtol=0)


def test_wrong_reference_weights_are_refused(tmp_path, capsys):
    g = torch.load(reference_file("lamemo_at3_tgt8_mem8"), weights_only=True)
    bad = dict(g, state_dict=dict(g["state_dict"], **{"layers.0.dec_attn.extra.weight": torch.zeros(2)}))
    torch.save(bad, tmp_path / "extra.pt")
    out = tmp_path / "single"
    assert (
        cli.run_command("convert", convert.main, ["import-reference", str(tmp_path / "extra.pt"), "--out", str(out)])
        == 2
    )
    assert "layers.0.dec_attn.extra.weight" in capsys.readouterr().err and not out.exists()
    # weights that load but compute something else: the file's own reference NLL catches them
    sd = dict(g["state_dict"])
    sd["layers.1.dec_attn.o_net.weight"] = sd["layers.1.dec_attn.o_net.weight"] * 1.5
    torch.save(dict(g, state_dict=sd), tmp_path / "off.pt")
    assert (
        cli.run_command("convert", convert.main, ["import-reference", str(tmp_path / "off.pt"), "--out", str(out)]) == 2
    )
    assert "differs from the file's reference NLL" in capsys.readouterr().err and not out.exists()

"""The typed records that cross between a run's parts (docs/architecture.md): RankLayout and RunLayout write the JSON
checkpoints always held and read markers of any version; Lengths fills what is None from the model, once."""

from __future__ import annotations

import json

from helpers.fixture_data import FIXTURES

from megamemo.checkpoint.layout import RankLayout, RunLayout, RunMeta
from megamemo.model import ModelConfig
from megamemo.model.lengths import Lengths

OLD = FIXTURES / "checkpoint_v3" / "checkpoints" / "step_00000004"  # written before these records existed


def test_the_records_write_what_the_old_code_wrote():
    layout = RankLayout(((0, 2), (2, 4)), batch_size=4, zero_stage=1)  # the fixture's run: 1 process, 2 x 2
    assert layout.record() == json.loads((OLD / "rank_00000.json").read_text())["layout"]
    assert layout.run.record() == json.loads((OLD / "COMMITTED").read_text())["layout"]
    assert RunMeta.from_record(json.loads((OLD / "COMMITTED").read_text())).layout == layout.run


def test_a_rank_of_a_grid_says_its_columns_and_whether_it_writes_the_probe():
    last_stage = RankLayout(((4, 6), (6, 8)), rank=7, world_size=8, dp_rank=1, dp=2, tp_rank=0, tp=2, pp_rank=1, pp=2)
    assert last_stage.columns == (4, 8) and last_stage.micro_batch == 2 and last_stage.grad_accum == 2
    assert not last_stage.writes_probe  # not DP rank 0
    assert RankLayout(((0, 2),), dp=2, tp=2, pp=2, pp_rank=1).writes_probe
    assert not RankLayout(((0, 2),), dp=2, tp=2, pp=2, pp_rank=0).writes_probe  # not the last stage
    assert not RankLayout(((0, 2),), dp=2, tp=2, tp_rank=1, pp=1).writes_probe  # not TP rank 0


def test_a_marker_of_an_older_version_reads_with_its_gaps_said():
    old = RunMeta.from_record({"model": {"n_layer": 2}, "layout": {"world_size": 2, "dp": 2, "batch_size": 4}})
    assert old.masks == "stream" and old.precision is None and old.layout.grad_accum is None
    assert old.layout.describe() == "tp=1 pp=1 dp=2 (2 ranks, grad_accum 1, batch 4, ZeRO None)"
    assert "dropout_masks" not in old.record() and old.record()["layout"] == {"world_size": 2, "dp": 2, "batch_size": 4}
    assert RunLayout.from_record(None) == RunLayout()


def test_lengths_take_the_models_value_where_none_is_given():
    cfg = ModelConfig(
        variant="xl",
        n_token=16,
        n_layer=1,
        d_model=8,
        n_head=2,
        d_head=4,
        d_inner=8,
        tgt_len=5,
        mem_len=7,
        clamp_len=9,
        same_length=True,
    )
    assert Lengths().resolve(cfg) == Lengths(5, 7, 9, True)
    assert Lengths(3, 0, 2, False).resolve(cfg) == Lengths(3, 0, 2, False)  # 0 and False are values, not None
    assert Lengths(mem=11).resolve(cfg).record() == {"tgt_len": 5, "mem_len": 11, "clamp_len": 9, "same_length": True}

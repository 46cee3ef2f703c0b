"""The replica check's record (checkpoint/replicas.py) reads and writes the JSON a rank file has always held."""

from __future__ import annotations

import json

from helpers.fixture_data import FIXTURES

from megamemo.checkpoint.replicas import RankFingerprints, ReplicaRecord


def test_an_old_rank_files_replicas_read_and_written_back_are_the_same_json():
    rank_file = FIXTURES / "checkpoint_v3" / "checkpoints" / "step_00000004" / "rank_00000.json"
    saved = json.loads(rank_file.read_text())["replicas"]  # written by the code before the record type
    rec = ReplicaRecord.from_record(saved)
    assert rec.step == 4 and rec.ranks[0][1].partitions == tuple(saved["ranks"]["0"]["partitions"])
    assert rec.record() == saved


def test_zero0_fingerprints_keep_state_and_ranks_are_keyed_as_strings():
    saved = {
        "step": 7,
        "agreed": True,
        "seconds": 0.25,
        "ranks": {"10": {"node": "b", "scalars": 3, "state": 9}, "2": {"node": "a", "scalars": 3, "state": 9}},
    }
    rec = ReplicaRecord.from_record(saved)
    assert [r for r, _ in rec.ranks] == [2, 10]  # by rank, not by the keys' text order
    assert rec.ranks[1][1] == RankFingerprints("b", 3, None, 9)
    assert rec.record() == saved

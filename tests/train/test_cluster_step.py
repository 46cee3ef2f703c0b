"""The cluster step (issue 46): bf16 on ZeRO 1 at grad_accum 1 reduces its gradients through DeepSpeed's ZeRO
optimizer - in bf16, bucket by bucket, overlapped with the backward pass where parallel.overlap_comm asks - not its
BF16_Optimizer's all-reduce after the backward (megamemo/parallel/zero.py); the planner prices the reduction in the
dtype DeepSpeed really puts on the wire, read here from DeepSpeed itself; two data-parallel gloo ranks with these
settings train as one process does."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.fixture_data import REPO
from helpers.runs_cache import KEYED, logs
from test_train_runs import losses, run

from megamemo.model import MemTransformerLM
from megamemo.train.config import load

BF16_OVERLAP = ["precision.dtype=bf16", "parallel.zero_stage=1", "parallel.overlap_comm=true"]
# (sets, DeepSpeed's optimizer) for the tiny config on one rank
CASES = [
    (BF16_OVERLAP + ["parallel.reduce_bucket_size=4096"], "DeepSpeedZeroOptimizer"),
    (["precision.dtype=bf16", "parallel.zero_stage=1", "train.grad_accum=2"], "BF16_Optimizer"),
    (["precision.dtype=bf16", "parallel.zero_stage=2"], "DeepSpeedZeroOptimizer"),
    (["parallel.zero_stage=1"], "DeepSpeedZeroOptimizer"),
]


def sections(cfg) -> tuple:
    """What megamemo/parallel/zero.py reads of a run config: its parallel and precision sections, train.grad_accum."""
    return cfg.parallel, cfg.precision, cfg.train.grad_accum


def test_the_shipped_large_configs_overlap_in_buckets_of_5e7():
    from megamemo.parallel.zero import bf16_optimizer, overlaps_reduction, reduce_bucket
    from megamemo.train.engine import ds_config

    for name, sets in (("lamemo-7b", []), ("lamemo-1.3b", ["precision.dtype=bf16"]), ("lamemo-1.3b", [])):
        cfg = load(REPO / "configs" / f"{name}.yaml", sets, vocab_fallback=32000)  # n_token auto: no data here
        assert overlaps_reduction(*sections(cfg)) and reduce_bucket(*sections(cfg)) == 50_000_000, name
        assert not bf16_optimizer(*sections(cfg)), name
        ds = ds_config(cfg, 8, 8)
        assert ds["zero_optimization"] == {"stage": 1, "overlap_comm": True, "reduce_bucket_size": 50_000_000}
        if cfg.precision.dtype == "bf16":  # one micro-batch a step: nothing to accumulate in fp32
            assert "data_types" not in ds, ds


def _reduce_worker(rank, world):
    import deepspeed

    from megamemo.parallel.zero import bf16_optimizer, overlaps_reduction, reduce_dtype
    from megamemo.train.engine import Engine

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    seen, real = [], torch.distributed.all_reduce

    def record(tensor, *args, **kwargs):
        seen.append((tensor.dtype, tensor.numel()))
        return real(tensor, *args, **kwargs)

    torch.distributed.all_reduce = record
    try:
        for sets, cls in CASES:
            cfg = load(REPO / "configs/tiny-cpu.yaml", ["model.n_layer=1", "model.dropout=0.0", *sets])
            eng = Engine(cfg, MemTransformerLM(cfg.model), 2, 1)
            opt = eng.ds.optimizer
            assert type(opt).__name__ == cls, (sets, opt)
            assert (cls == "BF16_Optimizer") == bf16_optimizer(*sections(cfg)), (sets, opt)
            assert getattr(opt, "overlap_comm", False) == overlaps_reduction(*sections(cfg)), sets
            data = torch.randint(0, 256, (33, 2))
            seen.clear()
            for _k in range(cfg.train.grad_accum):
                nll, _ = eng.forward(data[:32], data[1:], None)
                eng.backward(nll.float().mean())
                eng.micro_step()
            grads = [d for d, n in seen if n > 1000]  # the gradient buckets, not the overflow flags
            want = {"bf16": torch.bfloat16, "fp32": torch.float32}[reduce_dtype(cfg.precision)]
            assert grads and set(grads) == {want}, (sets, seen)
    finally:
        torch.distributed.all_reduce = real


def test_deepspeed_reduces_in_the_dtype_the_planner_prices():
    """Each optimizer DeepSpeed 0.19.8 builds for these settings, and the dtype of every gradient all-reduce it
    makes in a step (recorded at torch.distributed.all_reduce): what parallel/zero.py says - bf16 at grad_accum 1 is
    the ZeRO optimizer, overlapping; BF16_Optimizer's fp32 gradients go on the wire in bf16 too."""
    run_distributed(_reduce_worker, 1)


@pytest.mark.multiproc  # starts training processes
def test_two_gloo_ranks_reducing_bf16_overlapped_equal_one_process(tiny_cfg, shards, tmp_path):
    """bf16, ZeRO 1, grad_accum 1, overlap_comm in buckets of 4,096 elements (the model's 27,424 parameters in
    several): two ranks of 2 streams against one process of 4, keyed dropout. Per step within 0.005 nats, the bf16
    bound of tests/train/test_train_equivalence.py (the runs differ by bf16 roundings of the gradient: the two halves
    summed in bf16 on the wire against one bf16 backward of the whole batch). The start-up lines say both ran the
    ZeRO optimizer overlapped (Engine.reduction)."""
    args = [
        *KEYED,
        "--max-steps",
        "6",
        "--save-every",
        "0",
        "--set",
        "checkpoint.probe=false",
        "--set",
        "checkpoint.save_at_end=false",
        "--set",
        "log.tensorboard=false",
        *(a for s in [*BF16_OVERLAP, "parallel.reduce_bucket_size=4096"] for a in ("--set", s)),
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    run(1, tiny_cfg, shards, one, *args)
    run(2, tiny_cfg, shards, two, *args)
    for d in (one, two):
        assert "ZeRO 1 (overlapped with the backward, buckets of 4,096) |" in logs(d), logs(d)[-2000:]
    want, got = losses(one), losses(two)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    assert max(abs(got[s] - want[s]) for s in want) <= 0.005, (got, want)
    assert want[6] < want[1] - 0.05  # it trained: a comparison of moving numbers

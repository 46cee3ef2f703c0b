"""The GPU path's logic, checked on the CPU: the device decision (a GPU job without a usable GPU stops with one
line), the GPU index from what a task sees, dropout streams unique over the TP x DP x PP grid, tensors that cross
ranks made on the communication device, meta read once per stage, the TP grad norm on the gradients' device,
TP layers built on the CPU even where torch sees CUDA, and DeepSpeed's fp32 gradient accumulation.

"The communication device" cannot be told from the CPU on a CPU-only machine, so those tests run with torch's
default device set to `meta`: a tensor made without naming its device lands on `meta` (and breaks the run or shows
up in the recorded p2p traffic), exactly as it would land on the CPU beside a CUDA run."""

from __future__ import annotations

import importlib
import itertools
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers.bounds import forward_bound, sum_bound
from helpers.distributed import run_distributed
from helpers.fixture_data import REPO

from megamemo.config.run import ConfigError
from megamemo.model import MemTransformerLM, ModelConfig
from megamemo.runtime import device
from megamemo.runtime.dist import discover, slurm_tasks_on_node
from megamemo.train.config import load

TINY = [
    "model.variant=lamemo",
    "model.n_token=40",
    "model.n_layer=4",
    "model.d_model=16",
    "model.n_head=2",
    "model.d_head=8",
    "model.d_inner=32",
    "model.dropout=0.0",
    "model.tgt_len=6",
    "model.mem_len=6",
    "model.init_std=0.1",
]


# ---- which device --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "env, want",
    [
        ({}, "auto"),
        ({"MEGAMEMO_DEVICE": "gpu"}, "gpu"),
        ({"MEGAMEMO_DEVICE": "cuda"}, "gpu"),
        ({"MEGAMEMO_DEVICE": "cpu"}, "cpu"),
        ({"DS_ACCELERATOR": "cpu"}, "cpu"),
        ({"DS_ACCELERATOR": "cuda"}, "gpu"),
        ({"MEGAMEMO_DEVICE": "gpu", "DS_ACCELERATOR": "cuda"}, "gpu"),
    ],
)
def test_requested_device_from_the_environment(env, want):
    assert device.requested(env) == want


@pytest.mark.parametrize(
    "env, match",
    [
        ({"MEGAMEMO_DEVICE": "gpu", "DS_ACCELERATOR": "cpu"}, "MEGAMEMO_DEVICE=gpu contradicts DS_ACCELERATOR=cpu"),
        ({"MEGAMEMO_DEVICE": "tpu"}, "MEGAMEMO_DEVICE must be auto, gpu or cpu"),
        ({"DS_ACCELERATOR": "xpu"}, "DS_ACCELERATOR=xpu"),
    ],
)
def test_contradictory_or_unknown_device_wishes_are_named(env, match):
    with pytest.raises(device.DeviceError, match=match):
        device.requested(env)


def test_device_choice():
    why = "torch 2.x sees no CUDA device (driver too old)"
    assert device.choose("auto", 2, 2, "") == "cuda"
    assert device.choose("auto", 0, 0, why) == "cpu"  # a CPU machine
    assert device.choose("cpu", 8, 8, "") == "cpu"  # asked for
    with pytest.raises(device.DeviceError, match=r"this node has 8 NVIDIA GPU\(s\) but torch 2.x sees no CUDA"):
        device.choose("auto", 0, 8, why)  # a GPU node whose GPUs torch cannot use
    with pytest.raises(device.DeviceError, match="a GPU was asked for .* MEGAMEMO_DEVICE=cpu"):
        device.choose("gpu", 0, 0, why)


def test_resolve_stops_on_a_gpu_node_that_torch_cannot_use(monkeypatch):
    monkeypatch.setattr(device, "node_gpus", lambda: 4)  # /proc/driver/nvidia/gpus lists 4 GPUs
    env = {}
    with pytest.raises(device.DeviceError, match="4 NVIDIA GPU.*CPU-only build"):
        device.resolve(env)
    assert "DS_ACCELERATOR" not in env
    env = {"MEGAMEMO_DEVICE": "cpu"}
    assert device.resolve(env) == "cpu" and env["DS_ACCELERATOR"] == "cpu"


@pytest.mark.parametrize("env", [{"MEGAMEMO_DEVICE": "gpu"}, {"DS_ACCELERATOR": "cuda"}])
def test_train_with_a_gpu_asked_for_and_no_cuda_fails_in_one_line(env, tmp_path):
    """The real command on this CPU-only torch: exit 2, one line saying why, before any process group."""
    run_env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "MEGAMEMO_DEVICE")}
    run_env.update(env, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megamemo",
            "train",
            "--config",
            str(REPO / "configs/tiny-cpu.yaml"),
            "--data",
            str(tmp_path),
            "--set",
            "data.dir=" + str(tmp_path),
        ],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in r.stderr.splitlines() if line.startswith("megamemo train: error:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert "a GPU was asked for" in lines[0] and "CPU-only build" in lines[0]


def test_cuda_device_index_from_what_the_task_sees():
    assert device.pick_cuda_device(5, 8, 1) == 0  # --gpus-per-task=1: its own GPU is cuda:0
    assert device.pick_cuda_device(5, 8, 8) == 5  # every task sees the node's 8 GPUs
    assert device.pick_cuda_device(3, None, 8) == 3
    assert device.pick_cuda_device(1, 2, 8) == 1  # 2 tasks on an 8-GPU node
    with pytest.raises(device.DeviceError, match="8 tasks on this node but this task sees 4 CUDA devices"):
        device.pick_cuda_device(0, 8, 4)
    with pytest.raises(device.DeviceError, match="local rank 3 but this task sees 2"):
        device.pick_cuda_device(3, None, 2)


def test_init_binds_the_gpu_the_task_sees_and_tells_deepspeed(monkeypatch):
    """The call site of the visible-device choice (runtime/dist.py init), not only pick_cuda_device: a task bound to
    one GPU (--gpus-per-task=1) with local rank 5 of 8 sets cuda:0, exports LOCAL_RANK=0 for DeepSpeed and starts
    NCCL. torch.cuda and DeepSpeed's init are stand-ins recording what they are asked (no GPU here)."""
    import deepspeed

    from megamemo.runtime import dist as mdist

    calls = {}
    monkeypatch.setattr(device, "resolve", lambda env=None: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.setdefault("set_device", i))
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: calls.setdefault("init", kw))
    for k, v in {
        "RANK": "13",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "5",
        "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29999",
    }.items():
        monkeypatch.setenv(k, v)
    de = mdist.init()
    assert (de.rank, de.local_rank) == (13, 5)
    assert calls["set_device"] == 0 and os.environ["LOCAL_RANK"] == "0"
    assert calls["init"]["dist_backend"] == "nccl" and calls["init"]["rank"] == 13


def test_grad_norm_of_a_rank_without_gradients_joins_on_the_communication_device(monkeypatch):
    """A rank holding no gradient still takes part in the TP all-reduce, with a tensor on the communication
    device (its explicit torch.device("cpu") would break NCCL); the accelerator is made to say "meta" here so a
    CPU tensor shows."""
    from deepspeed.accelerator import get_accelerator

    from megamemo.parallel import groups

    seen = []
    monkeypatch.setattr(type(get_accelerator()), "current_device_name", lambda self: "meta")
    monkeypatch.setattr(groups, "tp_rank_size", lambda: (1, 2))
    monkeypatch.setattr(groups, "_mcore", lambda: (SimpleNamespace(get_tensor_model_parallel_group=lambda: None), None))
    monkeypatch.setattr(groups.dist, "all_reduce", lambda t, **kw: seen.append(t.device))
    with pytest.raises(RuntimeError, match="meta"):
        groups.grad_norm([torch.nn.Parameter(torch.ones(2))])  # the final host read of a meta tensor, after it
    assert seen == [torch.device("meta")], seen


def test_tasks_per_node_from_the_launchers():
    assert slurm_tasks_on_node({"SLURM_STEP_TASKS_PER_NODE": "8(x2),4", "SLURM_NODEID": "2"}) == 4
    assert slurm_tasks_on_node({"SLURM_TASKS_PER_NODE": "8(x2),4", "SLURM_NODEID": "1"}) == 8
    assert slurm_tasks_on_node({}) is None
    env = {
        "SLURM_PROCID": "9",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "a[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
        "SLURM_NODEID": "1",
    }
    assert discover(env).local_world == 8
    assert discover({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}).local_world == 2


def test_deterministic_switch_sets_torch_and_the_environment():
    code = (
        "import os, torch\nfrom megamemo.runtime import device\nadded = device.make_deterministic()\n"
        "print(sorted(added), torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,"
        " torch.backends.cudnn.benchmark, os.environ['NCCL_ALGO'], os.environ['CUBLAS_WORKSPACE_CONFIG'])"
    )
    env = {k: v for k, v in os.environ.items() if k not in device.DETERMINISTIC_ENV}
    out = subprocess.run(
        [sys.executable, "-c", code], env=dict(env, NCCL_ALGO="Tree"), capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split() == [
        "['CUBLAS_WORKSPACE_CONFIG',",
        "'NCCL_NVLS_ENABLE']",
        "True",
        "True",
        "False",
        "Tree",
        ":4096:8",
    ], out.stderr  # a user's own NCCL_ALGO is kept


# ---- dropout streams -----------------------------------------------------------------------------------------
def test_dropout_seeds_are_unique_over_the_tp_dp_pp_grid():
    from megamemo.parallel.groups import dropout_seeds

    grid = list(itertools.product(range(8), range(4), range(4), (0, 1, 5000)))  # dp, tp, pp, salt
    seeds = {(d, t, p, s): dropout_seeds(1111, d, t, p, s) for d, t, p, s in grid}
    tp_seeds = [v[1] for v in seeds.values()]
    assert len(set(tp_seeds)) == len(tp_seeds)  # one TP stream per rank and salt
    default = {(d, p, s): {seeds[d, t, p, s][0] for t in range(4)} for d, t, p, s in grid}
    assert all(len(v) == 1 for v in default.values())  # the TP ranks of a group share it
    default_seeds = [next(iter(v)) for v in default.values()]
    assert len(set(default_seeds)) == len(default_seeds)  # one per (dp, pp) group and salt
    assert not set(default_seeds) & set(tp_seeds)  # no TP stream is anyone's default one
    assert dropout_seeds(1111, 0, 0, 0) == (1112, 1113)


def test_fresh_start_and_resume_seed_alike_and_uniquely_over_the_grid(monkeypatch):
    """Both paths that seed dropout - a fresh start (train/build.py) and a resume under another layout
    (Trainer._reseed) - go through train.loop.seed_streams, on one process for every rank of a dp x tp x pp grid:
    the default stream is shared by exactly the TP ranks of a (dp, pp) group, every TP stream is its rank's own,
    and a resume's streams are none of the fresh start's (megatron's seed + 2718 + tp_rank, which _reseed used,
    gave (dp 0, tp 1) and (dp 1, tp 0) one stream and every stage the same default one)."""
    from megamemo.checkpoint.layout import RankLayout
    from megamemo.parallel import groups
    from megamemo.train import loop

    installed = []
    monkeypatch.setattr(groups, "install_tp_stream", lambda seed, cuda=None: installed.append(seed))
    cfg = load(REPO / "configs/tiny-cpu.yaml", ["parallel.tp=2", "parallel.pp=2"])
    seeds = {}
    for d, t, p in itertools.product(range(3), range(3), range(3)):
        ranks = RankLayout(((0, 1),), dp_rank=d, tp_rank=t, pp_rank=p)
        stub = SimpleNamespace(cfg=cfg, layout=ranks, engine=SimpleNamespace(device=torch.device("cpu")))
        for path, step in (("fresh", None), ("resume", 40)):
            installed.clear()
            got = loop.seed_streams(cfg, ranks, "cpu") if step is None else loop.Trainer._reseed(stub, step)
            assert torch.initial_seed() == got[0] and installed == [got[1]], (path, ranks)  # what was seeded
            seeds[path, d, t, p] = got
    for path in ("fresh", "resume"):
        default = {
            (d, p): {seeds[path, d, t, p][0] for t in range(3)} for d, _, p in itertools.product(*[range(3)] * 3)
        }
        assert all(len(v) == 1 for v in default.values())
        assert len({next(iter(v)) for v in default.values()}) == 9  # one per (dp, pp) group
    tp_seeds = [v[1] for v in seeds.values()]
    assert len(set(tp_seeds)) == len(tp_seeds)  # every rank, both paths
    defaults = {v[0] for v in seeds.values()}
    assert len(defaults) == 18 and not defaults & set(tp_seeds)


# ---- two gloo ranks, tensor parallel --------------------------------------------------------------------------
def _tp_worker(rank, world):
    from megamemo.parallel import groups
    from megamemo.parallel.groups import TP_RNG, dropout_seeds, grad_norm, init_model_parallel, seed_rng_streams
    from megamemo.parallel.pipeline import LayerPipe, StageContext
    from megamemo.parallel.shard_init import init_shard
    from megamemo.parallel.tensor import parallelize_tensor

    init_model_parallel(tp=world)
    cfg = load(None, TINY).model

    # the trainer's seeding: default stream from (dp, pp), TP stream from (dp, pp, tp)
    default, tp_seed = seed_rng_streams(7, 0, rank, 0, cuda=False)
    assert (default, tp_seed) == dropout_seeds(7, 0, rank, 0)
    assert torch.equal(torch.get_rng_state(), torch.Generator().manual_seed(default).get_state())
    assert torch.equal(groups.rng_tracker().get_states()[TP_RNG], torch.Generator().manual_seed(tp_seed).get_state())
    both = [None] * world
    dist.all_gather_object(both, (default, tp_seed))
    assert both[0][0] == both[1][0] and both[0][1] != both[1][1]

    # megatron's layers are made on the CPU even where torch sees CUDA, so a shard can be initialised directly
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        layer = LayerPipe(cfg, StageContext(cfg, world, rank), 0)
    finally:
        torch.cuda.is_available = real
    init_shard(layer, cfg, seed=3, single_name=lambda n: n.replace("layer.", "layers.0.", 1))
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in layer.parameters())

    # grad norm: squares summed where the gradients are, the TP all-reduce there too
    torch.manual_seed(0)
    model = parallelize_tensor(MemTransformerLM(cfg))
    x = torch.randint(0, 40, (7, 2), generator=torch.Generator().manual_seed(1))
    model(x[:-1], x[1:])[0].mean().backward()
    grads = [
        (p.grad.double().pow(2).sum(), getattr(p, "tensor_model_parallel", False))
        for p in model.parameters()
        if p.grad is not None
    ]
    split, repl = sum(sq for sq, s in grads if s), sum(sq for sq, s in grads if not s)
    parts = [torch.zeros((), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(parts, split.reshape(()))
    want = float((sum(parts) + repl).sqrt())
    reduced = []
    real_all_reduce = groups.dist.all_reduce
    groups.dist.all_reduce = lambda t, **kw: (reduced.append(t.device), real_all_reduce(t, **kw))[1]
    torch.set_default_device("meta")
    try:
        got = grad_norm(model.parameters())
    finally:
        torch.set_default_device(None)
        groups.dist.all_reduce = real_all_reduce
    # fp64 squares of the same fp32 gradients summed in another order (and a sqrt): 2 N u64 relative, N elements
    rel = sum_bound(sum(p.grad.numel() for p in model.parameters() if p.grad is not None), 1.0, torch.float64)
    assert reduced == [torch.device("cpu")] and abs(got - want) <= rel * want, (reduced, got, want, rel)


@pytest.mark.multiproc
@pytest.mark.numerics  # run again at another instruction set (scripts/test_other_isa.sh)
def test_tensor_parallel_streams_layers_and_grad_norm():
    run_distributed(_tp_worker, 2)


# ---- two gloo ranks, pipeline ---------------------------------------------------------------------------------
def _pp_worker(rank, world):
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed.runtime.pipe import p2p

    from megamemo.parallel.pipeline import build_pipeline, load_single_state
    from megamemo.train.validate import Evaluator, PipelineEvaluator

    cfg = load(None, TINY + ["eval.every=1", "eval.batch_size=2", "eval.tgt_len=4", "eval.mem_len=8"])
    torch.manual_seed(0)
    single = MemTransformerLM(cfg.model).eval()
    module, ctx = build_pipeline(cfg.model, pp=world)
    load_single_state(cfg.model, module, single.state_dict())
    data = torch.randint(0, 40, (4 * 4 + 1, 2), generator=torch.Generator().manual_seed(2))
    segments = [(data[i * 4 : (i + 1) * 4], data[i * 4 + 1 : (i + 1) * 4 + 1]) for i in range(4)]
    traffic = []

    def send(t, stage):
        traffic.append(t.device)
        dist.send(t, stage)

    def recv(t, stage):
        traffic.append(t.device)
        dist.recv(t, stage)

    ds = SimpleNamespace(
        module=module,
        is_first_stage=lambda: rank == 0,
        is_last_stage=lambda: rank == world - 1,
        prev_stage=rank - 1,
        next_stage=rank + 1,
    )
    cpu = torch.device("cpu")
    ev = PipelineEvaluator(cfg, lambda: iter(segments), lambda: ds, ctx, cpu, world, None)
    real = p2p.send, p2p.recv
    p2p.send, p2p.recv = send, recv
    torch.set_default_device("meta")
    try:
        total = ev.score()
    finally:
        torch.set_default_device(None)
        p2p.send, p2p.recv = real
    assert traffic and set(traffic) == {cpu}, traffic  # header, rows and meta: all on the engine's device
    if rank == world - 1:
        want = Evaluator(cfg, lambda: iter(segments), lambda: single, cpu, 1, None).score()
        # the stages compute the same layers in other processes: two orders of the forward pass's fp32 sums, per
        # token relative to its (positive) NLL and so to the total (tests/helpers/bounds.py)
        assert torch.allclose(total, want, rtol=forward_bound(cfg.model, 1.0), atol=0), (total, want)


@pytest.mark.multiproc
@pytest.mark.numerics
def test_pipeline_evaluator_sends_only_tensors_on_the_communication_device():
    run_distributed(_pp_worker, 2)


class CountingMeta(torch.Tensor):
    """A meta tensor that counts the reads of its values to the host (.tolist / .item / int(...))."""

    reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("tolist", "item", "__int__", "__index__", "__float__", "__bool__"):
            CountingMeta.reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_stage_reads_meta_once_and_makes_it_on_the_tokens_device():
    from megamemo.parallel.pipeline import EmbedPipe, LayerPipe, RelBiasPipe, StageContext, stage_meta

    cfg = ModelConfig(
        variant="lamemo",
        n_token=40,
        n_layer=3,
        d_model=16,
        n_head=2,
        d_head=8,
        d_inner=32,
        dropout=0.0,
        tgt_len=4,
        mem_len=4,
    )
    ctx = StageContext(cfg)
    stage = [EmbedPipe(cfg, ctx)] + [m for li in range(3) for m in (RelBiasPipe(cfg, ctx), LayerPipe(cfg, ctx, li))]
    for p in (p for m in stage for p in m.parameters()):
        torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(p.numel()))
    tokens = torch.randint(0, 40, (4, 2), generator=torch.Generator().manual_seed(0))
    for mb, first in ((0, True), (1, False)):  # a first stage, then a middle one
        x = (tokens, stage_meta(mb, 0, 0, "cpu")) if first else None
        if not first:
            rows = torch.randn(4, 2, 16)
            x = (rows, stage_meta(mb, 0, 4, "cpu"))
        x = (x[0], x[1].as_subclass(CountingMeta))
        CountingMeta.reads = 0
        torch.set_default_device("meta")
        try:
            for m in stage if first else stage[1:]:
                x = m(x)
        finally:
            torch.set_default_device(None)
        assert CountingMeta.reads == 1, CountingMeta.reads  # per stage and micro-batch, not per layer
        assert x[1].device.type == "cpu" and x[1].tolist() == [mb, 0, 4]


# ---- DeepSpeed's gradient accumulation ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, zero, pp, setting, want",
    [
        ("bf16", 2, 1, "auto", "fp32"),
        ("fp16", 2, 1, "auto", "fp32"),
        ("fp16", 1, 1, "auto", "fp32"),
        ("bf16", 1, 1, "auto", None),
        ("bf16", 1, 1, "fp32", "fp32"),
        ("bf16", 0, 1, "auto", None),
        ("fp16", 1, 2, "auto", "fp32"),
        ("bf16", 1, 2, "auto", "fp32"),
        ("bf16", 2, 1, "model", None),
        ("fp32", 2, 1, "auto", None),
    ],
)
def test_ds_config_accumulates_half_precision_gradients_in_fp32_where_deepspeed_can(dtype, zero, pp, setting, want):
    """tiny-cpu.yaml has grad_accum 1: bf16 on ZeRO 1 there has nothing to accumulate and takes the model dtype, so
    that DeepSpeed runs its ZeRO optimizer (the overlapped bf16 reduction: parallel/zero.py)."""
    from megamemo.train.engine import ds_config

    cfg = load(
        REPO / "configs/tiny-cpu.yaml",
        [
            f"precision.dtype={dtype}",
            f"parallel.zero_stage={zero}",
            f"parallel.pp={pp}",
            f"precision.grad_accum_dtype={setting}",
        ],
    )
    assert ds_config(cfg, 4, 1).get("data_types", {}).get("grad_accum_dtype") == want


def test_fp32_accumulation_without_zero_is_a_config_error():
    with pytest.raises(ConfigError, match="precision.grad_accum_dtype: fp32 accumulation .* needs ZeRO 1 or 2"):
        load(
            REPO / "configs/tiny-cpu.yaml",
            ["precision.dtype=bf16", "parallel.zero_stage=0", "precision.grad_accum_dtype=fp32"],
        )


def _engine_worker(rank, world):
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    from megamemo.train.engine import Engine

    for sets, cls, accum in (
        (["parallel.zero_stage=2"], "DeepSpeedZeroOptimizer", torch.float32),
        (["parallel.zero_stage=1", "precision.grad_accum_dtype=model"], "DeepSpeedZeroOptimizer", torch.bfloat16),
        (["parallel.zero_stage=1", "train.grad_accum=2"], "BF16_Optimizer", None),
        (["parallel.zero_stage=1"], "DeepSpeedZeroOptimizer", torch.bfloat16),
    ):  # grad_accum 1
        cfg = load(REPO / "configs/tiny-cpu.yaml", ["precision.dtype=bf16", *sets])
        eng = Engine(cfg, MemTransformerLM(cfg.model), 4, 1)
        opt = eng.ds.optimizer
        assert type(opt).__name__ == cls, (sets, type(opt).__name__)
        got = getattr(opt, "gradient_accumulation_dtype", None) or getattr(opt, "grad_acc_dtype", None)
        assert got == (accum or torch.float32), (sets, got)


def test_deepspeed_builds_the_optimizer_that_accumulates_as_configured():
    run_distributed(_engine_worker, 1)


# ---- TF32 for fp32 runs (precision.allow_tf32) -----------------------------------------------------------------
@pytest.mark.parametrize(
    "sets, want",
    [
        ([], False),
        (["precision.allow_tf32=true"], True),
        (["precision.allow_tf32=true", "precision.dtype=bf16"], False),
    ],
)
def test_train_sets_tf32_as_the_config_allows(monkeypatch, tmp_path, sets, want):
    """The call site (`megamemo train` start-up): TF32 products exactly for fp32 runs that allow them. The run is
    stopped right after (build is replaced by one that raises), before anything needs a GPU."""
    from megamemo.commands import train as cli
    from megamemo.train import run

    class Stop(Exception):
        pass

    def stop(cfg, log=print, stop=None, **kw):
        raise Stop()

    monkeypatch.setattr(run, "build", stop)
    monkeypatch.setattr(device, "resolve", lambda env=None: "cpu")
    monkeypatch.setattr("megamemo.train.run.check_data_dir", lambda cfg: None)
    monkeypatch.setattr("megamemo.train.run.check_precision", lambda dtype: None)
    monkeypatch.setattr("megamemo.train.run.die_with_parent", lambda: None)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not want
    try:
        args = ["--config", str(REPO / "configs/tiny-cpu.yaml"), "--run-dir", str(tmp_path / "run")]
        with pytest.raises(Stop):
            cli.main(args + [a for s in sets for a in ("--set", s)])
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (want, want)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved

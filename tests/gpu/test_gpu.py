"""On one CUDA GPU (`pytest -m gpu tests/gpu/test_gpu.py`; deselected where torch sees no CUDA device, see conftest):
  * the golden reference cases in fp32 with TF32 off, within 1e-5, forward, memory and gradients, on the plain
    PyTorch path that train.kernels=auto picks on CUDA (megamemo/kernels/), and its dropout's law;
  * training through DeepSpeed's real engines in bf16 and fp16 (loss scaling; an fp16 overflow skips its step and
    leaves memory and data cursor alone), kill -9 -> resume bit for bit (train.deterministic), convert -> eval;
  * the tensor-parallel modules (megatron-core layers, CUDA RNG tracker) and the pipeline engine at world size 1;
  * `megamemo plan` beside the measured peak memory of the same run (within 25%, activation checkpointing too);
  * bf16 convert -> eval at d_model 1024 over 1,536 positions (where half-precision angles would show);
  * the host syncs of a training step (torch.cuda.set_sync_debug_mode), each one a known, needed one;
  * TF32 for an fp32 run that allows it (precision.allow_tf32), against the run without.
Every run goes through `megamemo train` / `convert` / `eval` as on a cluster, with DS_ACCELERATOR=cuda."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers.fixture_data import REPO, reference_file
from helpers.sync_sites import SYNC_SETS, unneeded
from test_gpu_checks_on_cpu import assert_positions_are_fp32s, resumed_adam_steps, tf32_runs
from test_model_reference import FILES, check_grads, close, ref_memory_tensors
from test_train_runs import (
    assert_no_corrupt_checkpoint,
    committed_steps,
    fp16_overflow_run,
    launch,
    logs,
    losses,
    run,
    wait,
)

from megamemo.interop.reference import import_reference
from megamemo.interop.score import load_reference_file
from megamemo.kernels import apply_kernels, kernels_in_use
from megamemo.runtime.dist import free_port

pytestmark = pytest.mark.gpu
GPU = {
    "DS_ACCELERATOR": "cuda",
    "MEGAMEMO_DEVICE": "gpu",
    "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
}


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 products in fp32 (no TF32) for comparisons with the CPU references."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ---- the reference implementations' outputs, on CUDA ----------------------------------------------------------
@pytest.mark.parametrize("name", FILES)
def test_golden_reference_on_cuda(name):
    g = load_reference_file(str(reference_file(name)))
    cuda = [x.cuda() for x in g["inputs"]], [y.cuda() for y in g["targets"]]
    model = import_reference(g["config"], g["state_dict"]).cuda().eval()
    assert apply_kernels(model, "auto", "cuda") == "plain" and kernels_in_use(model) == "plain"
    mem = None
    with torch.no_grad():
        for k, (x, y) in enumerate(zip(*cuda, strict=True)):
            nll, mem = model(x, y, mem)
            assert nll.is_cuda
            close(nll.cpu(), g["nll"][k], f"segment {k} NLL on CUDA")
            for n, t in ref_memory_tensors(g, g["mems"][k]).items():
                close(mem[n].cpu(), t, f"segment {k} memory {n} on CUDA")
    t = g["train"]
    model = import_reference(g["config"], g["state_dict"]).cuda().train()
    assert apply_kernels(model, "auto", "cuda") == "plain"
    _, mem = model(cuda[0][0], cuda[1][0])
    nll, _ = model(cuda[0][1], cuda[1][1], mem)
    close(nll.detach().cpu(), t["train_nll_seg1"], "train-mode segment 1 NLL with memory on CUDA")
    nll.mean().backward()
    check_grads(model.cpu(), g, t["grads_seg1_with_mem"], "segment 1 with memory on CUDA")  # .cpu() moves grads


def test_plain_dropout_law_on_cuda():
    """train.kernels=auto on CUDA is torch's own dropout (cpu kernels are refused there): kept values scaled by
    1/(1-p), the kept fraction 1-p within 5 sigma, the feed-forward's ReluDropout zero wherever ReLU is."""
    from megamemo.model.layers import ReluDropout

    with pytest.raises(ValueError, match="train.kernels: cpu kernels run on the CPU"):
        apply_kernels(torch.nn.Sequential(torch.nn.Dropout(0.1)), "cpu", "cuda")
    p, n = 0.3, 1_000_000
    for drop in (torch.nn.Dropout(p), ReluDropout(p)):
        y = drop.cuda().train()(torch.ones(n, device="cuda"))
        keep = y != 0
        assert torch.allclose(y[keep], torch.tensor(1 / (1 - p), device="cuda"))
        assert abs(keep.float().mean().item() - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5
    x = torch.randn(n, device="cuda")
    assert (ReluDropout(p).train()(x)[x <= 0] == 0).all()


# ---- DeepSpeed engines on one GPU -----------------------------------------------------------------------------
def test_bf16_run_converts_and_evaluates_on_cuda(tiny_cfg, shards, tmp_path):
    run_dir = tmp_path / "bf16"
    run(
        1,
        tiny_cfg,
        shards,
        run_dir,
        "--set",
        "precision.dtype=bf16",
        "--set",
        "parallel.zero_stage=2",
        "--set",
        "eval.every=8",
        "--set",
        "eval.batch_size=4",
        "--set",
        "eval.max_segments=10",
        env_extra=GPU,
        timeout=300,
    )
    assert "| plain kernels |" in logs(run_dir), logs(run_dir)[-3000:]  # train.kernels=auto on CUDA
    got = losses(run_dir)
    assert sorted(got) == list(range(1, 9)) and got[8] < got[1], got
    val = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "eval"
    ][-1]
    env = dict(os.environ, **GPU)
    single = tmp_path / "single"
    r = subprocess.run(
        [sys.executable, "-m", "megamemo", "convert", "to-single", "--ckpt", str(run_dir), "--out", str(single)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    check = json.loads((single / "config.json").read_text())["meta"]["check"]  # the probe, recorded on the GPU
    assert check["precision"] == "bf16" and check["max_abs_diff"] <= 0.1, check
    out = tmp_path / "eval.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megamemo",
            "eval",
            "--ckpt",
            str(single),
            "--data",
            str(shards),
            "--split",
            "valid",
            "--batch-size",
            "4",
            "--max-segments",
            "10",
            "--tgt-len",
            str(val["tgt_len"]),
            "--mem-len",
            str(val["mem_len"]),
            "--device",
            "cuda",
            "--dtype",
            "bf16",
            "--json",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ev = json.loads(out.read_text())
    assert ev["tokens"] == val["tokens"] and ev["nll"] == pytest.approx(val["loss"], rel=1e-3), (ev, val)


def test_fp16_overflow_on_cuda_skips_the_step_and_keeps_memory(tiny_cfg, shards, tmp_path):
    rows = fp16_overflow_run(tiny_cfg, shards, tmp_path / "fp16", **GPU)  # asserts the skip itself
    assert all(r["device"].startswith("cuda") for r in rows), rows
    assert rows[0]["scale"] == 2.0**10  # dynamic loss scaling is on


def test_kill9_then_resume_on_cuda_is_bit_exact(tiny_cfg, shards, tmp_path):
    args = [
        "--set",
        "precision.dtype=bf16",
        "--set",
        "train.deterministic=true",
        "--max-steps",
        "20",
        "--save-every",
        "2",
    ]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "crash"
    run(1, tiny_cfg, shards, ref_dir, *args, env_extra=GPU, timeout=300)
    procs = launch(1, tiny_cfg, shards, run_dir, *args, env_extra=GPU)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 240
    while not (
        metrics.exists()
        and any(json.loads(line).get("step", 0) >= 7 for line in metrics.read_text().splitlines() if line.endswith("}"))
    ):
        assert time.time() < deadline and procs[0].poll() is None, logs(run_dir)[-3000:]
        time.sleep(0.02)
    procs[0].send_signal(signal.SIGKILL)
    assert wait(procs, 60) == [-signal.SIGKILL]
    assert_no_corrupt_checkpoint(run_dir)
    resume_step = committed_steps(run_dir)[-1]
    assert 2 <= resume_step < 20
    run(1, tiny_cfg, shards, run_dir, *args, env_extra=GPU, timeout=300)
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{resume_step:08d}'}" in logs(run_dir)
    assert losses(run_dir) == losses(ref_dir)  # bit for bit


# ---- the tensor- and pipeline-parallel code at world size 1 ---------------------------------------------------
TP_PP_SCRIPT = r"""
import copy, importlib, json, sys
import torch
import deepspeed
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
from megamemo.runtime import dist as mdist
mdist.init()                                               # NCCL, world 1, cuda:0
from megamemo.model import MemTransformerLM, ModelConfig
from megamemo.parallel.groups import TP_RNG, grad_norm, init_model_parallel, rng_tracker, seed_rng_streams
from megamemo.parallel.shard_init import init_shard
from megamemo.parallel.pipeline import build_pipeline, load_single_state
from megamemo.parallel.tensor import parallelize_tensor
init_model_parallel(1, 1)
seed_rng_streams(5, 0, 0, 0, cuda=True)
cfg = ModelConfig(variant=sys.argv[1], n_token=40, n_layer=4, d_model=16, n_head=2, d_head=8, d_inner=32,
                  dropout=0.0, tgt_len=6, mem_len=12, init_std=0.1)
torch.manual_seed(0)
single = MemTransformerLM(cfg)
data = torch.randint(0, 40, (4 * 6 + 1, 4), generator=torch.Generator().manual_seed(3)).cuda()
out = {}

def sgd(model, steps=4):
    opt, mem, got = torch.optim.SGD(model.parameters(), lr=0.3), None, []
    for s in range(steps):
        nll, mem = model(data[s * 6:(s + 1) * 6], data[s * 6 + 1:(s + 1) * 6 + 1], mem)
        nll.mean().backward()
        got.append(nll.mean().item())
        if s == steps - 1:
            out.setdefault("norms", []).append(grad_norm(model.parameters()))
        opt.step(); opt.zero_grad(set_to_none=False)
    return got

out["single"] = sgd(copy.deepcopy(single).cuda())
tp_model = parallelize_tensor(copy.deepcopy(single), always=True).cuda()
out["megatron_layers"] = sorted({c.__name__ for m in tp_model.modules() for c in type(m).__mro__
                                 if c.__module__.startswith("megatron.")})
out["tp"] = sgd(tp_model)
from megamemo.kernels import apply_kernels, kernels_in_use
out["kernels"] = [apply_kernels(tp_model, "auto", "cuda"), kernels_in_use(tp_model)]
drop = importlib.import_module("megamemo.parallel.tensor").ForkedDropout(torch.nn.Dropout(0.5)).train()
before = rng_tracker().get_states()[TP_RNG].clone()
drop(torch.ones(64, device="cuda"))
out["tp_stream_advanced"] = not torch.equal(before, rng_tracker().get_states()[TP_RNG])
shard = parallelize_tensor(copy.deepcopy(single), always=True)       # megatron layers hold process groups:
init_shard(shard, cfg, seed=9)                                      # build them anew, no deepcopy
on_gpu = parallelize_tensor(copy.deepcopy(single), always=True).cuda()
init_shard(on_gpu, cfg, seed=9)
out["init_same_on_cuda"] = all(torch.equal(a, b.cpu()) for a, b in zip(shard.parameters(), on_gpu.parameters()))

module, ctx = build_pipeline(cfg, pp=1)
load_single_state(cfg, module, single.state_dict())
out["kernels"] += [apply_kernels(module, "auto", "cuda"), kernels_in_use(module)]
engine, *_ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.3), config={
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 0}, "steps_per_print": 10**9})
pp = []
for s in range(4):
    x, y = data[s * 6:(s + 1) * 6], data[s * 6 + 1:(s + 1) * 6 + 1]
    batches = [((x[:, k * 2:(k + 1) * 2], torch.tensor([k, 0, 0])), y[:, k * 2:(k + 1) * 2]) for k in range(2)]
    pp.append(float(engine.train_batch(iter(batches))))
    ctx.bank.commit()
out["pp"] = pp
out["bank_device"] = sorted({t.device.type for d in ctx.bank.current.values() for t in d.values()})
print("OUT" + json.dumps(out))
"""


@pytest.mark.parametrize("variant", ["lamemo", "xl"])
def test_tensor_and_pipeline_parallel_code_on_one_gpu(variant, tmp_path):
    script = tmp_path / "tp_pp.py"
    script.write_text(TP_PP_SCRIPT)
    env = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        **GPU,
    )
    r = subprocess.run(
        [sys.executable, str(script), variant], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.split("OUT", 1)[1])
    assert out["megatron_layers"] == ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"], out
    assert max(abs(a - b) for a, b in zip(out["tp"], out["single"], strict=True)) < 1e-5, out
    assert abs(out["norms"][0] - out["norms"][1]) < 1e-5 * out["norms"][0], out
    assert out["tp_stream_advanced"] and out["init_same_on_cuda"], out
    # the pipeline averages its 2 micro-batches (2 streams each); the single model saw all 4 streams at once
    assert max(abs(a - b) for a, b in zip(out["pp"], out["single"], strict=True)) < 1e-5, out
    assert out["bank_device"] == ["cuda"], out
    assert out["kernels"] == ["plain"] * 4, out  # train.kernels=auto on CUDA: plain PyTorch


# ---- plan vs measured ---------------------------------------------------------------------------------------------
MEASURE_SCRIPT = r"""
import sys, torch
from megamemo.train.config import load
from megamemo.train.build import build
cfg = load(sys.argv[1], sys.argv[2:])
trainer, _ = build(cfg)
torch.cuda.reset_peak_memory_stats()
for _ in range(3):
    trainer.train_step()
torch.cuda.synchronize()
print(f"PEAK {torch.cuda.max_memory_allocated()}")
"""


@pytest.mark.parametrize("recompute", [False, True])
def test_plan_beside_the_measured_peak_memory(shards, tmp_path, recompute):
    """`megamemo plan` (DeepSpeed's buffers counted: at grad_accum 1 bf16 ZeRO 1 runs the ZeRO optimizer, its fp32
    partition and bf16 bucket, parallel/zero.py)
    within 25% of torch.cuda.max_memory_allocated over 3 steps, with and without activation checkpointing."""
    sets = [
        "model.n_layer=4",
        "model.d_model=512",
        "model.n_head=8",
        "model.d_head=64",
        "model.d_inner=2048",
        "model.tgt_len=256",
        "model.mem_len=256",
        "data.batch_size=16",
        "precision.dtype=bf16",
        "parallel.zero_stage=1",
        f"train.activation_checkpointing={str(recompute).lower()}",
        "eval.every=0",
        "checkpoint.save_every=0",
        "checkpoint.save_at_end=false",
        "log.tensorboard=false",
        f"data.dir={shards}",
        f"train.run_dir={tmp_path / 'run'}",
    ]
    config = REPO / "configs/tiny-cpu.yaml"
    plan_cmd = [
        sys.executable,
        "-m",
        "megamemo",
        "plan",
        "--config",
        str(config),
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--gpu",
        "a100-80g",
    ] + [a for s in sets[:11] for a in ("--set", s)]
    p = subprocess.run(plan_cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    planned = float(re.search(r"total\s+([0-9.]+) GiB", p.stdout).group(1))
    script = tmp_path / "measure.py"
    script.write_text(MEASURE_SCRIPT)
    env = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        **GPU,
    )
    r = subprocess.run(
        [sys.executable, str(script), str(config), *sets],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    measured = int(r.stdout.split("PEAK", 1)[1]) / 1024**3
    print(f"\n{p.stdout}measured peak (torch.cuda.max_memory_allocated): {measured:.3f} GiB; plan {planned:.3f} GiB")
    assert 0.75 <= measured / planned <= 1.25, (measured, planned)


@pytest.mark.parametrize("flags", [{}, {"fused": True}, {"capturable": True}])
def test_adam_step_tensor_helper_on_cuda_matches_torch(flags):
    """The helper alone (adam_step_tensor, step_on_param_device); the call site: the test below."""
    from megamemo.train.resumable import adam_step_tensor, step_on_param_device

    p = torch.nn.Parameter(torch.ones(3, device="cuda"))
    opt = torch.optim.Adam([p], lr=0.1, **flags)
    p.grad = torch.ones_like(p)
    opt.step()
    made = opt.state[p]["step"]
    ours = adam_step_tensor(1, p.device, step_on_param_device(opt.param_groups))
    assert (ours.device, ours.dtype) == (made.device, made.dtype)


def test_resumed_adam_step_on_cuda_at_the_call_site(tiny_cfg, shards, tmp_path):
    """A real resume on the GPU (bf16, ZeRO 1: BF16_Optimizer around torch's fused Adam): the optimizer's step
    tensors hold the count on the device torch's own Adam uses (cuda), and the next step runs
    (tests/gpu/test_gpu_checks_on_cpu.py: the same script and checks on the CPU)."""
    out = resumed_adam_steps(
        tiny_cfg,
        shards,
        tmp_path,
        sets=["precision.dtype=bf16", "precision.grad_accum_dtype=fp32"],
        env_extra=GPU,
        timeout=300,
    )
    assert out["optimizer"] == "BF16_Optimizer", out  # fp32 accumulation named: not the ZeRO optimizer
    assert out["fused"] and out["torch_makes"][0].startswith("cuda"), out
    assert all(dev.startswith("cuda") and param_dev.startswith("cuda") for _, dev, _, param_dev in out["resumed"]), out


# ---- bf16 at a width where rounding shows (issue 28) ------------------------------------------------------------
def test_bf16_convert_and_eval_at_width(tiny_cfg, shards, tmp_path):
    """d_model 1024 and 1,536 positions (512 tokens + 1,024 of memory): the probe of `convert to-single --dtype
    bf16` passes (its bound: megamemo/checkpoint/probe_bound.py), the converted bf16 model on the GPU gives every
    r_net the exact sinusoids within one bf16 rounding (bf16 angles would be off by radians: shown on the CPU in
    tests/gpu/test_gpu_checks_on_cpu.py; the NLL comparison below cannot see them), and `eval --dtype bf16` of the
    converted model scores the training run's own validation within bf16's tolerance."""
    run_dir = tmp_path / "wide"
    width = [
        "--set",
        "model.d_model=1024",
        "--set",
        "model.n_head=16",
        "--set",
        "model.d_head=64",
        "--set",
        "model.d_inner=2048",
        "--set",
        "model.n_layer=2",
        "--set",
        "model.tgt_len=512",
        "--set",
        "model.mem_len=1024",
        "--set",
        "data.batch_size=2",
    ]
    run(
        1,
        tiny_cfg,
        shards,
        run_dir,
        "--set",
        "precision.dtype=bf16",
        "--max-steps",
        "4",
        "--save-every",
        "4",
        "--set",
        "eval.every=4",
        "--set",
        "eval.batch_size=2",
        "--set",
        "eval.max_segments=3",
        *width,
        env_extra=GPU,
        timeout=600,
    )
    val = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "eval"
    ][-1]
    env = dict(os.environ, **GPU)
    single = tmp_path / "single"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megamemo",
            "convert",
            "to-single",
            "--ckpt",
            str(run_dir),
            "--out",
            str(single),
            "--dtype",
            "bf16",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    check = json.loads((single / "config.json").read_text())["meta"]["check"]
    print(f"\nbf16 probe at d_model 1024, 1,536 positions on {torch.cuda.get_device_name()}: {check}")
    from megamemo.checkpoint.single import load_single

    worst = assert_positions_are_fp32s(load_single(single)[0].cuda(), 1536)  # the converted model, on the GPU
    print(f"positions at 1,536 on the GPU: within {worst:.3g} of the exact sinusoids")
    out = tmp_path / "eval.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megamemo",
            "eval",
            "--ckpt",
            str(single),
            "--data",
            str(shards),
            "--split",
            "valid",
            "--batch-size",
            "2",
            "--max-segments",
            "3",
            "--tgt-len",
            str(val["tgt_len"]),
            "--mem-len",
            str(val["mem_len"]),
            "--device",
            "cuda",
            "--dtype",
            "bf16",
            "--json",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ev = json.loads(out.read_text())
    assert ev["tokens"] == val["tokens"] and abs(ev["nll"] - val["loss"]) <= 0.01, (ev, val)


# ---- host syncs of a training step --------------------------------------------------------------------------------
def test_host_syncs_of_a_training_step_are_the_needed_ones(shards, tmp_path):
    """A step under torch.cuda.set_sync_debug_mode (helpers/sync_sites.py, the script): every synchronizing call is
    listed by its megamemo call site; each must be one of sync_sites.NEEDED_SYNCS, and megamemo's own stay at most
    MAX_OWN a step. The attribution skips warnings.py's frames (else every sync read "outside megamemo" and this
    test could not fail: tests/gpu/test_sync_sites.py)."""
    env = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        **GPU,
    )
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests/helpers/sync_sites.py"),
            str(REPO / "configs/tiny-cpu.yaml"),
            *SYNC_SETS,
            f"data.dir={shards}",
            f"train.run_dir={tmp_path}/r",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    sites = [line[5:] for line in r.stdout.splitlines() if line.startswith("SYNC ")]
    print("\nhost syncs of one step:\n  " + "\n  ".join(sites))
    assert unneeded(sites) == [], sites


# ---- TF32 for fp32 runs (precision.allow_tf32) ------------------------------------------------------------------
def test_tf32_run_tracks_the_fp32_run(tiny_cfg, shards, tmp_path):
    """fp32 with TF32 products against fp32 without, per step within 0.005 / 8 nats: the bf16 bound of
    tests/train/test_train_equivalence.py (derived there for U = 2^-8) scaled to TF32's 11 significant bits (2^-11).
    Each run's log names the TF32 state its worker read back from torch (tf32_runs): a run that never switched
    TF32 on fails here."""
    a, b = tf32_runs(tiny_cfg, shards, tmp_path, 5, env_extra=GPU, timeout=300)
    assert sorted(a) == sorted(b) and max(abs(a[s] - b[s]) for s in a) <= 0.005 / 8, (a, b)

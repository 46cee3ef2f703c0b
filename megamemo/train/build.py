"""Everything a training run needs, built in order on every rank (`build`): the process group, the run directory's
lock, the checkpoint store and the checkpoint to resume from, the model in its parallel form (parallel.init: full or
sharded), the DeepSpeed engine, the speed switches, the dropout streams, the data reader, metrics, validation and the
Trainer (loop.py) with the checkpoint's state restored. docs/architecture.md lists the order and why."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from megamemo.checkpoint.layout import RankLayout, RunMeta
from megamemo.checkpoint.store import CheckpointStore, read_marker
from megamemo.model import MemTransformerLM
from megamemo.model.flops import flops_per_token, model_flops_per_token
from megamemo.model.params import embed_params, layer_params
from megamemo.parallel.groups import MCoreMPU, init_model_parallel
from megamemo.parallel.pipeline import build_pipeline, load_single_state, single_to_stage_names
from megamemo.parallel.shard_init import init_shard, shard_model
from megamemo.parallel.tensor import parallelize_tensor
from megamemo.runtime import dist, rss
from megamemo.runtime.device import tf32_state
from megamemo.runtime.interruptions import restart_count
from megamemo.runtime.peak import device_peak, format_flops
from megamemo.runtime.rundir import RunDirectory
from megamemo.runtime.signals import StopRequest
from megamemo.runtime.watchdog import Watchdog
from megamemo.train.config import RunConfig
from megamemo.train.data import bytes_per_token, open_reader, unit_for
from megamemo.train.engine import Engine
from megamemo.train.loop import Trainer, seed_streams
from megamemo.train.metrics import Metrics
from megamemo.train.speedups import apply_speedups
from megamemo.train.validate import Evaluator, PipelineEvaluator, eval_lengths
from megamemo.train.vocab import adopt_checkpoint_vocab
from megamemo.util.seeding import seed_default_streams


def rank_layout(cfg: RunConfig, de, dp: int, micro: int) -> RankLayout:
    """Create the TP x PP x DP groups (megatron-core's order: TP fastest, then DP, then PP - the same order as
    DeepSpeed's pipeline topology) and return this rank's layout: its coordinates and the global columns of each of
    its micro-batches (TP and PP ranks of one DP group read the same streams)."""
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if tp == 1 and pp == 1:
        dp_rank, tp_rank, pp_rank = de.rank, 0, 0
    else:
        from megatron.core import parallel_state as ps  # megatron-core: only under model parallelism (slow import)

        init_model_parallel(tp, pp, timeout_s=cfg.parallel.collective_timeout_s)
        dp_rank, tp_rank, pp_rank = (
            ps.get_data_parallel_rank(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
        )
    first = dp_rank * (cfg.data.batch_size // dp)
    return RankLayout(
        tuple((first + k * micro, first + (k + 1) * micro) for k in range(cfg.train.grad_accum)),
        rank=de.rank,
        world_size=de.world_size,
        dp_rank=dp_rank,
        dp=dp,
        tp_rank=tp_rank,
        tp=tp,
        pp_rank=pp_rank,
        pp=pp,
        batch_size=cfg.data.batch_size,
        zero_stage=cfg.parallel.zero_stage,
    )


def build_model(cfg: RunConfig):
    """The model in this run's parallel form -> (module for DeepSpeed, mpu or None, pipeline stage or None).
    parallel.init "full": every rank first builds the single-device model from the same seed and keeps its shard,
    so any layout starts from the same weights; "shard": each rank initialises only its own shard (for models too
    large to hold whole in every process's host memory); "auto": full up to 5e8 parameters."""
    tp, pp, m = cfg.parallel.tp, cfg.parallel.pp, cfg.model
    n_params = sum(layer_params(m)) * m.n_layer + embed_params(m)
    shard = tp * pp > 1 and (cfg.parallel.init == "shard" or (cfg.parallel.init == "auto" and n_params > 5e8))
    if pp > 1:
        # deepspeed: imported once runtime/device.resolve() chose its accelerator (train/engine.py Engine)
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        topo = PipeModelDataParallelTopology(
            num_pp=pp, num_mp=tp, num_dp=torch.distributed.get_world_size() // (tp * pp)
        )
        full = None if shard else MemTransformerLM(m).state_dict()  # first: from the freshly seeded RNG
        module, stage = build_pipeline(
            m, pp, topology=topo, activation_checkpoint_interval=int(cfg.train.activation_checkpointing)
        )
        if shard:
            inv = {v: k for k, v in single_to_stage_names(m, module).items()}
            init_shard(module, m, cfg.train.seed, lambda n: inv.get(n, n))
        else:
            assert full is not None
            load_single_state(m, module, full)
        return module, None, stage
    if tp > 1:
        model = parallelize_tensor(MemTransformerLM(m)) if not shard else shard_model(m, cfg.train.seed)
        model.recompute_layers = cfg.train.activation_checkpointing
        return model, MCoreMPU(), None
    model = MemTransformerLM(m)
    model.recompute_layers = cfg.train.activation_checkpointing
    return model, None, None


def build(cfg: RunConfig, log=print, stop=None, started: float | None = None):
    """Start the process group, take the run directory and build everything a run needs: (trainer, dist env).
    started: when this process started (wall clock; goodput's start-up), default now."""
    stop = stop or StopRequest()  # from the start: a signal during start-up stops after step one
    started = time.time() if started is None else started
    de = dist.init(cfg.parallel.collective_timeout_s)
    dp, micro = cfg.layout(de.world_size)
    layout = rank_layout(cfg, de, dp, micro)
    run_dir = Path(cfg.train.run_dir)
    rundir = RunDirectory(run_dir, de.rank, cfg.train.lock_stale_s, log=log)
    rundir.open(dist.broadcast)  # one trainer per run directory
    watchdog = Watchdog(run_dir, de.rank, de.world_size, cfg.train.hang_timeout_s, cfg.train.hang_floor_s)
    try:
        trainer = _build(cfg, de, layout, run_dir, stop, log, started, rundir, watchdog)
    except BaseException:
        rundir.close()
        raise
    return trainer, de


def _threads() -> int:
    """This process's intra-op threads: a CPU kernel's sums split by them, so a bit-exact replay uses as many."""
    return torch.get_num_threads()


def _build(
    cfg: RunConfig,
    de,
    layout: RankLayout,
    run_dir: Path,
    stop,
    log,
    started: float,
    rundir: RunDirectory,
    watchdog: Watchdog,
) -> Trainer:
    dp, dp_rank, micro = layout.dp, layout.dp_rank, layout.micro_batch
    meta = RunMeta(
        cfg.model.to_dict(), cfg.model_fingerprint(), layout.run, cfg.precision.dtype, cfg.train.dropout_masks
    )
    store = CheckpointStore(
        run_dir / "checkpoints",
        de.rank,
        de.world_size,
        cfg.checkpoint.keep_last,
        meta,
        barrier=dist.barrier,
        async_save=cfg.checkpoint.async_save,
        commit_timeout_s=cfg.checkpoint.commit_timeout_s,
        log=log,
    )
    resume_dir = store.select(cfg.checkpoint.resume)  # collective: the newest that verifies
    if resume_dir is not None and cfg.n_token_auto:  # the checkpoint's padded tables, under any layout
        said = adopt_checkpoint_vocab(cfg, RunMeta.from_record(read_marker(resume_dir)).model)
        if said:
            store.meta = replace(meta, model=cfg.model.to_dict(), model_fingerprint=cfg.model_fingerprint())
            if de.rank == 0:
                log(f"[train] {said}")
    start_step = 0
    if resume_dir is not None:
        start_step = store.check_compatible(resume_dir).step
    if de.rank == 0:
        for p in store.remove_incomplete():
            log(f"[checkpoint] removed {p}: an interrupted save, never committed")
    dist.barrier()
    rss.mark("started")  # imports and the process group: the baseline (MEGAMEMO_RSS_REPORT)
    seed_default_streams(cfg.train.seed)  # identical initial weights on every rank
    model, mpu, stage = build_model(cfg)
    engine = Engine(cfg, model, micro, dp, mpu=mpu)
    # CPU kernels (train.kernels), dropout masks (train.dropout_masks: keyed ones are told each micro-batch's first
    # global column), the attention form (model.attention) and compiled layers (train.compile)
    speed = apply_speedups(
        cfg,
        model,
        engine.device,
        micro,
        log if de.rank == 0 else (lambda *a, **k: None),
        tp_rank=layout.tp_rank,
        columns=[c0 for c0, _ in layout.micro_batches],
    )
    if stage is not None:
        stage.dropout_key = speed.dropout_key  # the stage's pipe layers tell it their micro-batch
    rss.mark("built")
    if getattr(engine.device, "type", str(engine.device)) == "cuda" and hasattr(model, "check_inputs"):
        model.check_inputs = False  # ids were checked against the manifest's vocabulary at start-up; on a
        # GPU the per-batch range check would cost a host sync every micro-batch
    # then each rank its dropout streams: the default one per (dp, pp), shared by the TP ranks of the group
    # (replicated activations); under model parallelism a TP stream per rank (parallel.groups.dropout_seeds)
    seed_streams(cfg, layout, engine.device)

    reader = open_reader(
        cfg.data,
        cfg.data.split,
        cfg.data.batch_size,
        cfg.model.tgt_len,
        dp,
        dp_rank,
        train=True,
        mix_every=10 * cfg.log.every if dp_rank == 0 else 0,
    )
    peak = device_peak(engine.device, cfg.precision.dtype)  # for HFU and MFU (model/flops.py)
    fpt, mfpt = flops_per_token(cfg.model, micro), model_flops_per_token(cfg.model)
    metrics = Metrics(
        run_dir,
        enabled=de.rank == 0,
        every=cfg.log.every,
        unit=unit_for(cfg.data),
        tensorboard=cfg.log.tensorboard,
        start_step=start_step,
        config_yaml=cfg.to_yaml(),
        flops_per_token=fpt,
        model_flops_per_token=mfpt,
        peak_flops=peak.flops,
        world_size=de.world_size,
        bytes_per_token=bytes_per_token(cfg.data),
        splits=(cfg.data.split, cfg.eval.split),
        start={
            "time": round(started, 3),
            "step": start_step,
            "world_size": de.world_size,
            "restart": restart_count(),
            "threads": _threads(),
        },
    )
    evaluator = None
    if cfg.eval.every:
        tgt_len = eval_lengths(cfg).tgt
        assert tgt_len is not None  # resolved (Lengths.resolve)

        def make_reader():
            return open_reader(cfg.data, cfg.eval.split, cfg.eval.batch_size, tgt_len, dp, dp_rank, train=False)

        if stage is None:
            evaluator = Evaluator(cfg, make_reader, lambda: engine.module, engine.device, de.world_size, metrics)
        else:
            evaluator = PipelineEvaluator(
                cfg, make_reader, lambda: engine.ds, stage, engine.device, de.world_size, metrics
            )
    trainer = Trainer(
        cfg,
        engine,
        reader,
        rank=de.rank,
        world_size=de.world_size,
        micro_batch=micro,
        metrics=metrics,
        store=store,
        evaluator=evaluator,
        stop=stop,
        layout=layout,
        stage=stage,
        speed=speed,
        rundir=rundir,
        watchdog=watchdog,
    )
    if resume_dir is not None:
        trainer.resume(resume_dir)
    if de.rank == 0:
        n_param = sum(p.numel() for p in model.parameters())
        log(
            f"[train] {cfg.model.variant} {n_param / 1e6:.2f}M params | world {de.world_size} ({de.launcher}) | "
            f"dp {dp} x {cfg.train.grad_accum} micro-batches of {micro} streams | {cfg.precision.dtype} | "
            f"{tf32_state()} | "
            f"ZeRO {cfg.parallel.zero_stage}{engine.reduction()} | {speed.kernels} kernels | "
            f"{cfg.train.dropout_masks} dropout masks | "
            f"{speed.attention} attention | {'compiled layers' if speed.compiled else 'eager layers'} | "
            f"run dir {run_dir} | "
            + (f"resuming at step {trainer.step}" if resume_dir else "fresh start")
            + f" | {format_flops(fpt)}/token executed (HFU), {format_flops(mfpt)}/token model (MFU), "
            f"peak {peak.source}"
        )
    return trainer

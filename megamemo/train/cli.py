"""`megamemo train`: one process per device (see launch/ for local.sh, srun and mpirun).

    megamemo train --config FILE [--data SHARD_DIR] [--run-dir DIR] [--max-steps N] [--save-every N]
                   [--set key=value ...] [--tp N --pp M] [--resume auto|never|PATH]

A start in a run directory that holds a committed checkpoint resumes from the newest one (checkpoint.resume).
Exit codes: 0 done or stopped by SIGUSR1/SIGTERM after saving; 2 bad config, data or checkpoint (never retried);
1 other errors; 3 hung (the watchdog, runtime/watchdog.py); 4 a peer is gone (runtime/interruptions.py).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from megamemo.config.run import ConfigError
from megamemo.train.config import RunConfig, load
from megamemo.util.seeding import seed_default_streams


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megamemo train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="run config YAML (see configs/)")
    p.add_argument("--data", help="shard directory or s3://, gs://, https:// URL of one (sets data.dir)")
    p.add_argument("--run-dir", help="run directory: config, metrics, TensorBoard, checkpoints (train.run_dir)")
    p.add_argument("--max-steps", type=int, help="train.max_steps")
    p.add_argument("--save-every", type=int, help="checkpoint.save_every")
    p.add_argument("--resume", help="checkpoint.resume: auto | never | a checkpoint or run directory")
    p.add_argument("--tp", type=int, help="parallel.tp (tensor parallel size)")
    p.add_argument("--pp", type=int, help="parallel.pp (pipeline parallel size)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set optim.lr=1e-4 (repeatable)")
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return p.parse_args(argv)


def resolve_config(args: argparse.Namespace) -> RunConfig:
    sets = list(args.set)
    for flag, key in (("data", "data.dir"), ("run_dir", "train.run_dir"), ("max_steps", "train.max_steps"),
                      ("save_every", "checkpoint.save_every"), ("resume", "checkpoint.resume"),
                      ("tp", "parallel.tp"), ("pp", "parallel.pp")):
        v = getattr(args, flag)
        if v is not None:
            sets.append(f"{key}={v}" if not isinstance(v, str) else f"{key}={_yaml_str(v)}")
    return load(args.config, sets)


def _yaml_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def parallel_ranks(cfg: RunConfig, de) -> dict:
    """Create the TP x PP x DP groups (megatron-core's order: TP fastest, then DP, then PP - the same order as
    DeepSpeed's pipeline topology) and return this rank's coordinates."""
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if tp == 1 and pp == 1:
        return {"dp_rank": de.rank, "tp_rank": 0, "pp_rank": 0}
    from megatron.core import parallel_state as ps

    from megamemo.parallel.groups import init_model_parallel

    init_model_parallel(tp, pp, timeout_s=cfg.parallel.collective_timeout_s)
    return {"dp_rank": ps.get_data_parallel_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank()}


def build_model(cfg: RunConfig):
    """The model in this run's parallel form -> (module for DeepSpeed, mpu or None, pipeline stage or None).
    parallel.init "full": every rank first builds the single-device model from the same seed and keeps its shard,
    so any layout starts from the same weights; "shard": each rank initialises only its own shard (for models too
    large to hold whole in every process's host memory); "auto": full up to 5e8 parameters."""
    from megamemo.model import MemTransformerLM
    from megamemo.model.params import embed_params, layer_params

    tp, pp, m = cfg.parallel.tp, cfg.parallel.pp, cfg.model
    n_params = sum(layer_params(m)) * m.n_layer + embed_params(m)
    shard = tp * pp > 1 and (cfg.parallel.init == "shard" or (cfg.parallel.init == "auto" and n_params > 5e8))
    if pp > 1:
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
        import torch.distributed as tdist

        from megamemo.parallel.shard_init import init_shard
        from megamemo.parallel.pipeline import build_pipeline, load_single_state, single_to_stage_names

        topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=tdist.get_world_size() // (tp * pp))
        full = None if shard else MemTransformerLM(m).state_dict()    # first: from the freshly seeded RNG
        module, stage = build_pipeline(m, pp, topology=topo,
                                       activation_checkpoint_interval=int(cfg.train.activation_checkpointing))
        if shard:
            inv = {v: k for k, v in single_to_stage_names(m, module).items()}
            init_shard(module, m, cfg.train.seed, lambda n: inv.get(n, n))
        else:
            load_single_state(m, module, full)
        return module, None, stage
    if tp > 1:
        from megamemo.parallel.groups import MCoreMPU
        from megamemo.parallel.shard_init import shard_model
        from megamemo.parallel.tensor import parallelize_tensor

        model = parallelize_tensor(MemTransformerLM(m)) if not shard else shard_model(m, cfg.train.seed)
        model.recompute_layers = cfg.train.activation_checkpointing
        return model, MCoreMPU(), None
    model = MemTransformerLM(m)
    model.recompute_layers = cfg.train.activation_checkpointing
    return model, None, None


def build(cfg: RunConfig, log=print, stop=None, started: float | None = None):
    """Start the process group, take the run directory and build everything a run needs: (trainer, dist env).
    started: when this process started (wall clock; goodput's start-up), default now."""
    from megamemo.runtime import dist
    from megamemo.runtime.rundir import RunDirectory
    from megamemo.runtime.signals import StopRequest

    stop = stop or StopRequest()            # from the start: a signal during start-up stops after step one
    started = time.time() if started is None else started
    de = dist.init(cfg.parallel.collective_timeout_s)
    dp, micro = cfg.layout(de.world_size)
    ranks = parallel_ranks(cfg, de)         # dp/tp/pp ranks; TP and PP ranks of one DP group read the same streams
    run_dir = Path(cfg.train.run_dir)
    rundir = RunDirectory(run_dir, de.rank, cfg.train.lock_stale_s, log=log)
    rundir.open(dist.broadcast)             # one trainer per run directory
    try:
        trainer = _build(cfg, de, dp, micro, ranks, run_dir, stop, log, started)
    except BaseException:
        rundir.close()
        raise
    trainer.rundir = rundir
    from megamemo.runtime.watchdog import Watchdog
    trainer.watchdog = Watchdog(run_dir, de.rank, de.world_size, cfg.train.hang_timeout_s, cfg.train.hang_floor_s)
    return trainer, de


def _build(cfg: RunConfig, de, dp: int, micro: int, ranks: dict, run_dir: Path, stop, log, started: float):
    from megamemo.checkpoint.store import CheckpointStore
    from megamemo.model.flops import flops_per_token, model_flops_per_token
    from megamemo.runtime.peak import device_peak, format_flops
    from megamemo.runtime import dist
    from megamemo.runtime.device import tf32_state
    from megamemo.train.data import bytes_per_token, open_reader, unit_for
    from megamemo.train.engine import Engine
    from megamemo.train.loop import Trainer
    from megamemo.runtime import rss
    from megamemo.runtime.interruptions import restart_count
    from megamemo.train.metrics import Metrics
    from megamemo.train.validate import Evaluator, PipelineEvaluator, eval_lengths

    dp_rank = ranks["dp_rank"]

    meta = {"model": cfg.model.to_dict(), "model_fingerprint": cfg.model_fingerprint(),
            "layout": {"world_size": de.world_size, "dp": dp, "tp": cfg.parallel.tp, "pp": cfg.parallel.pp,
                       "batch_size": cfg.data.batch_size, "grad_accum": cfg.train.grad_accum,
                       "zero_stage": cfg.parallel.zero_stage},
            "precision": cfg.precision.dtype, "dropout_masks": cfg.train.dropout_masks}
    store = CheckpointStore(run_dir / "checkpoints", de.rank, de.world_size, cfg.checkpoint.keep_last, meta,
                            barrier=dist.barrier, async_save=cfg.checkpoint.async_save,
                            commit_timeout_s=cfg.checkpoint.commit_timeout_s, log=log)
    resume_dir = store.select(cfg.checkpoint.resume)        # collective: the newest that verifies
    if resume_dir is not None and cfg.n_token_auto:         # the checkpoint's padded tables, under any layout
        from megamemo.checkpoint.store import read_marker
        from megamemo.train.vocab import adopt_checkpoint_vocab
        said = adopt_checkpoint_vocab(cfg, read_marker(resume_dir).get("model") or {})
        if said:
            meta.update(model=cfg.model.to_dict(), model_fingerprint=cfg.model_fingerprint())
            if de.rank == 0:
                log(f"[train] {said}")
    start_step = 0
    if resume_dir is not None:
        start_step = int(store.check_compatible(resume_dir)[0]["step"])
    if de.rank == 0:
        for p in store.remove_incomplete():
            log(f"[checkpoint] removed {p}: an interrupted save, never committed")
    dist.barrier()
    rss.mark("started")                     # imports and the process group: the baseline (MEGAMEMO_RSS_REPORT)
    seed_default_streams(cfg.train.seed)    # identical initial weights on every rank
    model, mpu, stage = build_model(cfg)
    engine = Engine(cfg, model, micro, dp, mpu=mpu)
    from megamemo.train.speedups import apply_speedups
    # CPU kernels (train.kernels), dropout masks (train.dropout_masks: keyed ones are told each micro-batch's first
    # global column), the attention form (model.attention) and compiled layers (train.compile)
    per_rank = cfg.data.batch_size // dp
    first = dp_rank * per_rank
    speed = apply_speedups(cfg, model, engine.device, micro, log if de.rank == 0 else (lambda *a, **k: None),
                           tp_rank=ranks["tp_rank"], columns=[first + k * micro for k in range(cfg.train.grad_accum)])
    if stage is not None:
        stage.dropout_key = speed["dropout_key"]        # the stage's pipe layers tell it their micro-batch
    rss.mark("built")
    if getattr(engine.device, "type", str(engine.device)) == "cuda" and hasattr(model, "check_inputs"):
        model.check_inputs = False          # ids were checked against the manifest's vocabulary at start-up; on a
                                            # GPU the per-batch range check would cost a host sync every micro-batch
    # then each rank its dropout streams: the default one per (dp, pp), shared by the TP ranks of the group
    # (replicated activations); under model parallelism a TP stream per rank (parallel.groups.dropout_seeds)
    from megamemo.train.loop import seed_streams
    seed_streams(cfg, ranks, engine.device)

    reader = open_reader(cfg, cfg.data.split, cfg.data.batch_size, cfg.model.tgt_len, dp, dp_rank, train=True)
    rank_extra = {"layout": {"rank": de.rank, "world_size": de.world_size, "dp_rank": dp_rank, "dp": dp,
                             "tp_rank": ranks["tp_rank"], "tp": cfg.parallel.tp, "pp_rank": ranks["pp_rank"],
                             "pp": cfg.parallel.pp,
                             "columns": [first, first + per_rank],
                             "micro_batches": [[first + k * micro, first + (k + 1) * micro]
                                               for k in range(cfg.train.grad_accum)]}}
    peak = device_peak(engine.device, cfg.precision.dtype)               # for HFU and MFU (model/flops.py)
    fpt, mfpt = flops_per_token(cfg.model, micro), model_flops_per_token(cfg.model)
    metrics = Metrics(run_dir, enabled=de.rank == 0, every=cfg.log.every, unit=unit_for(cfg),
                      tensorboard=cfg.log.tensorboard, start_step=start_step, config_yaml=cfg.to_yaml(),
                      flops_per_token=fpt, model_flops_per_token=mfpt, peak_flops=peak.flops,
                      world_size=de.world_size,
                      bytes_per_token=bytes_per_token(cfg), splits=(cfg.data.split, cfg.eval.split),
                      start={"time": round(started, 3), "step": start_step, "world_size": de.world_size,
                             "restart": restart_count()})
    evaluator = None
    if cfg.eval.every:
        L = eval_lengths(cfg)
        make_reader = lambda: open_reader(cfg, cfg.eval.split, cfg.eval.batch_size, L["tgt_len"], dp,  # noqa: E731
                                          dp_rank, train=False)
        if stage is None:
            evaluator = Evaluator(cfg, make_reader, lambda: engine.module, engine.device, de.world_size, metrics)
        else:
            evaluator = PipelineEvaluator(cfg, make_reader, lambda: engine.ds, stage, engine.device, de.world_size,
                                          metrics)
    trainer = Trainer(cfg, engine, reader, rank=de.rank, world_size=de.world_size, micro_batch=micro,
                      metrics=metrics, store=store, evaluator=evaluator, stop=stop, rank_extra=rank_extra,
                      stage=stage, dropout_key=speed["dropout_key"])
    trainer.speed = speed
    if resume_dir is not None:
        trainer.resume(resume_dir)
    if de.rank == 0:
        n_param = sum(p.numel() for p in model.parameters())
        log(f"[train] {cfg.model.variant} {n_param / 1e6:.2f}M params | world {de.world_size} ({de.launcher}) | "
            f"dp {dp} x {cfg.train.grad_accum} micro-batches of {micro} streams | {cfg.precision.dtype} | "
            f"{tf32_state()} | "
            f"ZeRO {cfg.parallel.zero_stage}{engine.reduction()} | {speed['kernels']} kernels | "
            f"{cfg.train.dropout_masks} dropout masks | "
            f"{speed['attention']} attention | {'compiled layers' if speed['compiled'] else 'eager layers'} | "
            f"run dir {run_dir} | "
            + (f"resuming at step {trainer.step}" if resume_dir else "fresh start")
            + f" | {format_flops(fpt)}/token executed (HFU), {format_flops(mfpt)}/token model (MFU), "
              f"peak {peak.source}")
    return trainer


def main(argv: list[str]) -> int:
    from megamemo.runtime.dist import launcher_rank_size
    from megamemo.runtime.rundir import die_with_parent, leave_without_finalizing, peer_lost, report, tear_down
    from megamemo.runtime.signals import StopRequest

    stop = StopRequest()                    # first: a stop signal held since the process started is handled now
    die_with_parent()                       # a worker never outlives its launcher
    from megamemo.runtime.goodput import process_started
    started = process_started()
    args = parse_args(argv)
    # (DeepSpeed's deprecation warning of every step is filtered by the entry point: megamemo/runtime/quiet.py)
    from megamemo.runtime import device

    (rank, size), trainer, expected = launcher_rank_size(), None, anticipated_errors()
    world = size or 1
    starting = True                         # until training runs, every rank meets the same errors
    lost = None                             # the exit code when a peer is gone
    try:
        cfg = resolve_config(args)
        from megamemo.runtime.interruptions import announce_run_dir
        announce_run_dir(cfg.train.run_dir, rank)   # to a supervisor that restarts failed runs (launch/)
        device.resolve()                    # cuda or cpu, before DeepSpeed picks its accelerator
        from megamemo.train.data import check_data_dir
        check_data_dir(cfg)
        if cfg.train.deterministic:
            device.make_deterministic()
        device.set_tf32(cfg.precision.allow_tf32 and cfg.precision.dtype == "fp32")
        if cfg.precision.dtype != "fp32":
            from megamemo.train.engine import check_precision
            check_precision(cfg.precision.dtype)
        from megamemo.runtime import dist

        t0 = time.time()
        trainer, de = build(cfg, stop=stop, started=started)
        rank, world, starting = de.rank, de.world_size, False
        outcome = trainer.run()
        trainer.metrics.end(trainer.step, outcome)
        trainer.metrics.close()
        from megamemo.runtime import rss
        rss.write(de.rank)
        if de.rank == 0:
            compiled = ""
            if trainer.speed["compiled"] or trainer.speed["attention"] == "flex":
                from megamemo.kernels.compiler import compile_stats
                compiled = ", {graphs} graphs compiled ({recompiles} recompiles)".format(**compile_stats())
            print(f"[train] {outcome} at step {trainer.step} ({time.time() - t0:.1f}s{compiled})", flush=True)
            from megamemo.runtime import goodput
            g = goodput.of_run(Path(cfg.train.run_dir))
            if g is not None:
                print(f"[train] {goodput.describe(g)}", flush=True)
            import torch
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                print(f"[train] peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB "
                      f"(torch.cuda.max_memory_allocated, rank 0)", flush=True)
        dist.barrier()
        dist.shutdown()
        return 0
    except expected as e:
        # while starting every rank meets the same error (but its node's devices): rank 0 says it; in training it
        # is this rank's own
        from megamemo.train.loop import DivergedError
        everyone = (starting and not isinstance(e, device.DeviceError)) or getattr(e, "same_on_every_rank", False)
        return report(e, rank, everyone=everyone, world_size=world, code=1 if isinstance(e, DivergedError) else 2)
    except RuntimeError as e:
        lost = peer_lost(e)
        if lost is None:
            raise
        return lost
    finally:
        tear_down(trainer)                  # on every path: no thread mid-write, the lock freed, the group destroyed
        stop.restore()                      # the caller's handlers back (main called in-process: tests, notebooks)
        if lost is not None:                # gloo's worker threads may still hold work: no interpreter shutdown
            leave_without_finalizing(lost)


def anticipated_errors() -> tuple[type[BaseException], ...]:
    """Errors megamemo explains in one line (bad config, data, shard, checkpoint, a locked run directory, a
    diverged run); anything else is a bug and shows its traceback."""
    from data_pipeline import ManifestError, ShardError
    from megamemo.runtime.lock import RunLockedError
    from megamemo.checkpoint.pieces import PieceError
    from megamemo.checkpoint.store import CheckpointError
    from megamemo.train.data import DataError
    from megamemo.runtime.device import DeviceError
    from megamemo.train.loop import DivergedError

    return (ConfigError, DataError, CheckpointError, PieceError, RunLockedError, ShardError, ManifestError,
            DivergedError, DeviceError)

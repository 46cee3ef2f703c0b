"""The layout-free training checkpoint: `megamemo convert relayout` writes it from a checkpoint of any
(tp, pp, dp) layout; `megamemo train` resumes from it under any other layout.

    NEW_RUN/checkpoints/step_<N>/
        portable/model.safetensors    fp32 master weights, single-device names
        portable/optim.safetensors    Adam moments, full tensors: exp_avg/<name>, exp_avg_sq/<name> (fp32)
        portable/memory.safetensors   memory of every global stream [M, B, ...] (TP heads and PP stages joined)
        portable/state.json           step, data cursor (global position), counters, Adam step and hyper-
                                      parameters, LR scheduler, DeepSpeed's counters, loss scale, source layout
        megamemo/probe.safetensors    the source run's probe, when it recorded one (to-single checks against it)
        COMMITTED                     the usual marker; layout = {"portable": true, "batch_size": B, "source": ...}

Resuming (Trainer.resume -> load_portable), on every rank of the new layout after its engine is built:
  * weights: each local parameter is cut from the full tensor (tensor.py's TP rules; PP stages by name) and
    written into the module and, through DeepSpeed's per-parameter fragment addresses (`_hp_mapping`, the
    mapping its universal checkpoints use), into this rank's ZeRO fp32 partition;
  * Adam: exp_avg / exp_avg_sq fragments the same way, the step count, the LR scheduler's state (and the
    optimizer's current LR from it), DeepSpeed's step/sample counters, the loss scale;
  * data: the reader's position is global (epoch, step), so it loads as is on any number of ranks;
  * memory: rank r's micro-batch k holds global columns [c0, c1) (its layout), so it takes those columns of each
    memory tensor, then its TP head shard (ctx/lse) or its PP stage's tensors;
  * dropout RNG: re-seeded from (seed, dp rank, step): a new layout cannot replay the old ranks' streams.
With the same global batch (data.batch_size) the run continues the same text with the same memory: the next
losses are those the old layout would have computed (tested within 1e-5 in fp32).
A different global batch re-cuts the corpus into other columns: a stream's memory has no counterpart, so the run
starts every stream with empty memory, at the same epoch and the same fraction of it (step * new steps per epoch
// old steps per epoch), as when a new epoch starts. Weights, Adam state and the schedule carry over (the LR
schedule counts optimizer steps, not tokens); a message says so.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megamemo.checkpoint.gather import PROBE_FILE, ConvertError, check_memory, check_shapes, pipe_to_single
from megamemo.checkpoint.store import MARKER, RANK_DIR, CheckpointError, tag_for, verify
from megamemo.model import Memory, ModelConfig

FORMAT, VERSION = "megamemo-portable", 1
SUB = "portable"


def is_portable(step_dir) -> bool:
    try:
        info = json.loads((Path(step_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return bool((info.get("layout") or {}).get("portable"))


# ---- writing -------------------------------------------------------------------------------------------------
def write_portable(ckpt, out_run_dir) -> Path:
    """A TrainingCheckpoint (gather.py) -> OUT/checkpoints/step_N, committed. Written under OUT.tmp and renamed:
    an error leaves nothing at OUT."""
    out = Path(out_run_dir)
    if out.exists():
        raise ConvertError(f"{out}: already exists; refusing to overwrite")
    weights = ckpt.weights()
    opt = ckpt.optimizer()
    for key in ("exp_avg", "exp_avg_sq"):
        if set(opt[key]) != set(weights):
            raise ConvertError(f"{ckpt.dir}: Adam {key} covers {sorted(set(opt[key]) ^ set(weights))} differently "
                               f"from the weights")
    memory = ckpt.memory()
    rank_state = ckpt.rank_state()
    engine = ckpt.engine_state()
    step = int(ckpt.marker["step"])
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    step_dir = tmp / "checkpoints" / tag_for(step)
    try:
        (step_dir / SUB).mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(step_dir / SUB / "model.safetensors"))
        save_file({f"{key}/{k}": v.contiguous() for key in ("exp_avg", "exp_avg_sq") for k, v in opt[key].items()},
                  str(step_dir / SUB / "optim.safetensors"))
        save_file({k: v.contiguous() for k, v in memory.tensors.items()}, str(step_dir / SUB / "memory.safetensors"))
        state = {"format": FORMAT, "version": VERSION, "step": step, "data": rank_state["data"],
                 "counters": rank_state["counters"], "memory_batch_size": memory.batch_size,
                 "adam": {"step": opt["step"], "param_groups": _jsonable(opt["param_groups"])},
                 "engine": _jsonable(engine),
                 "source": {"dir": str(ckpt.dir), "layout": ckpt.layout, "precision": ckpt.precision}}
        (step_dir / SUB / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
        probe = ckpt.dir / PROBE_FILE
        if probe.is_file():
            (step_dir / RANK_DIR).mkdir()
            shutil.copyfile(probe, step_dir / PROBE_FILE)
        files = {str(p.relative_to(step_dir)): p.stat().st_size for p in sorted(step_dir.rglob("*")) if p.is_file()}
        marker = {"format": 1, "step": step, "tag": step_dir.name, "world_size": None,
                  "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files, "model": ckpt.marker["model"],
                  "model_fingerprint": ckpt.marker.get("model_fingerprint"), "precision": ckpt.precision,
                  "layout": {"portable": True, "batch_size": memory.batch_size, "source": ckpt.layout}}
        (step_dir / MARKER).write_text(json.dumps(marker, indent=1, sort_keys=True))
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out / "checkpoints" / tag_for(step)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


# ---- reading (to-single on a portable checkpoint) ------------------------------------------------------------
class PortableCheckpoint:
    def __init__(self, step_dir: Path, marker: dict):
        self.dir, self.marker = Path(step_dir), marker
        self.where = self.dir / MARKER
        self.cfg = ModelConfig.from_dict(marker["model"], where=f"{self.where}:model")
        self.precision = marker.get("precision", "fp32")
        self.layout = marker["layout"]

    def _load(self, name: str) -> dict:
        path = self.dir / SUB / name
        try:
            return load_file(str(path))
        except Exception as e:  # noqa: BLE001
            raise ConvertError(f"{path}: unreadable ({type(e).__name__}: {e})") from None

    def weights(self) -> dict:
        sd = self._load("model.safetensors")
        check_shapes(self.cfg, sd, self.dir / SUB / "model.safetensors")
        return sd

    def memory(self) -> Memory:
        mem = Memory(self._load("memory.safetensors"), batch_size=int(self.layout["batch_size"]))
        check_memory(self.cfg, mem, self.dir / SUB / "memory.safetensors")
        return mem

    def probe(self):
        from megamemo.checkpoint.gather import read_probe
        return read_probe(self.dir)

    def meta(self) -> dict:
        return {"source": str(self.dir), "step": self.marker.get("step"), "layout": self.layout,
                "precision": self.precision, "model_fingerprint": self.marker.get("model_fingerprint")}


# ---- loading into a new layout -------------------------------------------------------------------------------
class _Tensors:
    """A safetensors file read on demand: a rank reads only the full tensors of its own parameters."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        self.file = safe_open(str(path), "pt")
        self.names = set(self.file.keys())

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise CheckpointError(f"{self.path}: no tensor {name}")
        return self.file.get_tensor(name)

    def meta(self) -> dict[str, torch.Tensor]:
        """Shapes only (meta tensors), for the config check."""
        return {k: torch.empty(self.file.get_slice(k).get_shape(), device="meta") for k in self.names}


def _local_names(trainer) -> dict[str, str]:
    """This rank's parameter names -> single-device names."""
    cfg = trainer.cfg.model
    out = {}
    for local, _ in trainer.engine.module.named_parameters():
        out[local] = local if trainer.stage is None else pipe_to_single(cfg, local)
    return out


def _fill_parameters(trainer, weights, moments, adam_step: int, where: Path) -> None:
    from megamemo.parallel.tensor import shard_tensor

    lay = trainer.rank_extra["layout"]
    tp, tp_rank = int(lay.get("tp", 1)), int(lay.get("tp_rank", 0))
    ds = trainer.engine.ds
    opt = ds.optimizer
    names = _local_names(trainer)
    zero = hasattr(opt, "single_partition_of_fp32_groups")
    unfused = {}
    if not zero and hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups"):
        unfused = {id(lp): hp for lg, hg in zip(opt.fp16_groups, opt.fp32_groups) for lp, hp in zip(lg, hg)}
    inner = opt.optimizer if (zero or unfused) else opt
    if not isinstance(inner, torch.optim.Optimizer):
        raise CheckpointError(f"{where}: cannot fill the optimizer state of a {type(opt).__name__}")
    step_t = torch.tensor(float(adam_step), dtype=torch.float32)
    if zero:
        for flat in opt.single_partition_of_fp32_groups:
            inner.state[flat] = {"step": step_t.clone(), "exp_avg": torch.zeros_like(flat),
                                 "exp_avg_sq": torch.zeros_like(flat)}
    with torch.no_grad():
        for local, p in trainer.engine.module.named_parameters():
            single = names[local]
            if single not in weights:
                raise CheckpointError(f"{where}: no weight {single} (for this rank's {local})")
            full = {"w": weights[single], "exp_avg": moments[f"exp_avg/{single}"],
                    "exp_avg_sq": moments[f"exp_avg_sq/{single}"]}
            local_t = {k: shard_tensor(single, v, tp_rank, tp) for k, v in full.items()}
            if tuple(local_t["w"].shape) != tuple(p.shape):
                raise CheckpointError(f"{where}: {single} cut for tp rank {tp_rank}/{tp} is "
                                      f"{list(local_t['w'].shape)}, this rank's {local} is {list(p.shape)}")
            p.data.copy_(local_t["w"].to(p.dtype))
            if zero:
                hm = getattr(p, "_hp_mapping", None)
                if hm is None:                  # not in this DP rank's partition
                    continue
                lp, hp = hm.lp_fragment_address, hm.hp_fragment_address
                flat = opt.single_partition_of_fp32_groups[hm.param_group_index]
                targets = {"w": flat.data, **{k: inner.state[flat][k] for k in ("exp_avg", "exp_avg_sq")}}
                for k, t in targets.items():
                    t.narrow(0, hp.start, hp.numel).copy_(local_t[k].float().reshape(-1)[lp.start:lp.start + lp.numel])
            else:
                hp = unfused.get(id(p), p)
                if hp is not p:
                    hp.data.copy_(local_t["w"].float())
                inner.state[hp] = {"step": step_t.clone(), "exp_avg": local_t["exp_avg"].to(hp.dtype).clone(),
                                   "exp_avg_sq": local_t["exp_avg_sq"].to(hp.dtype).clone()}


def _fill_engine_state(trainer, engine_state: dict) -> None:
    ds = trainer.engine.ds
    sched = ds.lr_scheduler
    if sched is not None and engine_state.get("lr_scheduler"):
        sched.load_state_dict(engine_state["lr_scheduler"])
        for g, lr in zip(sched.optimizer.param_groups, sched.get_last_lr()):
            g["lr"] = lr
    for key in ("global_steps", "global_samples", "skipped_steps"):
        if engine_state.get(key) is not None:
            setattr(ds, key, int(engine_state[key]))
    scaler = getattr(ds.optimizer, "loss_scaler", None)
    for k, v in (engine_state.get("loss_scaler") or {}).items():
        if scaler is not None and hasattr(scaler, k) and getattr(scaler, "dynamic", False):
            setattr(scaler, k, v)


def _steps_per_epoch(n_tokens: int, batch_size: int, tgt_len: int) -> int:
    n_step = n_tokens // batch_size
    return (n_step - 1 + tgt_len - 1) // tgt_len


def _fill_data_and_memory(trainer, state: dict, memory: dict, where: Path, log) -> None:
    cfg = trainer.cfg
    lay = trainer.rank_extra["layout"]
    data = dict(state["data"])
    same_batch = int(data["batch_size"]) == cfg.data.batch_size
    try:
        if same_batch:
            trainer.cursor.load_state_dict(data)
        else:
            old = _steps_per_epoch(int(data["n_tokens"]), int(data["batch_size"]), int(data["tgt_len"]))
            new_state = trainer.reader.state_dict()
            new_spe = trainer.reader.steps_per_epoch
            step = int(data["step"]) * new_spe // max(1, old)
            check = {**data, "batch_size": cfg.data.batch_size, "world_size": new_state["world_size"],
                     "rank": new_state["rank"], "epoch": int(data["epoch"]), "step": step}
            trainer.cursor.load_state_dict(check)
            log(f"[checkpoint] global batch {data['batch_size']} -> {cfg.data.batch_size} streams: the corpus is "
                f"re-cut into other columns, so every stream starts with empty memory, at epoch {data['epoch']} "
                f"step {step}/{new_spe} (was step {data['step']}/{old})")
    except ValueError as e:
        raise CheckpointError(f"{where}: the data cursor does not fit this run's reader: {e}") from None
    from megamemo.parallel.tensor import shard_memory_tensors

    tp, tp_rank = int(lay.get("tp", 1)), int(lay.get("tp_rank", 0))
    dtype = next(trainer.engine.module.parameters()).dtype
    parts = {}
    for k, (c0, c1) in enumerate(lay["micro_batches"]):
        part = {n: t[:, c0:c1] for n, t in memory.items()} if same_batch else {}
        part = shard_memory_tensors(part, tp_rank, tp)
        part = {n: (t if n.startswith("lse.") or not t.is_floating_point() else t.to(dtype)).contiguous()
                for n, t in part.items()}
        parts[k] = (part, c1 - c0)
    if trainer.stage is None:
        trainer.memory.load_state_dict({f"mb{k}": Memory(p, batch_size=b).state_dict() for k, (p, b) in parts.items()})
    else:
        from megamemo.checkpoint.gather import stage_memory_names
        pp, stage = int(lay.get("pp", 1)), int(lay.get("pp_rank", 0))
        bank = {}
        for k, (p, _) in parts.items():
            for n in stage_memory_names(cfg.model, pp, stage, p):
                bank[f"mb{k}/{n}"] = p[n].to(trainer.engine.device)
        trainer.stage.bank.load_state_dict(bank)


def _reseed(trainer, step: int) -> None:
    import numpy as np

    from megamemo.checkpoint.state import _tp_rng_tracker

    lay = trainer.rank_extra["layout"]
    seed = trainer.cfg.train.seed + 1 + int(lay.get("dp_rank", 0)) + 1_000_003 * step
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if _tp_rng_tracker() is not None:
        from megamemo.parallel.groups import install_rng_tracker
        install_rng_tracker(seed)


def load_portable(trainer, step_dir: Path, log=print) -> dict:
    """Resume `trainer` (any layout) from a layout-free checkpoint. Every rank reads the full tensors."""
    step_dir = Path(step_dir)
    info = trainer.store.check_compatible(step_dir) if trainer.store is not None else verify(step_dir)
    sub = step_dir / SUB
    try:
        state = json.loads((sub / "state.json").read_text())
        weights = _Tensors(sub / "model.safetensors")
        moments = _Tensors(sub / "optim.safetensors")
        memory = load_file(str(sub / "memory.safetensors"))
    except Exception as e:  # noqa: BLE001 - name the directory
        raise CheckpointError(f"{sub}: unreadable layout-free checkpoint ({type(e).__name__}: {e})") from None
    if state.get("format") != FORMAT or state.get("version") != VERSION:
        raise CheckpointError(f"{sub / 'state.json'}: format {state.get('format')!r} v{state.get('version')}, "
                              f"expected {FORMAT} v{VERSION}")
    cfg_model = ModelConfig.from_dict(info["model"], where=f"{step_dir / MARKER}:model")
    try:
        check_shapes(cfg_model, weights.meta(), sub / "model.safetensors")
    except ConvertError as e:
        raise CheckpointError(str(e)) from None
    _fill_parameters(trainer, weights, moments, int(state["adam"]["step"]), sub)
    _fill_engine_state(trainer, state.get("engine") or {})
    _fill_data_and_memory(trainer, state, memory, sub, log if trainer.rank == 0 else (lambda *a, **k: None))
    trainer.counters.load_state_dict(state["counters"])
    _reseed(trainer, int(state["step"]))
    if trainer.rank == 0:
        src = state.get("source", {}).get("layout", {})
        lay = trainer.rank_extra["layout"]
        log(f"[checkpoint] layout-free checkpoint {step_dir} (from tp={src.get('tp')} pp={src.get('pp')} "
            f"dp={src.get('dp')}) loaded into tp={lay.get('tp')} pp={lay.get('pp')} dp={lay.get('dp')}", flush=True)
    return {"marker": info, "rank": {"state": {"counters": state["counters"]}}}

"""What a training run hands the checkpointer: the DeepSpeed engine, the recurrence memory and the data cursor as
stateful objects that speak the layout-free description (megamemo/checkpoint/pieces.py).

  EngineState   weights (`model/<name>`, the module's dtype), fp32 masters (`master/<name>`, bf16/fp16 runs),
                Adam moments (`exp_avg/<name>`, `exp_avg_sq/<name>`): a rank writes its TP shard (what every DP
                rank holds, by one DP rank each: pieces.spread_writers) and, under ZeRO 1/2, the fragments of its
                flat partitions; what other ranks hold identically is written once (replicated parameters by TP rank 0,
                tied copies by the first pipeline stage). The LR schedule, DeepSpeed's step
                counters, the loss scale and Adam's step count go to JSON. On load every rank cuts what it needs
                from whatever layout wrote the pieces, and fills DeepSpeed's own objects: module parameters, the ZeRO
                fp32 partitions through DeepSpeed's per-parameter fragment addresses (`_hp_mapping`, the mapping its
                universal checkpoints use), the torch optimizer's state, the LR scheduler and counters.
  MemoryState   each micro-batch's memory as pieces of global [M, B, ...] tensors (its streams' columns; the per-head
                caches by head). A different global batch re-cuts the corpus into other streams: memory restarts empty.
  DataCursor    the reader position that matches the committed memory (global: any number of ranks loads it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megamemo.checkpoint.layout import RankLayout
from megamemo.checkpoint.pieces import Piece, spread_writers
from megamemo.checkpoint.state import LoadContext
from megamemo.checkpoint.store import CheckpointError
from megamemo.data.stream import steps_per_epoch
from megamemo.parallel.tensor import global_box, is_split, memory_box, memory_is_split

MOMENTS = ("exp_avg", "exp_avg_sq")
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    return x


class EngineState:
    """A Stateful (JSON: schedule, counters, loss scale, Adam step) and a sharded one (tensors) for DeepSpeed."""

    def __init__(
        self, engine, name_of: Callable[[str], str], layout: RankLayout, owns: Callable[[str], bool], precision: str
    ):
        self.engine, self.name_of, self.owns, self.precision = engine, name_of, owns, precision
        self.dp_rank, self.tp_rank, self.tp, self.dp = layout.dp_rank, layout.tp_rank, layout.tp, layout.dp
        self._adam_step = 0

    # ---- DeepSpeed's optimizer kinds ---------------------------------------------------------------------
    def _optimizer(self):
        """(kind, inner torch optimizer, flat fp32 partitions | lp->hp map): "zero" (ZeRO 1/2, BF16_Optimizer),
        "unfused" (fp16/bf16 without ZeRO: an fp32 master per parameter), "plain" (fp32 without ZeRO)."""
        opt = self.engine.ds.optimizer
        flats = getattr(opt, "single_partition_of_fp32_groups", None) or getattr(
            opt, "fp32_groups_flat_partition", None
        )
        if flats is not None:
            return "zero", opt.optimizer, flats
        if hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups"):
            return (
                "unfused",
                opt.optimizer,
                {
                    id(lp): hp
                    for lg, hg in zip(opt.fp16_groups, opt.fp32_groups, strict=True)
                    for lp, hp in zip(lg, hg, strict=True)
                },
            )
        if isinstance(opt, torch.optim.Optimizer):
            return "plain", opt, {}
        raise CheckpointError(f"cannot save or restore the state of a {type(opt).__name__} optimizer")

    def _scalers(self):
        opt = self.engine.ds.optimizer
        return [
            s
            for s in (getattr(opt, "loss_scaler", None), getattr(opt, "loss_scale_config", None))
            if s is not None and getattr(s, "dynamic", getattr(s, "dynamic_loss_scale", False))
        ]

    # ---- JSON --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        ds = self.engine.ds
        _, inner, _ = self._optimizer()
        steps = {int(st["step"]) for st in inner.state.values() if "step" in st}
        if len(steps) > 1:
            raise CheckpointError(f"Adam step counts differ between parameters: {sorted(steps)}")
        return {
            "global_steps": int(ds.global_steps),
            "global_samples": int(ds.global_samples),
            "skipped_steps": int(ds.skipped_steps),
            "adam_step": steps.pop() if steps else 0,
            "lr_scheduler": _jsonable(ds.lr_scheduler.state_dict()) if ds.lr_scheduler is not None else None,
            "loss_scaler": [
                {k: _jsonable(getattr(s, k)) for k in SCALER_FIELDS if hasattr(s, k)} for s in self._scalers()
            ],
        }

    def load_state_dict(self, d: dict) -> None:
        ds = self.engine.ds
        if ds.lr_scheduler is not None and d.get("lr_scheduler"):
            ds.lr_scheduler.load_state_dict(d["lr_scheduler"])
            for group, lr in zip(ds.lr_scheduler.optimizer.param_groups, ds.lr_scheduler.get_last_lr(), strict=True):
                group["lr"] = lr
        ds.global_steps, ds.global_samples = int(d["global_steps"]), int(d["global_samples"])
        ds.skipped_steps = int(d["skipped_steps"])
        for scaler, saved in zip(self._scalers(), d.get("loss_scaler") or [], strict=False):
            for k, v in saved.items():
                setattr(scaler, k, v)
        self._adam_step = int(d.get("adam_step", 0))

    # ---- tensors -----------------------------------------------------------------------------------------
    def _params(self):
        for local, p in self.engine.module.named_parameters():
            single = self.name_of(local)
            yield single, p, global_box(single, p.shape, self.tp_rank, self.tp)

    def pieces(self) -> list[Piece]:
        kind, inner, extra = self._optimizer()
        mixed = self.precision != "fp32"
        mine = [
            (single, p, boxes)
            for single, p, boxes in self._params()
            if self.owns(single) and (self.tp_rank == 0 or is_split(single))
        ]  # else another stage / TP rank's
        writer = spread_writers({single: p.numel() for single, p, _ in mine}, self.dp)  # DP ranks hold them alike
        out = []
        for single, p, (shape, box, view) in mine:
            if writer[single] == self.dp_rank:
                out.append(Piece(f"model/{single}", p.detach().reshape(view), shape, box))
            if kind == "zero":
                hm = getattr(p, "_hp_mapping", None)
                if hm is None:  # none of this parameter in this rank's partition
                    continue
                flat, (lo, n) = (
                    extra[hm.param_group_index],
                    (hm.lp_fragment_address.start, hm.lp_fragment_address.numel),
                )
                start, rng = hm.hp_fragment_address.start, (lo, lo + n)
                if mixed:
                    out.append(Piece(f"master/{single}", flat.detach().narrow(0, start, n), shape, box, rng))
                for key, t in inner.state.get(flat, {}).items():
                    if key in MOMENTS:
                        out.append(Piece(f"{key}/{single}", t.narrow(0, start, n), shape, box, rng))
            elif writer[single] == self.dp_rank:  # without ZeRO every data-parallel rank holds the same state
                hp = extra.get(id(p), p)
                if mixed:
                    out.append(Piece(f"master/{single}", hp.detach().reshape(view), shape, box))
                for key, t in inner.state.get(hp, {}).items():
                    if key in MOMENTS:
                        out.append(Piece(f"{key}/{single}", t.reshape(view), shape, box))
        return out

    def load_pieces(self, ctx: LoadContext) -> None:
        reader = ctx.reader
        kind, inner, extra = self._optimizer()
        same_precision = ctx.saved.precision == self.precision
        moments = self._adam_step > 0 and bool(reader.names("exp_avg/"))
        fused = step_on_param_device(inner.param_groups)

        def step_tensor(device):
            return adam_step_tensor(self._adam_step, device, fused)

        filled = set()
        with torch.no_grad():
            for single, p, (shape, box, _view) in self._params():
                name = f"model/{single}"
                if name not in reader or reader.shape(name) != shape:
                    raise CheckpointError(
                        f"{ctx.tag}: {name} is "
                        f"{list(reader.shape(name)) if name in reader else 'missing'} in the "
                        f"checkpoint, this run's model needs {list(shape)}"
                    )
                master = f"master/{single}" if f"master/{single}" in reader else name
                p.copy_(reader.read(name if same_precision else master, box).reshape(p.shape).to(p.dtype))
                if kind == "zero":
                    hm = getattr(p, "_hp_mapping", None)
                    if hm is None:
                        continue
                    flat = extra[hm.param_group_index]
                    lo, n, start = (
                        hm.lp_fragment_address.start,
                        hm.lp_fragment_address.numel,
                        hm.hp_fragment_address.start,
                    )
                    flat.data.narrow(0, start, n).copy_(reader.read(master, box, (lo, lo + n)).float())
                    if moments:
                        if id(flat) not in filled:
                            inner.state[flat] = {
                                "step": step_tensor(flat.device),
                                **{k: torch.zeros_like(flat) for k in MOMENTS},
                            }
                            filled.add(id(flat))
                        for k in MOMENTS:
                            inner.state[flat][k].narrow(0, start, n).copy_(
                                reader.read(f"{k}/{single}", box, (lo, lo + n)).float()
                            )
                else:
                    hp = extra.get(id(p), p)
                    if hp is not p:
                        hp.copy_(reader.read(master, box).reshape(hp.shape).float())
                    if moments:
                        inner.state[hp] = {
                            "step": step_tensor(hp.device),
                            **{
                                k: reader.read(f"{k}/{single}", box)
                                .reshape(hp.shape)
                                .to(hp.dtype)
                                .to(hp.device)
                                .clone()
                                for k in MOMENTS
                            },
                        }


def step_on_param_device(param_groups) -> bool:
    """Whether torch's Adam keeps `step` on the parameters' device for these groups (fused or capturable)."""
    return any(g.get("fused") or g.get("capturable") for g in param_groups)


def adam_step_tensor(step: int, device, fused: bool) -> torch.Tensor:
    """Adam's step count where torch's Adam keeps it: on the parameter's device for fused / capturable groups
    (on a GPU, a CPU step there fails), else a CPU scalar; float32 either way."""
    return torch.tensor(float(step), dtype=torch.float32, device=device if fused else "cpu")


class MemoryState:
    """Each micro-batch's memory (this rank's streams, its heads, its stage's tensors) as global-tensor pieces.
    get() -> {micro-batch: {name: tensor [M, b, ...]}}; set(same) replaces it."""

    def __init__(self, get, set_, layout: RankLayout, batch_size: int, names: list[str], device, dtype: torch.dtype):
        self.get, self.set = get, set_
        self.columns, self.batch_size = layout.micro_batches, batch_size
        self.tp_rank, self.tp = layout.tp_rank, layout.tp
        self.names, self.device, self.dtype = names, device, dtype

    def pieces(self) -> list[Piece]:
        out = []
        for k, tensors in self.get().items():
            for name, t in tensors.items():
                if t.size(0) == 0 or (not memory_is_split(name) and self.tp_rank != 0):
                    continue
                shape, box = memory_box(name, t.shape, self.columns[k][0], self.batch_size, self.tp_rank, self.tp)
                out.append(Piece(f"memory/{name}", t, shape, box))
        return out

    def load_pieces(self, ctx: LoadContext) -> None:
        saved = ctx.saved.layout.batch_size
        present = [n for n in self.names if f"memory/{n}" in ctx.reader]
        if saved != self.batch_size or not present:
            self.set({})  # another cut of the corpus (said by the store), or empty memory saved
            return
        if len(present) != len(self.names):
            raise CheckpointError(f"{ctx.tag}: memory holds {present}, this rank needs {self.names}")
        out: dict[int, dict] = {}
        for k, (c0, c1) in enumerate(self.columns):
            out[k] = {}
            for name in self.names:
                shape = ctx.reader.shape(f"memory/{name}")
                local = (shape[0], c1 - c0, *shape[2:])
                if memory_is_split(name):
                    local = (*local[:2], shape[2] // self.tp, *local[3:])
                _, box = memory_box(name, local, c0, self.batch_size, self.tp_rank, self.tp)
                t = ctx.reader.read(f"memory/{name}", box)
                out[k][name] = t.to(self.device, torch.float32 if name.startswith("lse.") else self.dtype)
        self.set(out)


class DataCursor:
    """The reader position that matches the committed memory (a Stateful). The reader itself may be ahead by
    one batch while a skipped step is retried; the checkpoint holds the position before that batch. A position
    saved with another global batch is moved to the same fraction of the same epoch (memory restarts empty)."""

    def __init__(self, reader, log=print):
        self.reader = reader
        self.state = reader.state_dict()
        self._it = None
        self.log = log

    def next_batch(self):
        if self._it is None:
            self._it = iter(self.reader)
        return next(self._it)

    def advance(self) -> None:
        """The batch just taken was trained on: the committed position moves past it."""
        self.state = self.reader.state_dict()

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, d: dict) -> None:
        d = dict(d)
        mine = self.reader.state_dict()
        if int(d["batch_size"]) != mine["batch_size"] and d.get("kind") == "blend":
            d.update(batch_size=mine["batch_size"])  # a blend's columns do not depend on the batch: same step
        elif int(d["batch_size"]) != mine["batch_size"]:
            old = steps_per_epoch(int(d["n_tokens"]), int(d["batch_size"]), int(d["tgt_len"]))
            step = int(d["step"]) * self.reader.steps_per_epoch // max(1, old)
            self.log(
                f"[checkpoint] the data position moves to epoch {d['epoch']} step {step}/"
                f"{self.reader.steps_per_epoch} of the new cut (was step {d['step']}/{old})"
            )
            d.update(batch_size=mine["batch_size"], step=step)
        try:
            self.reader.load_state_dict({**d, "world_size": mine["world_size"], "rank": mine["rank"]})
        except ValueError as e:
            raise CheckpointError(f"the data cursor does not fit this run's reader: {e}") from None
        self.state = self.reader.state_dict()
        self._it = None

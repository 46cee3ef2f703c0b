"""The training loop: per-micro-batch memory, steps that commit memory only when applied, checkpoints, stops.

One step on one rank:
    batch = this rank's B/W streams, [tgt_len, B/W] (the data reader), cut into grad_accum micro-batches of
            contiguous columns; micro-batch k always holds the same streams, so it has its own memory mem[k]
    for k: nll, new[k] = model(input_k, target_k, mem[k]); backward(mean nll)      (DeepSpeed averages over
                                                                                   micro-batches and ranks;
           keyed dropout masks are told the step and k first: megamemo/kernels/keyed.py DropoutKey)
    engine step: clip, Adam, schedule (or skip on fp16 overflow)
    applied  -> mem = new, the data cursor moves past the batch, step += 1
    skipped  -> nothing moves: the same batch is retried with the lowered loss scale, from the same memory
The loss reported for a step is the mean NLL over the global batch (all ranks, all micro-batches).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megamemo.checkpoint.faults import FaultPoints
from megamemo.checkpoint.layout import RankLayout
from megamemo.checkpoint.replicas import ReplicaRecord
from megamemo.checkpoint.state import Counters, RNGState, StateRegistry
from megamemo.checkpoint.store import CheckpointStore
from megamemo.kernels.compiler import run_eagerly
from megamemo.model import Memory, MemTransformerLM
from megamemo.parallel.groups import seed_rng_streams
from megamemo.parallel.pipeline import pipe_to_single, stage_input, stage_memory_names, stage_owns
from megamemo.runtime.rundir import RunDirectory
from megamemo.runtime.signals import StopRequest
from megamemo.runtime.watchdog import Watchdog
from megamemo.train.config import RunConfig
from megamemo.train.metrics import Metrics
from megamemo.train.numerics import ReplicaCheck, ReplicaMismatch, SpikeWatch
from megamemo.train.probe_record import Probe
from megamemo.train.resumable import DataCursor, EngineState, MemoryState
from megamemo.train.rollback import roll_back, skip_plan, spike_records
from megamemo.train.speedups import SpeedChoices


def seed_streams(cfg, ranks: RankLayout, device, step_salt: int = 0) -> tuple[int, int]:
    """Seed this rank's dropout streams, the one place that does it (a fresh start: step_salt 0; a resume under
    another layout: the step): the default streams from (seed, dp, pp, salt), shared by the TP ranks of a group,
    and under model parallelism a TP stream from (seed, dp, pp, tp, salt) (parallel.groups.dropout_seeds).
    ranks: this rank's layout (its dp_rank, tp_rank, pp_rank). Returns the two seeds."""
    return seed_rng_streams(
        cfg.train.seed,
        ranks.dp_rank,
        ranks.tp_rank,
        ranks.pp_rank,
        step_salt=step_salt,
        tp_stream=cfg.parallel.tp * cfg.parallel.pp > 1,
        cuda=getattr(device, "type", str(device)) == "cuda",
    )


class DivergedError(RuntimeError):
    pass


class SpikeStop(DivergedError):
    """A loss spike that stops the run (train.spike): every rank sees the same loss and says the same line."""

    same_on_every_rank = True


class MicroBatchMemories:
    """The committed memory of each micro-batch of this rank (saved through resumable.MemoryState)."""

    def __init__(self, n_micro: int, micro_batch: int, device):
        self.device = device
        self.micro_batch = micro_batch
        self.mems: list[Memory] = [Memory({}, batch_size=micro_batch) for _ in range(n_micro)]

    def tensors(self) -> dict[int, dict[str, torch.Tensor]]:
        return {k: m.tensors for k, m in enumerate(self.mems)}

    def replace(self, tensors: dict[int, dict[str, torch.Tensor]]) -> None:
        self.mems = [Memory(tensors.get(k, {}), batch_size=self.micro_batch) for k in range(len(self.mems))]


@dataclass
class StepResult:
    applied: bool
    loss: float
    stop: bool


@dataclass
class StepSignals:
    """What every rank learns at the end of a step, summed over all ranks in one all-reduce, so that all decide
    alike: the step's summed token NLL (nats) and its tokens (the TP/PP ranks of a data-parallel group count the same
    streams: the ratio is unchanged), whether a stop signal reached some rank, whether a background save failed on
    some rank."""

    loss_sum: float
    tokens: float
    stop: bool
    save_failed: bool

    @classmethod
    def all_reduced(
        cls, loss_sum: torch.Tensor, tokens: int, stop: bool, save_failed: bool, world_size: int
    ) -> StepSignals:
        """loss_sum: float64 on the device. The three host values cross in one copy (from pinned memory on a GPU: no
        host sync; the only one of the step is the .tolist() here)."""
        host = torch.tensor([float(tokens), float(stop), float(save_failed)], dtype=torch.float64)
        if loss_sum.device.type == "cuda":
            host = host.pin_memory()
        signals = torch.cat([loss_sum.reshape(1), host.to(loss_sum.device, non_blocking=True)])
        if world_size > 1:
            dist.all_reduce(signals)
        total, n_tokens, n_stop, n_failed = signals.tolist()
        return cls(total, n_tokens, n_stop > 0, n_failed > 0)


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        engine,
        reader,
        *,
        rank: int,
        world_size: int,
        micro_batch: int,
        metrics: Metrics,
        store: CheckpointStore | None = None,
        evaluator=None,
        stop: StopRequest | None = None,
        layout: RankLayout | None = None,
        stage=None,
        speed: SpeedChoices | None = None,
        rundir: RunDirectory | None = None,
        watchdog: Watchdog | None = None,
    ):
        """layout: this rank's (default: one process's); speed: what apply_speedups chose (its dropout key: keyed
        masks); rundir: the run directory's lock holder (released by runtime/rundir.py tear_down); watchdog: this
        rank's hang detection (runtime/watchdog.py); stage: the pipeline stage (parallel/pipeline.py), or None."""
        self.cfg = cfg
        self.engine = engine
        self.reader = reader
        self.rank = rank
        self.world_size = world_size
        self.micro_batch = micro_batch
        self.n_micro = cfg.train.grad_accum
        self.metrics = metrics
        self.store = store
        self.evaluator = evaluator
        self.stop = stop
        self.layout = layout or RankLayout.single(micro_batch, cfg.train.grad_accum)
        self.speed = speed
        self.loss_factor = 0.5 if cfg.optim.half_loss else 1.0
        self.stage = stage  # pipeline parallel: the memory lives in this stage's bank, per micro-batch
        self.dropout_key = speed.dropout_key if speed is not None else None  # keyed masks: their step, micro-batch
        self.memory = MicroBatchMemories(self.n_micro, micro_batch, engine.device) if stage is None else stage.bank
        self.model_parallel = cfg.parallel.tp * cfg.parallel.pp  # ranks that hold the same streams
        self.cursor = DataCursor(reader, log=print if rank == 0 else (lambda *a, **k: None))
        self.counters = Counters(step=0, skipped=0, tokens=0, spike_window=[])
        self.registry = StateRegistry()
        engine_state = self._engine_state()
        self.registry.register("engine", engine_state)
        self.registry.register_sharded("engine-tensors", engine_state)
        self.registry.register_sharded("memory", self._memory_state())
        self.registry.register("data", self.cursor)
        self.registry.register("rng", RNGState(), scope="rank")
        self.registry.register("counters", self.counters)
        self._held: tuple[torch.Tensor, torch.Tensor] | None = None  # a skipped step's batch: retried next
        self.started = False  # a step was applied in this process (errors are then this rank's own)
        self.rundir = rundir
        self.watchdog = watchdog
        self.faults = FaultPoints(rank)  # injected crashes: tests and bench/soak.py only (checkpoint/faults.py)
        self._consecutive_skips = 0
        self._scale_before = engine.loss_scale()
        # numerics (train/numerics.py, train/rollback.py): the replicas' agreement, loss spikes and their rollbacks
        self.replicas = ReplicaCheck(engine, self.layout, rank, world_size)
        self._agreed: ReplicaRecord | None = None  # the last check's record, kept by the checkpoint of its step
        self.spikes = SpikeWatch(cfg.train.spike, self.counters)
        run_dir = Path(cfg.train.run_dir)
        self.skips, self.rollbacks = skip_plan(run_dir), len(spike_records(run_dir))
        self._position: dict = {}  # the data position of the step in progress (before any skip)
        self._taken = 0  # the number of the batch it takes (faults.batch)
        self.probe = None  # the conversion probe recorded with each checkpoint (checkpoint.probe)
        if cfg.checkpoint.probe:
            self.probe = Probe(cfg.data, cfg.model.tgt_len, micro_batch, self.layout, cfg.precision.dtype)

    @property
    def step(self) -> int:
        return self.counters.step

    def _engine_state(self) -> EngineState:
        lay, model = self.layout, self.cfg.model
        if self.stage is None:
            name_of, owns = (lambda n: n), (lambda n: True)
        else:
            name_of, owns = (lambda n: pipe_to_single(model, n)), (lambda n: stage_owns(lay.pp_rank, n))
        return EngineState(self.engine, name_of, lay, owns, self.cfg.precision.dtype)

    def _memory_state(self) -> MemoryState:
        lay, model = self.layout, self.cfg.model
        if self.stage is None:
            with torch.device("meta"):
                names = MemTransformerLM(model).memory_names()
            get, set_ = self.memory.tensors, self.memory.replace
        else:
            names = stage_memory_names(model, lay.pp, lay.pp_rank)
            get, set_ = (lambda: self.stage.bank.current), self.stage.bank.replace
        dtype = next(self.engine.module.parameters()).dtype
        return MemoryState(get, set_, lay, self.cfg.data.batch_size, names, self.engine.device, dtype)

    # ---- one step ------------------------------------------------------------------------------------------
    def _next_batch(self):
        if self._held is not None:
            return self._held
        inp, tgt = self.cursor.next_batch()
        return inp.to(self.engine.device, non_blocking=True), tgt.to(self.engine.device, non_blocking=True)

    def _batch_number(self, pos: dict) -> int:
        """The number of the batch at data position `pos`, counted from the first of epoch 0 (1-based)."""
        per_epoch = int(getattr(self.cursor.reader, "steps_per_epoch", 0) or 0)
        return int(pos.get("epoch", 0)) * per_epoch + int(pos.get("step", 0)) + 1

    def train_step(self) -> StepResult:
        t0 = time.perf_counter()
        step = self.counters.step + 1
        self.faults.step(step)
        if self._held is None:
            self._position = dict(self.cursor.state)
            for _ in range(self.skips.get(step, 0)):  # a rollback's skipped batches (train/rollback.py)
                self.cursor.next_batch()
            self._taken = self._batch_number(self.cursor.reader.state_dict())
        inp, tgt = self.faults.batch(self._taken, *self._next_batch())
        b = self.micro_batch
        if inp.size(1) != b * self.n_micro:
            raise RuntimeError(f"data reader gave {inp.size(1)} streams, expected {b * self.n_micro}")
        # A new epoch starts every column afresh (and, with roll, elsewhere in the text): empty memory, as the
        # reference's per-epoch train() does. The committed cursor is the position of this batch.
        new_epoch = self.cursor.state.get("step") == 0
        if self.stage is not None:
            loss_sum, res = self._pipeline_step(inp, tgt, new_epoch)
        else:
            loss_sum, res, new_mems = self._micro_steps(inp, tgt, new_epoch)
        self.faults.corrupt("weights", step, self.engine.module)
        self.faults.at("step")
        signals = StepSignals.all_reduced(
            loss_sum,
            tgt.numel(),
            stop=self.stop is not None and self.stop.requested,
            save_failed=self.store is not None and self.store.failed(),
            world_size=self.world_size,
        )
        if signals.save_failed:  # a background save failed: every rank raises its SaveFailed here
            assert self.store is not None  # saves are on (on every rank): one failed
            self.store.wait(timeout_s=self.cfg.checkpoint.commit_timeout_s)
        loss, tokens, stop = (
            signals.loss_sum / signals.tokens,
            int(signals.tokens) // self.model_parallel,
            signals.stop,
        )
        if self.stage is not None:
            self.stage.bank.commit() if res.applied else self.stage.bank.discard()
        if res.applied:
            if self.stage is None:
                self.memory.mems = new_mems  # memory becomes current only now
            self.cursor.advance()  # and the data cursor moves past the batch
            self._held = None
            self._consecutive_skips = 0
            self.counters.step += 1
            self.counters.tokens += tokens
            self.started = True
            seconds = time.perf_counter() - t0
            self.metrics.train_step(
                {
                    "step": self.counters.step,
                    "loss": loss,
                    "lr": res.lr,
                    "grad_norm": res.grad_norm,
                    "loss_scale": res.loss_scale,
                    "skipped": self.counters.skipped,
                    "tokens": tokens,
                    "seconds": seconds,
                }
            )
            if self.watchdog is not None:
                self.watchdog.step_done(self.counters.step, seconds)
        else:
            self._held = (inp, tgt)
            if self.watchdog is not None:
                self.watchdog.attempted()
            self._consecutive_skips += 1
            self.counters.skipped += 1
            self.metrics.skipped(
                {
                    "step": self.counters.step + 1,
                    "loss": loss,
                    "old_scale": self._scale_before,
                    "loss_scale": res.loss_scale,
                    "skipped": self.counters.skipped,
                }
            )
            if self._consecutive_skips >= self.cfg.precision.max_consecutive_skips:
                raise DivergedError(
                    f"step {self.counters.step + 1}: {self._consecutive_skips} consecutive overflowing attempts "
                    f"(loss {loss:.4g}, loss scale {res.loss_scale:g}); the run diverged "
                    f"(precision.max_consecutive_skips={self.cfg.precision.max_consecutive_skips})"
                )
        self._scale_before = res.loss_scale
        return StepResult(res.applied, loss, stop)

    def _micro_steps(self, inp, tgt, new_epoch):
        b = self.micro_batch
        mems_in = [Memory({}, batch_size=b) for _ in range(self.n_micro)] if new_epoch else self.memory.mems
        new_mems = []
        loss_sum = torch.zeros((), dtype=torch.float64, device=inp.device)
        for k in range(self.n_micro):
            cols = slice(k * b, (k + 1) * b)
            if self.dropout_key is not None:
                self.dropout_key.set(step=self.counters.step, micro_batch=k)
            nll, mem = self.engine.forward(inp[:, cols], tgt[:, cols], mems_in[k])
            nll = nll.float()
            self.engine.backward(nll.mean() * self.loss_factor)
            if k == self.n_micro - 1:
                self.faults.corrupt("grad", self.counters.step + 1, self.engine.module)
            res = self.engine.micro_step()  # the optimizer steps after the last micro-batch only
            loss_sum += nll.detach().sum(dtype=torch.float64)
            new_mems.append(mem)
        if res is None:
            raise RuntimeError(
                f"DeepSpeed did not reach a gradient-accumulation boundary after {self.n_micro} micro-batches"
            )
        return loss_sum, res, new_mems

    def _pipeline_step(self, inp, tgt, new_epoch):
        """DeepSpeed's pipeline engine runs all micro-batches and the optimizer step; each stage's layers write
        their new memory to its bank's pending buffer (committed by the caller once the step is applied)."""
        if self.loss_factor != 1.0:
            raise RuntimeError("optim.half_loss is not supported with pipeline parallelism")
        if new_epoch:
            self.stage.bank.replace({})
        if self.dropout_key is not None:  # each pipe layer sets the micro-batch it computes
            self.dropout_key.set(step=self.counters.step)
        b = self.micro_batch
        batches = [
            (stage_input(inp[:, k * b : (k + 1) * b], k), tgt[:, k * b : (k + 1) * b]) for k in range(self.n_micro)
        ]
        res = self.engine.pipeline_step(iter(batches))
        loss_sum = torch.tensor(res.loss * tgt.numel(), dtype=torch.float64, device=inp.device)
        return loss_sum, res

    # ---- the loop ------------------------------------------------------------------------------------------
    def save(self) -> Path | None:
        if self.store is None:
            return None
        agreed = self.check_replicas()  # a checkpoint is written only once its replicas agree
        files: dict | Callable[[], dict] = {}
        if self.probe is not None:  # collective: every rank runs its first streams (train/probe_record.py),
            probe = self.probe  # after the snapshot, as files are written

            def files() -> dict:
                return _eagerly(
                    probe.record, self.engine, self.stage, self.memory, self.cursor.state, self.counters.step
                )

        return self.store.save(self.counters.step, self.registry, layout=self.layout, replicas=agreed, files=files)

    def check_replicas(self) -> ReplicaRecord:
        """Collective: the replicas' fingerprints compared (train/numerics.py), once per step. A mismatch is noted
        in this rank's heartbeat (the supervisor's record names the suspects) and raised."""
        if self._agreed is not None and self._agreed.step == self.counters.step:
            return self._agreed
        try:
            self._agreed = self.replicas.check(self.counters.step)
        except ReplicaMismatch as e:
            if self.watchdog is not None:
                self.watchdog.note("replicas", {"suspects": e.suspects, "step": self.counters.step, "line": str(e)})
            raise
        return self._agreed

    def resume(self, step_dir: Path) -> None:
        """Restore everything from a committed checkpoint of any layout (resharding on load). The RNG streams of
        this process are restored when the layout is unchanged, else re-seeded from (seed, ranks, step)."""
        assert self.store is not None  # a run that resumes has a checkpoint store
        saved = self.store.check_compatible(step_dir)
        t0 = time.perf_counter()
        self.store.load(step_dir, self.registry)
        load_s = time.perf_counter() - t0
        if not saved.same_layout:
            self._reseed(saved.step)
        self._scale_before = self.engine.loss_scale()
        if self.rank == 0:
            print(
                f"[checkpoint] resumed from {step_dir} at step {self.counters.step} (loaded in {load_s:.2f}s)",
                flush=True,
            )

    def _reseed(self, step: int) -> tuple[int, int]:
        """A resume under another layout: this rank's streams from (seed, its ranks, the step), as a fresh start."""
        return seed_streams(self.cfg, self.layout, self.engine.device, step_salt=step)

    def run(self) -> str:
        """Train to train.max_steps or a stop signal. Returns "done" or "stopped". The watchdog watches the steps;
        evaluation and saves, which have time bounds of their own, pause it."""
        cfg = self.cfg
        self.engine.module.train()
        self.metrics.start_window()
        self.faults.at("start-up")
        every = cfg.checkpoint.save_every
        check_every = cfg.train.replica_check_every
        check_every = every if check_every is None else check_every
        wd = self.watchdog
        paused = wd.paused if wd is not None else (lambda phase: contextlib.nullcontext())
        if wd is not None:
            wd.start(self.counters.step)
        try:
            while self.counters.step < cfg.train.max_steps:
                r = self.train_step()
                if r.applied:
                    s = self.counters.step
                    why = self.spikes.judge(r.loss)
                    if why is not None:
                        with paused("save"):
                            self._on_spike(s, r.loss, why)
                        continue
                    self.spikes.add(r.loss)
                    if check_every and s % check_every == 0:
                        self.check_replicas()
                    if self.evaluator is not None and cfg.eval.every and s % cfg.eval.every == 0:
                        with paused("eval"):
                            _eagerly(self.evaluator.run, s)
                        self.engine.module.train()
                    if every and s % every == 0 and not r.stop:
                        with paused("save"):
                            self.save()
                if r.stop:
                    with paused("save"):
                        self.save()
                        self._finish_saves()
                    return "stopped"
            with paused("save"):
                if cfg.checkpoint.save_at_end:
                    self.save()
                self._finish_saves()
            return "done"
        finally:
            if wd is not None:
                wd.stop()
            if self.probe is not None:
                self.probe.close()  # its reader, kept from save to save

    def _on_spike(self, step: int, loss: float, why: str) -> None:
        """A loss spike at `step` (every rank alike): stop, or roll back past its data (train/rollback.py)."""
        roll_back(self, step, loss, why, SpikeStop)

    def _finish_saves(self) -> None:
        if self.store is not None:
            self.store.finish()  # an asynchronous save in flight is written and committed first


def _eagerly(fn, *args):
    """fn(*args) with compiled layers running their eager code (validation, the probe: other lengths, eval mode;
    megamemo/kernels/compiler.py run_eagerly), so that a compiled run compiles its training graphs only."""
    with run_eagerly():
        return fn(*args)

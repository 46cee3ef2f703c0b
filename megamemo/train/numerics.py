"""Runs that survive their own numerics: the replicas' agreement and loss spikes (docs/reliability.md).

ReplicaCheck  every train.replica_check_every applied steps, and before every checkpoint, the data-parallel replicas
              compare fingerprints of what they hold alike, in one all-gather of a few integers per rank:
                ZeRO 1/2  the flat weights every rank holds after the step's all-gather, one fingerprint per DP
                          partition: partition p's owner (DP rank p) made it from its fp32 master, so the owner's is
                          the reference, once the owner's own copy matches its master (else the majority's);
                ZeRO 0    the weights and Adam's moments (all replicated): one fingerprint, the majority the reference;
                both      Adam's step, the learning rate and the loss scale.
              A disagreement raises ReplicaMismatch naming the ranks and their hosts: exit 5, which the supervisor
              treats as node-suspect (runtime/interruptions.py). A checkpoint is written only after its replicas
              agreed, and records the fingerprints (its rank files' "replicas").
SpikeWatch    a step's loss against the running window of the losses before it (train.spike); the window is saved
              with the counters, so a resumed or rolled-back run judges every step as the first run did.
"""

from __future__ import annotations

import math
import socket
import statistics
import time

import torch
import torch.distributed as dist

from megamemo.checkpoint.layout import RankLayout
from megamemo.checkpoint.replicas import RankFingerprints, ReplicaRecord

EXIT_NODE_SUSPECT = 5  # megamemo/runtime/interruptions.py's
_P = 2_147_483_629  # a prime below 2^31: a flipped bit changes a fingerprint whatever its position
_CHUNK = 1 << 22
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaMismatch(RuntimeError):
    """Replicas that should hold the same state do not: a device computed or stored something wrong."""

    same_on_every_rank = True  # every rank raises it with the same line; rank 0 says it

    def __init__(self, line: str, suspects: list[dict]):
        super().__init__(line)
        self.suspects = suspects


def fingerprint(tensors) -> int:
    """A position-weighted checksum of the tensors' bits (mod a prime, in int64: no overflow), on their device."""
    h = 0
    for t in tensors:
        flat = t.detach().reshape(-1)
        ints = flat.view(_INT[flat.element_size()]) if flat.numel() else flat.new_zeros(0, dtype=torch.int64)
        total = 0
        for lo in range(0, ints.numel(), _CHUNK):
            part = ints[lo : lo + _CHUNK].to(torch.int64).remainder(_P)
            w = torch.arange(lo + 1, lo + 1 + part.numel(), dtype=torch.int64, device=part.device).remainder(_P)
            total += int((part * w).remainder(_P).sum())
        h = (h * 1_000_003 + total % _P + flat.numel()) % (2**61 - 1)
    return h


def _zero_partitions(opt):
    """(per DP partition: the bit16 slices of every group, this rank's partition id, its own copy matches its fp32
    master) of DeepSpeed's ZeRO 1/2 optimizer; None for other optimizers."""
    groups = getattr(opt, "parallel_partitioned_bit16_groups", None)
    masters = getattr(opt, "single_partition_of_fp32_groups", None)
    if not groups or masters is None:
        return None
    mine = [dist.get_rank(group=g) if dist.is_initialized() else 0 for g in opt.real_dp_process_group]
    own_ok = all(
        torch.equal(parts[p], master.to(parts[p].dtype)) for parts, p, master in zip(groups, mine, masters, strict=True)
    )
    by_partition = [[parts[p] for parts in groups] for p in range(len(groups[0]))]
    return by_partition, mine[0], own_ok


class ReplicaCheck:
    """This rank's fingerprints and the verdict over every rank's (the module's doc)."""

    def __init__(self, engine, layout: RankLayout, rank: int, world_size: int, node: str | None = None):
        self.engine, self.layout, self.rank, self.world_size = engine, layout, rank, world_size
        self.node = node or socket.gethostname()

    def local(self) -> dict:
        ds = self.engine.ds
        opt = ds.optimizer
        zero = _zero_partitions(opt)
        inner = getattr(opt, "optimizer", opt)
        steps = sorted({int(st["step"]) for st in inner.state.values() if "step" in st})
        scalars = fingerprint(
            [
                torch.tensor(
                    [float(x) for x in (*steps, self.engine.lr(), self.engine.loss_scale())], dtype=torch.float64
                )
            ]
        )
        out = {
            "rank": self.rank,
            "node": self.node,
            "dp_rank": self.layout.dp_rank,
            "group": [self.layout.tp_rank, self.layout.pp_rank],
            "scalars": scalars,
        }
        if zero is not None:
            parts, own, ok = zero
            out.update(partitions=[fingerprint(p) for p in parts], owns=own, own_ok=ok)
        else:
            state = [
                t
                for p in ds.module.parameters()
                for t in [p, *inner.state.get(p, {}).values()]
                if isinstance(t, torch.Tensor) and t.dim() > 0
            ]
            out["state"] = fingerprint(state)
        return out

    def gather(self) -> list[dict]:
        mine = self.local()
        if self.world_size == 1:
            return [mine]
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        return everyone

    def check(self, step: int) -> ReplicaRecord:
        """Collective: the fingerprints of every rank -> the record a checkpoint keeps; ReplicaMismatch when the
        replicas of a data-parallel group disagree."""
        t0 = time.perf_counter()
        everyone = self.gather()
        suspects, why = verdict(everyone)
        if suspects:
            named = ", ".join(f"rank {s['rank']} ({s['node']})" for s in suspects)
            verb = "disagrees" if len(suspects) == 1 else "disagree"
            raise ReplicaMismatch(
                f"replica check after step {step}: {named} {verb}"
                f" with the other data-parallel replicas ({why}); stopping as node-suspect (exit "
                f"{EXIT_NODE_SUSPECT}): the run resumes from its newest checkpoint, whose replicas "
                f"agreed",
                suspects,
            )
        ranks = tuple(sorted((e["rank"], _kept(e)) for e in everyone))
        return ReplicaRecord(step, round(time.perf_counter() - t0, 6), ranks)


def _kept(e: dict) -> RankFingerprints:
    """A rank's gathered fingerprints -> what its checkpoint keeps of them."""
    parts = e.get("partitions")
    return RankFingerprints(e["node"], e["scalars"], None if parts is None else tuple(parts), e.get("state"))


def verdict(everyone: list[dict]) -> tuple[list[dict], str]:
    """(the ranks at fault, what differs) over every rank's fingerprints, replicas grouped by (tp rank, pp rank)."""
    groups: dict = {}
    for e in everyone:
        groups.setdefault(tuple(e["group"]), []).append(e)
    bad: dict[int, str] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        for key in ("scalars", "state"):
            if key in members[0]:
                for e in _odd_ones(members, lambda e, key=key: e[key]):
                    bad.setdefault(
                        e["rank"],
                        "Adam's step, the LR or the loss scale"
                        if key == "scalars"
                        else "its weights or Adam's moments",
                    )
        if "partitions" in members[0]:
            for p in range(len(members[0]["partitions"])):
                owner = next((e for e in members if e["owns"] == p), None)
                if owner is not None and not owner["own_ok"]:
                    bad.setdefault(owner["rank"], f"its weights of partition {p} differ from its own fp32 master")
                ref = [owner] if owner is not None and owner["own_ok"] else None
                others = members if ref or owner is None else [e for e in members if e is not owner]
                for e in _odd_ones(others, lambda e, p=p: e["partitions"][p], ref):
                    bad.setdefault(
                        e["rank"],
                        f"its weights of partition {p} differ from rank {owner['rank']}'s, their owner's"
                        if ref and owner is not None
                        else f"its weights of partition {p} differ",
                    )
    suspects = [e for e in everyone if e["rank"] in bad]
    return suspects, "; ".join(f"rank {r}: {why}" for r, why in sorted(bad.items()))


def _odd_ones(members: list[dict], value, reference: list[dict] | None = None) -> list[dict]:
    """The members whose value is not the reference's (given), else not the strict majority's (every member that
    differs from another when there is none: two replicas cannot tell which one is wrong)."""
    if reference is not None:
        want = value(reference[0])
        return [e for e in members if value(e) != want]
    counts: dict = {}
    for e in members:
        counts[value(e)] = counts.get(value(e), 0) + 1
    top, n = max(counts.items(), key=lambda kv: kv[1])
    if n * 2 > len(members):
        return [e for e in members if value(e) != top]
    return members if len(counts) > 1 else []


class SpikeWatch:
    """train.spike's rule over the window of the last `window` applied steps' losses (spikes left out)."""

    def __init__(self, spike, counters):
        self.cfg, self.counters = spike, counters  # counters.spike_window: saved and restored with the counters

    @property
    def window(self) -> list[float]:
        return self.counters.spike_window

    def judge(self, loss: float) -> str | None:
        """Why this loss is a spike, or None."""
        if self.cfg.rule == "off":
            return None
        if not math.isfinite(loss):
            return f"loss {loss} is not finite"
        if len(self.window) < self.cfg.window:
            return None
        limit = self.cfg.limit()
        if self.cfg.rule == "ratio":
            median = statistics.median(self.window)
            if median > 0 and loss / median > limit:
                return (
                    f"loss {loss:.4f} is {loss / median:.2f} x the median {median:.4f} of the last "
                    f"{len(self.window)} steps (train.spike.threshold={limit:g})"
                )
            return None
        mean, sd = statistics.fmean(self.window), statistics.pstdev(self.window)
        z = (loss - mean) / max(sd, 1e-12)
        if z > limit:
            return (
                f"loss {loss:.4f} is {z:.1f} standard deviations above the mean {mean:.4f} of the last "
                f"{len(self.window)} steps (train.spike.threshold={limit:g})"
            )
        return None

    def add(self, loss: float) -> None:
        if self.cfg.rule == "off":
            return
        self.window.append(float(loss))
        del self.window[: -self.cfg.window]

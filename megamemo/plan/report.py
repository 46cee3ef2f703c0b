"""What `megamemo plan` prints (megamemo/commands/plan.py): the per-rank memory of a layout by pipeline stage
(layouts.py), whether it fits, its predicted step (steptime.py) and, without --tp/--pp, the layouts that fit, best
first (recommend.py); why a layout cannot run, in one line, with the nearest that does."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megamemo.config.run import ConfigError
from megamemo.model.params import total_params
from megamemo.plan import recommend as rec
from megamemo.plan.steptime import explain, step_time
from megamemo.runtime.gpus import gpu

from .layouts import HEADROOM, GiB, Plan, plan, stage_plans


@dataclass
class Ask:
    """What `megamemo plan` is asked: the cluster (nodes x gpus_per_node devices of kind `gpu`, or CPU processes
    sharing host_mem_gib a node), the layout (tp, pp: None for the config's, or to recommend) and what to show. Each
    field is one of its flags (megamemo/commands/plan.py makes them from these fields, their comments the help)."""

    nodes: int  # nodes the job runs on
    gpus_per_node: int  # devices (or CPU processes) per node
    gpu: str = "a100-80g"  # device kind: a name of megamemo/runtime/gpus.py PLANNED (an unknown one is
    # named with the nearest known)
    device: str = "gpu"  # gpu | cpu (cpu: ranks are CPU processes sharing the node's host memory)
    host_mem_gib: float | None = None  # device cpu: a node's memory the processes share (GiB)
    tp: int | None = None  # tensor-parallel size of the layout to price (default: recommend)
    pp: int | None = None  # pipeline stages of the layout to price (default: recommend)
    recommend: bool = False  # list the layouts that fit, best first (the default when neither tp nor pp is
    # given)
    explain: bool = False  # the predicted step time's breakdown of the layout (tp/pp, else the first
    # ranked)


def _capacity(ask: Ask) -> tuple[float, str]:
    """(GiB one rank may use, words for the cluster)."""
    if ask.device == "cpu":
        if not ask.host_mem_gib:
            raise ValueError("--device cpu needs --host-mem-gib (the node's memory, shared by its ranks)")
        return (
            ask.host_mem_gib / ask.gpus_per_node,
            f"{ask.nodes} node(s) x {ask.gpus_per_node} CPU processes sharing {ask.host_mem_gib:g} GiB",
        )
    memory = gpu(ask.gpu).memory_gib
    if memory is None:
        raise ValueError(f"--gpu {ask.gpu}: no device memory on record (not a planned GPU)")
    return memory, f"{ask.nodes} node(s) x {ask.gpus_per_node} {ask.gpu}"


def _structural(base, ask: Ask, world: int) -> str | None:
    """Why the layout of --tp/--pp cannot run on the cluster at all (before the config's reduction settings that
    the layout leaves without effect, parallel/zero.py)."""
    par = dataclasses.replace(base.parallel, tp=ask.tp or base.parallel.tp, pp=ask.pp or base.parallel.pp)
    return rec.layout_problem(dataclasses.replace(base, parallel=par), world, ask.gpus_per_node)


def _print_memory(plans: list[Plan], cluster: str) -> tuple[Plan, bool]:
    """Prints the per-rank memory table of the stages' plans -> (the largest stage's plan, whether all fit)."""
    p = plans[0]
    print(f"cluster: {cluster}; layout {p.layout}")
    terms = [t for t in Plan.TERMS if any(getattr(q, t) for q in plans)]
    print("per-rank memory (GiB), by pipeline stage:" if len(plans) > 1 else "per-rank memory:")
    print(f"  {'':<16}" + "".join(f"{f'stage {q.stage}':>10}" for q in plans))
    for name in terms:
        note = "" if name != "snapshot" or p.on_host else "  (host memory, not counted)"
        print(f"  {name:<16}" + "".join(f"{getattr(q, name) / GiB:>10.2f}" for q in plans) + note)
    top = max(plans, key=lambda q: q.total)
    if len(plans) > 1:
        print(f"  {'stage total':<16}" + "".join(f"{q.total / GiB:>10.2f}" for q in plans))
    print(
        f"  {'total':<16}{top.total / GiB:>10.2f} GiB of {p.capacity / GiB:.1f} GiB"
        + (f" (stage {top.stage}, the largest)" if len(plans) > 1 else "")
    )
    ok = all(q.fits for q in plans)
    print(f"-> {'FITS' if ok else 'DOES NOT FIT'} (with {1 - HEADROOM:.0%} headroom)")
    return top, ok


def report(load: Callable[[list[str]], Any], ask: Ask) -> int:
    """Prints the plan of the config `load(sets)` returns (sets: --set overrides of the layout) on the cluster ->
    the exit code: 0 it fits, 1 it does not, 2 the config or cluster cannot be planned (one line on stderr)."""
    world = ask.nodes * ask.gpus_per_node
    given = bool(ask.tp or ask.pp)
    layout = [f"parallel.{k}={v}" for k, v in (("tp", ask.tp), ("pp", ask.pp)) if v]
    try:
        base = load([])
        gib, cluster = _capacity(ask)
        rec.check_device(base, rec.device_kind(ask.device, ask.gpu))
        try:
            cfg = load(layout)
            why = rec.layout_problem(cfg, world, ask.gpus_per_node) if given else None
        except ConfigError as e:
            if not given:
                raise
            why = str(e).removeprefix("parallel: ")
            if why.startswith(("parallel.overlap_comm", "parallel.reduce_bucket_size")):
                why = _structural(base, ask, world) or why  # the layout itself first, then the config's settings
            cfg = None
        if why:
            tp, pp = ask.tp or base.parallel.tp, ask.pp or base.parallel.pp
            print(
                f"megamemo plan: tp={tp} pp={pp} cannot run on {cluster}: {why}; "
                + rec.nearest_words(base, ask.nodes, ask.gpus_per_node, gib, ask.device, ask.gpu, plan, tp, pp, "runs"),
                file=sys.stderr,
            )
            return 2
        plans = stage_plans(cfg, world, gib, ask.device)
    except (ConfigError, ValueError) as e:
        print(f"megamemo plan: {e}", file=sys.stderr)
        return 2
    kind = rec.device_kind(ask.device, ask.gpu)
    fits = None
    if ask.recommend or not given:
        fits, fails = rec.recommend(cfg, ask.nodes, ask.gpus_per_node, gib, ask.device, ask.gpu, plan)
        if not fits:
            print(
                "megamemo plan: "
                + rec.no_fit_line(cfg, ask.nodes, ask.gpus_per_node, gib, ask.device, ask.gpu, plan, fails),
                file=sys.stderr,
            )
            return 1
    m = cfg.model
    n_params = total_params(m)
    print(
        f"model: {m.variant} {m.n_layer}L d_model {m.d_model} {m.n_head}x{m.d_head} d_inner {m.d_inner} "
        f"vocab {m.n_token}: {n_params / 1e9:.2f} B parameters; tgt_len {m.tgt_len} mem_len {m.mem_len}; "
        f"{cfg.precision.dtype}"
    )
    if fits is not None:
        rec.print_recommendations(
            cfg, ask.nodes, ask.gpus_per_node, gib, ask.device, ask.gpu, plan, fits_fails=(fits, fails)
        )
        print()
    p = plans[0]
    top, ok = _print_memory(plans, cluster)
    runs = rec.layout_problem(cfg, world, ask.gpus_per_node) is None
    if runs:
        st = step_time(cfg, world, kind, ask.gpus_per_node, plan)
        print(
            f"   predicted step {st.seconds * 1e3:.1f} ms: {st.tokens_per_s_per_device:,.1f} tokens/s per device, "
            f"HFU {st.hfu:.1%}, MFU {st.mfu:.1%}, dominant: {st.dominant} ({kind}; megamemo/plan/steptime.py)"
        )
        best, _ = rec.fastest_micro_batch(
            cfg,
            world,
            ask.gpus_per_node,
            gib,
            ask.device,
            kind,
            plan,
            cfg.parallel.tp,
            cfg.parallel.pp,
            cfg.parallel.zero_stage,
        )
        if best is not None and best[1] != cfg.train.grad_accum:
            c, ga, _, fast = best
            print(
                f"   this layout's fastest micro-batch: {c.layout(world)[1]} x grad_accum {ga} (--set "
                f"train.grad_accum={ga}): {fast.seconds * 1e3:.1f} ms, {fast.tokens_per_s_per_device:,.1f} tokens/s "
                f"per device"
            )
    if not ok and given:
        print(
            f"megamemo plan: {p.layout} needs {top.total / GiB:.1f} GiB on a rank of stage {top.stage} (of "
            f"{p.capacity / GiB:.1f}); "
            + rec.nearest_words(
                cfg,
                ask.nodes,
                ask.gpus_per_node,
                gib,
                ask.device,
                ask.gpu,
                plan,
                cfg.parallel.tp,
                cfg.parallel.pp,
                "fits",
            ),
            file=sys.stderr,
        )
    if ask.explain:
        show = fits[0].step if fits and not given else (st if runs else None)
        if show is not None:
            print()
            print("\n".join(explain(show, kind)))
    return 0 if ok else 1

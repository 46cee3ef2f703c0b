"""`megamemo plan` without --tp/--pp: the layouts (tp, pp, dp, ZeRO stage, micro-batch) that fit a cluster, best
first by predicted tokens/s per device (megamemo/plan/steptime.py: the model's op trace priced at the layout's
micro-batch - GEMMs, elementwise bytes, kernel launches -, TP all-reduces, the pipeline bubble and sends, DP
gradient reduction, ZeRO's gather, gradient accumulation, the optimizer), and why every other layout fails. Each
layout takes the micro-batch size, of those that fit, with the most predicted tokens/s (at least pp micro-batches
under a pipeline): fastest_micro_batch. nearest() finds the layout that runs closest to one that does not,
smallest_cluster() the fewest nodes of the same shape that run anything.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from megamemo.config.run import ConfigError
from megamemo.model.config import padded_vocab
from megamemo.plan.devices import device
from megamemo.plan.steptime import StepTime, step_time


class Fit(NamedTuple):
    seconds: float  # predicted step time
    pp: int
    total: float  # bytes on the fullest rank
    desc: str
    plan: object  # the fullest stage's plan.Plan
    step: StepTime


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def model_at(cfg, tp: int):
    """cfg's model as a run under `tp` builds it: a `model.n_token: auto` vocabulary padded for that tp
    (model/config.py padded_vocab: 32,000 symbols are 32,000 rows at tp 2, 32,256 at tp 4, 32,768 at tp 8)."""
    if not cfg.n_token_auto:
        return cfg.model
    n_token, n_vocab = padded_vocab(cfg.model.vocab_size, tp)
    return dataclasses.replace(cfg.model, n_token=n_token, n_vocab=n_vocab)


def why_not(cfg, tp: int, pp: int, zero: int, dp: int, gpn: int) -> str | None:
    """The structural reason a layout cannot run, or None."""
    m = model_at(cfg, tp)
    if tp > gpn or gpn % tp:
        return f"tp={tp} does not divide a node's {gpn} devices (TP groups stay inside a node)"
    for what, n in (("heads", m.n_head), ("d_inner", m.d_inner), ("vocabulary", m.n_token)):
        if n % tp:
            return f"tp={tp} does not divide the {what} ({n})"
    if tp > 1 and (m.cutoffs or m.div_val != 1):
        return "the adaptive softmax does not run under TP"
    if pp > m.n_layer:
        return f"pp={pp} > {m.n_layer} layers"
    if pp > 1 and zero > 1:
        return "DeepSpeed's pipeline takes ZeRO 0/1 only"
    if cfg.data.batch_size % dp:
        return f"the global batch ({cfg.data.batch_size} streams) does not split over dp={dp}"
    return None


def device_kind(device: str, gpu: str) -> str:
    """The devices.DEVICES row of `megamemo plan`'s --device / --gpu."""
    return "cpu" if device == "cpu" else gpu


def fastest_micro_batch(
    cfg, world: int, gpn: int, gib: float, device: str, kind: str, plan_fn, tp: int, pp: int, zero: int
):
    """Of the micro-batch sizes of layout (tp, pp, zero) on `world` devices that fit, the one with the most
    predicted tokens/s - wider GEMMs and fewer launches a token, no gradient-accumulation pass at grad_accum 1,
    against (under a pipeline) a larger bubble: ((cfg at it, grad_accum, fullest stage's plan, StepTime) or None,
    (the fullest plan, micro-batch) of the smallest micro-batch that did not fit, or None)."""
    dp = world // (tp * pp)
    best = smallest = None
    for ga in _divisors(cfg.data.batch_size // dp):  # largest micro-batch first
        if pp > 1 and ga < pp:
            continue  # fewer micro-batches than stages: stages idle
        c = dataclasses.replace(
            cfg,
            model=model_at(cfg, tp),
            eval=dataclasses.replace(cfg.eval, every=0),
            parallel=dataclasses.replace(cfg.parallel, tp=tp, pp=pp, zero_stage=zero),
            train=dataclasses.replace(cfg.train, grad_accum=ga),
        )
        plans = [plan_fn(c, world, gib, s, device) for s in range(pp)]
        worst = max(plans, key=lambda q: q.total)
        if not all(q.fits for q in plans):
            smallest = (worst, cfg.data.batch_size // dp // ga)
            continue
        st = step_time(c, world, kind, gpn, plan_fn)
        if best is None or st.tokens_per_s > best[3].tokens_per_s:
            best = (c, ga, worst, st)
    return best, smallest


def recommend(cfg, nodes: int, gpn: int, gib: float, device: str, gpu: str, plan_fn):
    """-> (fitting [Fit] best first by predicted tokens/s, failing [(desc, reason)])."""
    world = nodes * gpn
    kind = device_kind(device, gpu)
    fits, fails = [], []
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            for zero in (0, 1, 2):
                if zero and dp == 1:
                    continue  # nothing to partition
                desc = f"tp={tp} pp={pp} dp={dp} zero={zero}"
                reason = why_not(cfg, tp, pp, zero, dp, gpn)
                if reason:
                    fails.append((desc, reason))
                    continue
                best, smallest = fastest_micro_batch(cfg, world, gpn, gib, device, kind, plan_fn, tp, pp, zero)
                if smallest is None and best is None:
                    fails.append((desc, f"fewer micro-batches than pp={pp} stages"))
                    continue
                if best is None:
                    worst, micro = smallest
                    fails.append(
                        (
                            desc,
                            f"needs {worst.total / 2**30:.1f} GiB on a rank of stage "
                            f"{worst.stage} even at micro-batch {micro} "
                            f"(of {worst.capacity / 2**30:.0f})",
                        )
                    )
                    continue
                c, ga, worst, st = best
                micro = cfg.data.batch_size // (dp * ga)
                note = f" (eval.batch_size: a multiple of {dp})" if cfg.eval.every and cfg.eval.batch_size % dp else ""
                fits.append(
                    Fit(st.seconds, pp, worst.total, f"{desc} micro_batch={micro} x grad_accum={ga}{note}", worst, st)
                )
    fits.sort(key=lambda f: (-f.step.tokens_per_s, f.total))
    return fits, fails


def _distance(desc: str, tp: int, pp: int) -> float:
    got = dict(kv.split("=") for kv in desc.split()[:2])
    return abs(math.log2(int(got["tp"]) / tp)) + abs(math.log2(int(got["pp"]) / pp))


def nearest(fits: list[Fit], tp: int, pp: int) -> Fit | None:
    """The fitting layout closest to tp x pp (in factors of two), the faster of equals."""
    return min(fits, key=lambda f: (_distance(f.desc, tp, pp), -f.step.tokens_per_s), default=None)


def nearest_words(cfg, nodes, gpn, gib, device, gpu, plan_fn, tp: int, pp: int, verb: str) -> str:
    """'nearest layout that <verb>: ...' for a layout near tp x pp that fits this cluster, or why there is none."""
    near = nearest(recommend(cfg, nodes, gpn, gib, device, gpu, plan_fn)[0], tp, pp)
    return f"nearest layout that {verb}: {describe(near)}" if near else "no layout fits this cluster"


def smallest_cluster(cfg, nodes: int, gpn: int, gib: float, device: str, gpu: str, plan_fn, limit: int = 1024):
    """(nodes, best Fit) of the fewest nodes of this shape (doubling, up to `limit` devices) that run anything."""
    n = nodes * 2
    while n * gpn <= limit:
        fits, _ = recommend(cfg, n, gpn, gib, device, gpu, plan_fn)
        if fits:
            return n, fits[0]
        n *= 2
    return None


def check_device(cfg, kind: str) -> None:
    """ValueError (one line) when the device kind is unknown or has no figure for the config's precision."""
    dev = device(kind)
    if cfg.precision.dtype not in dev.peak:
        raise ValueError(
            f"precision.dtype: {kind} has no {cfg.precision.dtype} tensor cores (it has "
            f"{', '.join(dev.peak)}); set precision.dtype to one of them"
        )


def layout_problem(cfg, world: int, gpn: int) -> str | None:
    """Why cfg's own layout (parallel.tp / pp / zero_stage) cannot run on `world` devices, `gpn` a node, or None."""
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if world % (tp * pp):
        return f"tp x pp = {tp * pp} does not divide the {world} devices"
    reason = why_not(cfg, tp, pp, cfg.parallel.zero_stage, world // (tp * pp), gpn)
    if reason:
        return reason
    try:
        cfg.layout(world)
    except ConfigError as e:
        return str(e)
    return None


def describe(f: Fit) -> str:
    return (
        f"{f.desc} ({f.total / 2**30:.1f} GiB/rank, {f.step.tokens_per_s_per_device:,.1f} tokens/s per "
        f"device predicted)"
    )


def no_fit_line(cfg, nodes, gpn, gib, device, gpu, plan_fn, fails) -> str:
    """One line for a cluster on which nothing fits: the closest miss, and the fewest nodes that run something."""
    needs = [(float(r.split()[1]), d, r) for d, r in fails if r.startswith("needs ")]
    why = f"the smallest need is {min(needs)[1]}: {min(needs)[2]}" if needs else fails[0][1] if fails else ""
    grown = smallest_cluster(cfg, nodes, gpn, gib, device, gpu, plan_fn)
    where = f"{nodes} x {gpn} {'CPU processes' if device == 'cpu' else gpu}"
    then = (
        f"; nearest that runs: {grown[0]} nodes x {gpn}: {describe(grown[1])}"
        if grown
        else "; nothing runs up to 1024 devices of this kind"
    )
    return f"no layout fits {where}: {why}{then}"


def print_recommendations(cfg, nodes, gpn, gib, device, gpu, plan_fn, show=8, fits_fails=None) -> None:
    fits, fails = fits_fails or recommend(cfg, nodes, gpn, gib, device, gpu, plan_fn)
    print(
        f"layouts that fit on {nodes} x {gpn} {'CPU processes' if device == 'cpu' else gpu}, best first by "
        f"predicted tokens/s per device (megamemo/plan/steptime.py):"
    )
    print(f"  {'layout':<50} {'GiB/rank':>8} {'step ms':>9} {'tok/s/dev':>10} {'HFU':>6} {'MFU':>6}  dominant")
    for f in fits[:show]:
        st = f.step
        print(
            f"  {f.desc:<50} {f.total / 2**30:8.1f} {st.seconds * 1e3:9.1f} {st.tokens_per_s_per_device:10.1f} "
            f"{st.hfu:6.1%} {st.mfu:6.1%}  {st.dominant} ({st.terms[st.dominant] / st.seconds:.0%})"
        )
    if len(fits) > show:
        print(f"  ... and {len(fits) - show} more")
    if not fits:
        print("  none")
    print("layouts that do not fit or cannot run:")
    for desc, reason in fails:
        print(f"  {desc:<24} {reason}")

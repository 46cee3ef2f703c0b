"""`megamemo plan` without --tp/--pp: the layouts (tp, pp, dp, ZeRO stage, micro-batch) that fit a cluster, best
first by the communication each step needs, and why every other layout fails.

Communication per rank and step, each at its link's bandwidth (LINKS: per-device NVLink-class bandwidth inside a
node, network bandwidth per device between nodes; estimates, not measured):
- TP: per layer and micro-batch 4 all-reduces (2 forward, 2 backward) of the layer's [rows, B, d_model]
  activations, 2 (tp-1)/tp of their bytes each; TP groups stay inside a node.
- PP: per micro-batch and stage boundary the activations and the memory rows forward, their gradient back.
- DP: the gradient reduction and ZeRO's parameter gather, 2 (dp-1)/dp of the rank's parameter bytes.
Pipeline parallelism is ranked after every layout without it, whatever its bytes: its bubble idles
(pp-1)/(grad_accum+pp-1) of each step and its stages hold unequal memory, so it is for models that do not fit
otherwise (Narayanan et al. 2021: TP up to the node, PP only to fit, DP for the rest).
"""
from __future__ import annotations

import dataclasses

LINKS = {"v100-16g": (130, 12.5), "v100-32g": (130, 12.5), "a100-40g": (230, 25), "a100-80g": (230, 25),
         "h100-80g": (370, 50), "cpu": (10, 1.25)}   # GB/s per device: (inside a node, between nodes)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def comm_seconds(cfg, tp: int, pp: int, dp: int, micro: int, params_b: float, gpn: int, link) -> float:
    m = cfg.model
    intra, inter = (bw * 1e9 for bw in link)
    ga, pb = cfg.train.grad_accum, 2 if cfg.precision.dtype in ("bf16", "fp16") else 4
    rows = m.tgt_len + (m.mem_len if m.lamemo else 0)
    act = rows * micro * m.d_model * pb
    layers = -(-m.n_layer // pp)
    t = 4 * act * 2 * (tp - 1) / tp * layers * ga / intra if tp > 1 else 0.0
    if pp > 1:
        t += 2 * (m.tgt_len + m.mem_len) * micro * m.d_model * pb * ga / (inter if tp * dp >= gpn else intra)
    if dp > 1:
        t += 2 * params_b * (dp - 1) / dp / (inter if tp * dp > gpn else intra)
    return t


def why_not(cfg, tp: int, pp: int, zero: int, dp: int, gpn: int) -> str | None:
    """The structural reason a layout cannot run, or None."""
    m = cfg.model
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


def recommend(cfg, nodes: int, gpn: int, gib: float, device: str, gpu: str, plan_fn):
    """-> (fitting [(comm_s, pp, total, desc, worst stage plan)] best first, failing [(desc, reason)])."""
    world = nodes * gpn
    link = LINKS["cpu" if device == "cpu" else gpu]
    fits, fails = [], []
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            for zero in (0, 1, 2):
                if zero and dp == 1:
                    continue                      # nothing to partition
                desc = f"tp={tp} pp={pp} dp={dp} zero={zero}"
                reason = why_not(cfg, tp, pp, zero, dp, gpn)
                if reason:
                    fails.append((desc, reason))
                    continue
                best = smallest = None
                for ga in _divisors(cfg.data.batch_size // dp):      # largest micro-batch first
                    if pp > 1 and ga < pp:
                        continue                  # fewer micro-batches than stages: stages idle
                    c = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, every=0), parallel=dataclasses.replace(cfg.parallel, tp=tp, pp=pp,
                                                                              zero_stage=zero),
                                            train=dataclasses.replace(cfg.train, grad_accum=ga))
                    plans = [plan_fn(c, world, gib, s, device) for s in range(pp)]
                    worst = max(plans, key=lambda q: q.total)
                    if all(q.fits for q in plans):
                        best = (c, ga, worst)
                        break
                    smallest = worst
                if smallest is None and best is None:
                    fails.append((desc, f"fewer micro-batches than pp={pp} stages"))
                    continue
                if best is None:
                    fails.append((desc, f"needs {smallest.total / 2 ** 30:.1f} GiB on a rank of stage "
                                        f"{smallest.stage} even at micro-batch {cfg.data.batch_size // dp // ga} "
                                        f"(of {worst.capacity / 2 ** 30:.0f})"))
                    continue
                c, ga, worst = best
                micro = cfg.data.batch_size // (dp * ga)
                t = comm_seconds(c, tp, pp, dp, micro, worst.params, gpn, link)
                note = (f" (eval.batch_size: a multiple of {dp})"
                        if cfg.eval.every and cfg.eval.batch_size % dp else "")
                fits.append((t, pp, worst.total, f"{desc} micro_batch={micro} x grad_accum={ga}{note}", worst))
    fits.sort(key=lambda f: (f[1] > 1, f[0], f[2]))
    return fits, fails


def print_recommendations(cfg, nodes, gpn, gib, device, gpu, plan_fn, show=8) -> None:
    fits, fails = recommend(cfg, nodes, gpn, gib, device, gpu, plan_fn)
    print(f"layouts that fit on {nodes} x {gpn} {'CPU processes' if device == 'cpu' else gpu}, best first "
          f"(estimated communication per step; pipelines only after every layout without one):")
    for t, _, total, desc, _ in fits[:show]:
        print(f"  {desc:<50} {total / 2 ** 30:7.1f} GiB/rank  comm ~{t * 1e3:8.1f} ms")
    if len(fits) > show:
        print(f"  ... and {len(fits) - show} more")
    if not fits:
        print("  none")
    print("layouts that do not fit or cannot run:")
    for desc, reason in fails:
        print(f"  {desc:<24} {reason}")

"""`megamemo plan`: per-rank memory of a run before launching it - parameters, gradients, optimizer state
(by ZeRO stage), activations and recurrence-memory state for the chosen TP/PP/DP layout - and whether it fits.

    megamemo plan --config configs/lamemo-7b.yaml --nodes 4 --gpus-per-node 8 --gpu a100-80g [--tp 4 --pp 2]

Counts are analytic (from the model config, not from building the model). The numbers are those of a rank of the
first pipeline stage, the largest: it has the most layers (stages take n_layer / pp, the first ones one more
when it does not divide), the most micro-batches in flight (up to `pp` in DeepSpeed's 1F1B schedule) and, for
LaMemo, the embedding FIFO. Its parameters are counted exactly: its layers' shards, the shared position biases
and the embedding table; the output bias sits on the last stage (which also holds a tied copy of the table and
has one micro-batch in flight). Activations count the tensors that autograd keeps per layer for one micro-batch
(no recomputation).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

GPUS = {"v100-16g": 16, "v100-32g": 32, "a100-40g": 40, "a100-80g": 80, "h100-80g": 80}
GiB = 1024 ** 3
HEADROOM = 0.9  # keep 10% for the allocator, communication buffers and the framework


@dataclass
class Plan:
    layout: str
    params: float
    grads: float
    optimizer: float
    activations: float
    memory_state: float
    capacity: float

    @property
    def total(self):
        return self.params + self.grads + self.optimizer + self.activations + self.memory_state

    @property
    def fits(self):
        return self.total <= HEADROOM * self.capacity


def layer_params(m) -> tuple[int, int]:
    """(parameters split by tensor parallelism, replicated parameters) of one layer."""
    d, nd, f = m.d_model, m.n_head * m.d_head, m.d_inner
    split = 3 * d * nd + d * nd + nd * d + d * f + f + f * d
    return split, d + 4 * d  # fc2 bias, two layer norms


def _cluster_dims(m) -> tuple[list[int], list[int]]:
    """(vocabulary rows, embedding width) of each adaptive cluster; one cluster of all tokens for div_val 1."""
    bounds = [0, *m.cutoffs, m.n_token]
    if m.div_val == 1:
        return [m.n_token], [m.embed_dim]
    return [hi - lo for lo, hi in zip(bounds, bounds[1:])], [m.embed_dim // m.div_val ** i
                                                            for i in range(len(bounds) - 1)]


def input_params(m) -> int:
    """The input embedding: its tables and, where their width is not d_model, their projections."""
    rows, dims = _cluster_dims(m)
    return sum(r * w + (m.d_model * w if w != m.d_model or m.div_val > 1 else 0) for r, w in zip(rows, dims))


def output_params(m) -> int:
    """What the softmax holds beyond the (tied) embedding: untied tables and projections, the output bias and the
    tail clusters' head weights and biases."""
    rows, dims = _cluster_dims(m)
    n_parts = len(m.cutoffs) + 1
    tie = list(m.tie_projs) + [m.tie_projs[-1] if m.tie_projs else False] * n_parts
    own = 0 if m.tie_weight else sum(r * w for r, w in zip(rows, dims))
    projs = 0
    for i in range(n_parts):
        w = dims[i] if m.div_val > 1 else dims[0]
        if not (m.div_val == 1 and m.d_model == m.embed_dim) and not tie[i]:
            projs += m.d_model * w
    return own + projs + m.n_token + len(m.cutoffs) * (m.embed_dim + 1)


def embed_params(m) -> int:
    """Everything outside the layers but the position biases: the input embedding and the softmax's own."""
    return input_params(m) + output_params(m)


def bias_params(m) -> int:
    """The position biases u, v+ (and LaMemo's v-) shared by all layers."""
    return (3 if m.future_bias else 2) * m.n_head * m.d_head


def total_params(m) -> int:
    split, repl = layer_params(m)
    return m.n_layer * (split + repl) + embed_params(m) + bias_params(m)


def plan(cfg, world: int, gpu_gib: float) -> Plan:
    m, tp, pp = cfg.model, cfg.parallel.tp, cfg.parallel.pp
    dp, micro = cfg.layout(world)
    split, repl = layer_params(m)
    layers = math.ceil(m.n_layer / pp)          # the first stage's
    # the first stage: its layers, the embedding, the shared biases; the output side only when it is also the
    # last stage. Under TP everything but layer norms and fc2's bias is split (the softmax is then full and tied).
    params = layers * (split / tp + repl) + (input_params(m) + (output_params(m) if pp == 1 else 0)
                                             + bias_params(m)) / tp
    mixed = cfg.precision.dtype in ("bf16", "fp16")
    p_bytes = 2 if mixed else 4
    opt_per_param = (4 + 8) if mixed else 8  # fp32 master (mixed) + Adam moments
    zero = cfg.parallel.zero_stage
    params_b = params * p_bytes
    grads_b = params * p_bytes / (dp if zero >= 2 else 1)
    opt_b = params * opt_per_param / (dp if zero >= 1 else 1)

    L, M, B = m.tgt_len, (m.mem_len if m.has_memory else 0), micro
    klen = L + M
    rows = klen if m.lamemo else L           # LaMemo recomputes its memory rows in every layer
    n_loc, nd_loc, f_loc = m.n_head / tp, m.n_head * m.d_head / tp, m.d_inner / tp
    per_layer = (rows * B * m.d_model * 4            # layer input, attention out, LN out, FFN out
                 + 2 * klen * B * nd_loc + 2 * rows * B * nd_loc   # k, v; q and context (XL: current rows only)
                 + 2 * rows * B * f_loc)                      # FFN hidden, activation
    per_layer_scores = 2 * B * n_loc * L * klen * 4 / p_bytes   # fp32 scores and probabilities
    if m.lamemo:
        per_layer_scores += 2 * B * n_loc * M * min(M, L) * 4 / p_bytes
    act = layers * (per_layer + per_layer_scores) * p_bytes
    act += L * B * m.n_token / tp * 4 * (1 if pp == 1 else 0)  # fp32 logits live on the last stage
    act *= min(pp, cfg.train.grad_accum)                          # micro-batches in flight on a stage

    streams = B * cfg.train.grad_accum
    if m.lamemo:
        state = streams * M * (m.d_model * p_bytes + layers * n_loc * (m.d_head * p_bytes + 4))
    elif m.has_memory:
        state = streams * M * layers * m.d_model * p_bytes
    else:
        state = 0
    return Plan(f"tp={tp} pp={pp} dp={dp} zero={zero} micro_batch={micro} x grad_accum={cfg.train.grad_accum}",
                params_b, grads_b, opt_b, act, state, gpu_gib * GiB)


def main(argv: list[str]) -> int:
    from megamemo.config import ConfigError, load

    ap = argparse.ArgumentParser(prog="megamemo plan", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, required=True)
    ap.add_argument("--gpu", choices=sorted(GPUS), default="a100-80g")
    ap.add_argument("--tp", type=int)
    ap.add_argument("--pp", type=int)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    overrides = list(args.set)
    if args.tp:
        overrides.append(f"parallel.tp={args.tp}")
    if args.pp:
        overrides.append(f"parallel.pp={args.pp}")
    try:
        cfg = load(args.config, overrides)
        p = plan(cfg, args.nodes * args.gpus_per_node, GPUS[args.gpu])
    except (ConfigError, ValueError) as e:
        print(f"megamemo plan: {e}", file=sys.stderr)
        return 2
    m = cfg.model
    n_params = total_params(m)
    print(f"model: {m.variant} {m.n_layer}L d_model {m.d_model} {m.n_head}x{m.d_head} d_inner {m.d_inner} "
          f"vocab {m.n_token}: {n_params / 1e9:.2f} B parameters; tgt_len {m.tgt_len} mem_len {m.mem_len}; "
          f"{cfg.precision.dtype}")
    print(f"cluster: {args.nodes} node(s) x {args.gpus_per_node} {args.gpu}; layout {p.layout}")
    print("per-rank memory (first stage: the largest):" if cfg.parallel.pp > 1 else "per-rank memory:")
    for name in ("params", "grads", "optimizer", "activations", "memory_state"):
        print(f"  {name:<14}{getattr(p, name) / GiB:>9.2f} GiB")
    print(f"  {'total':<14}{p.total / GiB:>9.2f} GiB of {p.capacity / GiB:.0f} GiB "
          f"-> {'FITS' if p.fits else 'DOES NOT FIT'} (with {1 - HEADROOM:.0%} headroom)")
    return 0 if p.fits else 1

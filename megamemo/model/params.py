"""Parameter counts of a model config by arithmetic (no model built): per layer, split by tensor parallelism or
replicated, the embedding and softmax, the position biases. `megamemo plan` and the trainer's start-up line use
them; tests/plan/test_plan.py checks them against built models."""

from __future__ import annotations


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
    return [hi - lo for lo, hi in zip(bounds, bounds[1:], strict=False)], [
        m.embed_dim // m.div_val**i for i in range(len(bounds) - 1)
    ]


def input_params(m) -> int:
    """The input embedding: its tables and, where their width is not d_model, their projections."""
    rows, dims = _cluster_dims(m)
    return sum(
        r * w + (m.d_model * w if w != m.d_model or m.div_val > 1 else 0) for r, w in zip(rows, dims, strict=True)
    )


def output_params(m) -> int:
    """What the softmax holds beyond the (tied) embedding: untied tables and projections, the output bias and the
    tail clusters' head weights and biases."""
    rows, dims = _cluster_dims(m)
    n_parts = len(m.cutoffs) + 1
    tie = list(m.tie_projs) + [m.tie_projs[-1] if m.tie_projs else False] * n_parts
    own = 0 if m.tie_weight else sum(r * w for r, w in zip(rows, dims, strict=True))
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

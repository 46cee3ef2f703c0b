"""Tensor parallelism: `parallelize_tensor(model)` swaps the single-device model's projections for
megatron-core's column/row-parallel layers, its embedding and softmax for vocab-parallel ones, and slices every
per-head parameter, so each rank holds n_head / tp heads. The model code itself is unchanged: attention runs on
whatever number of heads a module holds, and LaMemo's per-head caches (ctx.*, lse.*) come out sharded with them.

Layout of the shards (the same rules serve `shard_tensor`, a single-device weight -> this rank's shard, and
`global_box`, where a shard sits in the layout-free global tensor a checkpoint holds):
  qkv.weight [3·n·dh, d]   rank r holds [Q; K; V] of its heads       (column parallel)
  r_net.weight [n·dh, d]   rows of its heads                         (a local product: see HeadRows)
  o_net.weight [d, n·dh]   columns of its heads                      (row parallel)
  fc1 weight/bias          rows r·F/tp ...                           (column parallel)
  fc2.weight [d, F]        columns r·F/tp ...                        (row parallel; fc2.bias replicated)
  r_w_bias, r_r_bias(_future) [n, dh]  its heads
  word_emb.emb_layers.0.weight, crit.out_weights.0 [V, d], crit.out_bias [V]: vocab rows r·V/tp ...
  everything else (layer norms, fc2.bias): replicated.
Memory: ctx.l [M,B,n,dh] and lse.l [M,B,n] are split on the head dim; emb and hid.l are replicated.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_gather

from megamemo.model.adaptive import mask_padding
from megamemo.model.layers import project_split

from .groups import TP_RNG, rng_tracker, tp_rank_size

_RULES = [  # (key pattern, split dim, per-head [Q;K;V] layout)
    (r"layers\.\d+\.attn\.qkv\.weight", 0, True),
    (r"layers\.\d+\.attn\.r_net\.weight", 0, False),
    (r"layers\.\d+\.attn\.o_net\.weight", 1, False),
    (r"layers\.\d+\.ff\.fc1\.(weight|bias)", 0, False),
    (r"layers\.\d+\.ff\.fc2\.weight", 1, False),
    (r"r_w_bias|r_r_bias|r_r_bias_future", 0, False),
    (r"word_emb\.emb_layers\.0\.weight|crit\.out_weights\.0|crit\.out_bias", 0, False),
]
_MEMORY_RULES = [(r"ctx\.\d+|lse\.\d+", 2, False)]


def _rule(key, rules=_RULES):
    for pat, dim, qkv in rules:
        if re.fullmatch(pat, key):
            return dim, qkv
    return None


def check_supported(cfg, tp: int) -> None:
    """Raise a ValueError naming the config field that tensor parallelism cannot split."""
    if tp == 1:
        return
    problems = []
    if cfg.n_head % tp:
        problems.append(f"model.n_head={cfg.n_head} is not divisible by tp={tp}")
    if cfg.d_inner % tp:
        problems.append(f"model.d_inner={cfg.d_inner} is not divisible by tp={tp}")
    if cfg.n_token % tp:
        problems.append(
            f"model.n_token={cfg.n_token} is not divisible by tp={tp} (pad the vocabulary: model.n_token: auto)"
        )
    if cfg.cutoffs or cfg.div_val != 1 or cfg.embed_dim != cfg.d_model:
        problems.append(
            "the adaptive input/softmax (model.cutoffs, model.div_val, model.d_embed) is not supported "
            "with tensor parallelism: use a full softmax (cutoffs: [], div_val: 1, d_embed: null) "
            "or tp=1"
        )
    if problems:
        raise ValueError("tensor parallelism: " + "; ".join(problems))


def shard_tensor(key, t, rank, tp, rules=_RULES):
    rule = _rule(key, rules)
    if rule is None or tp == 1:
        return t
    dim, qkv = rule
    if qkv:
        return torch.cat([part.chunk(tp, 0)[rank] for part in t.chunk(3, 0)], 0)
    return t.chunk(tp, dim)[rank]


def global_box(key, local_shape, rank, tp):
    """How this TP rank's tensor `key` (single-device name, local shape) sits in the layout-free global tensor:
    (global shape, box, the view of the local tensor that fills the box). A per-head [Q;K;V] projection is
    described as [3, n*dh, d] at any tp (rank r's heads of Q, K and V are then one box); every other split tensor
    is its single-device shape, cut on its split dimension; replicated tensors are whole."""
    shape = tuple(int(n) for n in local_shape)
    rule = _rule(key)
    if rule is None:
        return shape, tuple((0, n) for n in shape), shape
    dim, qkv = rule
    if qkv:
        per = shape[0] // 3
        view = (3, per, *shape[1:])
        return ((3, per * tp, *shape[1:]), ((0, 3), (rank * per, (rank + 1) * per), *((0, n) for n in shape[1:])), view)
    glob = list(shape)
    glob[dim] *= tp
    box = [(0, n) for n in shape]
    box[dim] = (rank * shape[dim], (rank + 1) * shape[dim])
    return tuple(glob), tuple(box), shape


def memory_box(name, local_shape, first_column, batch_size, rank, tp):
    """(global shape, box) of one micro-batch's memory tensor [M, b, ...] holding global streams
    [first_column, first_column + b) and, for the per-head caches (ctx.*, lse.*), this TP rank's heads."""
    M, b, *tail = (int(n) for n in local_shape)
    glob, box = [M, batch_size, *tail], [(0, M), (first_column, first_column + b), *((0, n) for n in tail)]
    rule = _rule(name, _MEMORY_RULES)
    if rule is not None:
        dim = rule[0]
        glob[dim] *= tp
        box[dim] = (rank * local_shape[dim], (rank + 1) * local_shape[dim])
    return tuple(glob), tuple(box)


def is_split(key) -> bool:
    """Whether TP ranks hold different parts of parameter `key` (else each holds all of it, the same values)."""
    return _rule(key) is not None


def memory_is_split(name) -> bool:
    """Whether TP ranks hold different parts of this memory tensor (else each holds all of it)."""
    return _rule(name, _MEMORY_RULES) is not None


def shard_state_dict(sd, rank, tp):
    return {k: shard_tensor(k, v, rank, tp) for k, v in sd.items()}


# ---- modules -----------------------------------------------------------------------------------------------
class ForkedDropout(nn.Module):
    """Dropout on activations split across TP ranks: `inner` (the model's dropout module, plain or a CPU kernel)
    drawn from the per-rank stream, so masks differ between ranks yet replay exactly; the default stream (used
    for replicated activations) is left untouched. A keyed inner dropout (train.dropout_masks: keyed,
    megamemo/kernels/keyed.py) draws from no stream: its mask is a function of the global feature index, so the
    ranks' slices are the single device's mask; it runs without the fork."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    @property
    def p(self) -> float:
        p = self.inner.p
        assert isinstance(p, float | int), p  # a dropout module's probability
        return p

    def forward(self, x):
        if not self.training or self.inner.p == 0 or getattr(self.inner, "keyed", False):
            return self.inner(x)
        with rng_tracker().fork(TP_RNG):
            return self.inner(x)


class HeadRows(nn.Linear):
    """r_net under TP: this rank's rows (the features of its heads) of the position projection, applied as a plain
    local product. Its input, the sinusoid table, is the same on every rank and needs no gradient, so nothing is
    communicated, forward or backward (a megatron column layer would all-reduce the table's input gradient in every
    backward, and compute it first, for nothing). Exact only for such an input: one that asks for a gradient is
    refused (each rank would hold only its heads' share of it)."""

    def reset_parameters(self):
        nn.init.zeros_(self.weight)  # no draw from the default stream: weights are loaded right after

    def forward(self, x):
        if x.requires_grad:
            raise ValueError(
                "HeadRows (r_net under tensor parallelism) takes a position table with no gradient: "
                "its input gradient would be this rank's heads' share only"
            )
        return F.linear(x, self.weight)


def _mcore_layers(tp, dtype):
    from megatron.core import ModelParallelConfig  # megatron-core: only for tp/pp > 1 (heavy)
    from megatron.core import tensor_parallel as mtp  # megatron-core: only for tp/pp > 1 (heavy)

    # Parameters are made on the CPU like every other parameter of the model (DeepSpeed moves the module to its
    # device): with use_cpu_initialization=False megatron would put them on torch.cuda.current_device(), a module
    # of mixed devices that parallel/shard_init.py's CPU generators cannot fill.
    cfg = ModelParallelConfig(
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=dtype,
        gradient_accumulation_fusion=False,
    )
    init = nn.init.zeros_  # weights are loaded from the single-device model right after

    class Column(mtp.ColumnParallelLinear):
        def __init__(self, n_in, n_out, bias):
            super().__init__(n_in, n_out, config=cfg, init_method=init, bias=bias, gather_output=False)

        def forward(self, x):
            return super().forward(x)[0]

    class QKVColumn(Column):
        """This rank's [Q; K; V] of its heads, with FusedQKV's split (queries for the last rows only)."""

        def split(self, x, q_rows):
            # the input enters as megatron's column layer takes it: identity, its gradient all-reduced
            return project_split(mtp.copy_to_tensor_model_parallel_region(x), self.weight, q_rows)

    class Row(mtp.RowParallelLinear):
        def __init__(self, n_in, n_out, bias):
            super().__init__(
                n_in, n_out, config=cfg, init_method=init, bias=bias, input_is_parallel=True, skip_bias_add=False
            )

        def forward(self, x):
            return super().forward(x)[0]

    def embedding(n, d):
        return mtp.VocabParallelEmbedding(n, d, init_method=init, config=cfg)

    return Column, QKVColumn, Row, embedding


class VocabParallelSoftmax(nn.Module):
    """Full softmax over a vocabulary split across TP ranks (megatron's vocab-parallel cross entropy). This rank holds
    the ids first .. first+local_vocab-1; those from n_vocab on (a padded vocabulary) are masked as on one device."""

    def __init__(self, local_vocab, d_model, tie_weight, dtype, first=0, n_vocab=None):
        super().__init__()
        self.tie_weight = tie_weight
        self.first, self.n_vocab = first, n_vocab
        self.out_bias = nn.Parameter(torch.zeros(local_vocab, dtype=dtype))
        self.out_weights = nn.ParameterList()
        if not tie_weight:
            self.out_weights.append(nn.Parameter(torch.zeros(local_vocab, d_model, dtype=dtype)))

    def _logits(self, h, emb):
        # megatron-core: only for tp/pp > 1 (heavy)
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        table = emb.emb_layers[0].weight if self.tie_weight else self.out_weights[0]
        return F.linear(
            copy_to_tensor_model_parallel_region(h), table, mask_padding(self.out_bias, self.first, self.n_vocab)
        )

    def nll(self, h, target, emb):
        # megatron-core: only for tp/pp > 1 (heavy)
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(self._logits(h, emb).float().clone(), target)

    def log_probs(self, h, emb):
        """Log-probabilities over the whole vocabulary: the TP ranks' logits gathered in rank order (their ids are
        consecutive), on the logits' device - megatron's gather allocates on the current CUDA device, which a CPU run
        has not; torch's gather carries the gradient back to each rank's rows."""
        from megatron.core import parallel_state as ps  # megatron-core: only for tp/pp > 1 (heavy)

        parts = all_gather(self._logits(h, emb).contiguous(), group=ps.get_tensor_model_parallel_group())
        return F.log_softmax(torch.cat(parts, dim=-1).float(), dim=-1)


def parallelize_layer(layer, cfg, tp: int, dtype) -> None:
    """In place: one XL/LaMemo layer's projections become column/row-parallel, its heads this rank's share, and
    the dropouts on split activations draw from the per-rank stream. Weights are loaded afterwards."""
    Column, QKVColumn, Row, _ = _mcore_layers(tp, dtype)
    d, nd = cfg.d_model, cfg.n_head * cfg.d_head
    a, f = layer.attn, layer.ff
    a.qkv, a.o_net = QKVColumn(d, 3 * nd, False), Row(nd, d, False)
    a.r_net = HeadRows(d, nd // tp, bias=False, dtype=dtype)  # the position table needs no gradient
    a.n_head = cfg.n_head // tp
    a.dropatt, a.dropatt_ahead = ForkedDropout(a.dropatt), ForkedDropout(a.dropatt_ahead)
    f.fc1, f.fc2 = Column(d, cfg.d_inner, True), Row(cfg.d_inner, d, True)
    f.drop_inner = ForkedDropout(f.drop_inner)


def local_bias(cfg, tp: int, dtype) -> nn.Parameter:
    """An empty [n_head / tp, d_head] relative-position bias (u, v+ or v-) for this rank's heads."""
    return nn.Parameter(torch.empty(cfg.n_head // tp, cfg.d_head, dtype=dtype))


def mark_tensor_parallel(module, name_of=lambda n: n) -> None:
    """Tag the parameters split across TP ranks (by the single-device name `name_of(name)`) so gradient-norm
    computations count them once per shard; megatron's own layers tag theirs."""
    # megatron-core: only for tp/pp > 1 (heavy)
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    for name, p in module.named_parameters():
        rule = _rule(name_of(name))
        if rule is not None and not getattr(p, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(p, True, rule[0], 1)


def parallelize_tensor(model, load: bool = True, always: bool = False):
    """In place: the single-device model becomes this rank's tensor-parallel shard, holding the same weights
    (load=False: the shard's parameters are left to be initialised - see parallel/shard_init.py). A TP group of one
    keeps the plain model unless `always` (the TP modules on one device, for tests)."""
    rank, tp = tp_rank_size()
    cfg = model.cfg
    check_supported(cfg, tp)
    if tp == 1 and not always:
        return model
    full = model.state_dict() if load else None
    dtype = next(model.parameters()).dtype
    _, _, _, embedding = _mcore_layers(tp, dtype)
    for layer in model.layers:
        parallelize_layer(layer, cfg, tp, dtype)
    for name in ("r_w_bias", "r_r_bias", "r_r_bias_future"):
        if hasattr(model, name):
            setattr(model, name, local_bias(cfg, tp, dtype))
    model.word_emb.emb_layers[0] = embedding(cfg.n_token, cfg.d_model)
    model.crit = VocabParallelSoftmax(
        cfg.n_token // tp, cfg.d_model, cfg.tie_weight, dtype, first=rank * (cfg.n_token // tp), n_vocab=cfg.n_vocab
    )
    if load:
        model.load_state_dict(shard_state_dict(full, rank, tp), strict=True)
    mark_tensor_parallel(model)
    model.tp_size = tp
    return model

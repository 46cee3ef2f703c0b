"""Pipeline parallelism on DeepSpeed's PipelineModule, with recurrence memory kept where its layers live.

Why DeepSpeed's pipeline engine and not megatron-core's schedules: megatron-core's schedules hard-code CUDA
devices (they fail on CPU without patching torch.cuda), while DeepSpeed's PipelineEngine runs on gloo as is, brings
ZeRO-1, loss scaling, clipping and sharded checkpoints with it, and is what `megamemo train` already drives.

The sequence of pipe layers (stage boundaries always fall just before a RelBias occurrence):
    Embed            token ids -> h0 (LaMemo: [E; h0], E = the embedding FIFO, kept by the first stage)
    RelBias, Layer   x n_layer  (RelBias: the model-level u, v+, v- shared by every layer, a DeepSpeed tied
                                  module: one copy per stage, its gradients summed across stages)
    Embed (tied)     hidden -> logits with the tied embedding table;  OutBias: + output bias
Every pipe layer is a module called directly (no DeepSpeed forward_fn), so each stage saves all of its layers -
tied copies included - in its layer files, and a resume restores every one of them.
Activations between stages are (rows [T, B, d], meta long [3] = (micro-batch, M, L)); for LaMemo the rows are
the memory rows and the current segment together, so the memory rows travel through the stages with them. Both
cross ranks through DeepSpeed's p2p, so both live on the communication device (NCCL takes no CPU tensor); inside a
stage the layers read meta as Python ints (StageContext.meta_ints: one host sync per stage and micro-batch).

Memory: each stage holds a StageMemory with the memory of its own layers (XL: hid.l; LaMemo: ctx.l, lse.l, and emb
on the first stage), one set per micro-batch (each micro-batch is a fixed group of streams). Forward passes write
into `pending`; the loop calls `commit()` once the step is complete, so recomputation (activation checkpointing)
or a replayed forward never advances memory twice.
With dropout > 0 and stream masks, positional-encoding dropout is drawn per layer under pipelining (one draw per
forward on a single device); with keyed masks (train.dropout_masks: keyed) every layer's draw is the single
device's one, and every other mask is the single device's too: the stage layers tell the key which micro-batch
they compute (StageContext.dropout_key, megamemo/kernels/keyed.py), including when a layer is recomputed.
Everything else is the single-device model.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megamemo.model.adaptive import mask_padding
from megamemo.model.layers import LaMemoLayer, XLLayer
from megamemo.model.memory import xl_update
from megamemo.model.positions import causal_mask, position_sequence, sinusoid

from .groups import tp_rank_size
from .tensor import mark_tensor_parallel, parallelize_layer, shard_tensor


class StageMemory:
    """The memory tensors of one stage's layers, per micro-batch: current[mb][name], written through pending until
    commit()."""

    def __init__(self):
        self.current: dict[int, dict[str, torch.Tensor]] = {}
        self.pending: dict[int, dict[str, torch.Tensor]] = {}

    def get(self, mb: int, name: str):
        return self.current.get(mb, {}).get(name)

    def put(self, mb: int, name: str, t: torch.Tensor) -> None:
        self.pending.setdefault(mb, {})[name] = t.detach()

    def commit(self) -> None:
        for mb, d in self.pending.items():
            self.current.setdefault(mb, {}).update(d)
        self.pending.clear()

    def discard(self) -> None:
        self.pending.clear()

    def replace(self, tensors: dict[int, dict[str, torch.Tensor]]) -> None:
        """The committed memory becomes `tensors` ({micro-batch: {name: tensor}}); nothing pending."""
        self.current, self.pending = {k: dict(v) for k, v in tensors.items()}, {}


class StageContext:
    """Per-process objects the pipe layers of one stage share: its memory bank, the current RelBias module, and
    the tensor-parallel coordinates (tp > 1: every layer of the stage is split by heads as in tensor.py)."""

    def __init__(self, cfg, tp: int = 1, tp_rank: int = 0):
        self.cfg = cfg
        self.bank = StageMemory()
        self.rel_bias: RelBiasPipe | None = None
        # the lengths the layers run with; validation swaps in its own (train/validate.py)
        self.mem_len, self.clamp_len, self.same_length = cfg.mem_len, cfg.clamp_len, cfg.same_length
        self.tp, self.tp_rank = tp, tp_rank
        self._meta: tuple[torch.Tensor, tuple] | None = None  # (meta tensor, its values as ints): meta_ints
        # keyed dropout masks: the run's DropoutKey (megamemo/kernels/keyed.py), told the micro-batch each pipe
        # layer computes; None with stream masks
        self.dropout_key = None

    def micro_batch(self, meta: torch.Tensor) -> tuple[int, int, int]:
        """meta_ints(meta), and the micro-batch made the one keyed dropout masks are drawn for."""
        values = self.meta_ints(meta)
        if self.dropout_key is not None:
            self.dropout_key.set(micro_batch=values[0])
        return values

    def meta_ints(self, meta: torch.Tensor) -> tuple[int, int, int]:
        """(micro-batch, M, L) of a meta tensor. The layers of a stage pass the same tensor object along, so its
        values are read off the device once (the first layer, or whoever made it with remember_meta)."""
        if self._meta is None or self._meta[0] is not meta:
            self._meta = (meta, tuple(int(v) for v in meta.tolist()))
        return self._meta[1]

    def remember_meta(self, meta: torch.Tensor, values: tuple[int, int, int]) -> torch.Tensor:
        self._meta = (meta, tuple(values))
        return meta


def stage_meta(mb: int, M: int, L: int, device) -> torch.Tensor:
    """The meta tensor (micro-batch, M, L) that crosses stages, on the communication device."""
    return torch.tensor([mb, M, L], dtype=torch.long, device=device)


def stage_input(tokens: torch.Tensor, mb: int = 0):
    """The first stage's input for micro-batch `mb`: (token ids, meta), meta on the tokens' device."""
    return tokens, stage_meta(mb, 0, 0, tokens.device)


class EmbedPipe(nn.Module):
    """First stage: embedding (and LaMemo's FIFO). Also, tied, the last stage's output projection."""

    def __init__(self, cfg, ctx: StageContext):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_token // ctx.tp, cfg.d_model))  # vocab rows of this TP rank
        self.scale = cfg.d_model**0.5
        self.drop = nn.Dropout(cfg.dropout)  # the embedding's (first stage)
        self.drop_out = nn.Dropout(cfg.dropout)  # the top layer's output (last stage: output_logits)
        self.ctx = ctx

    def forward(self, inputs):
        """Token ids -> embedded rows (first stage); on the last stage, where the same (tied) module follows the
        layers, hidden rows -> logits. No DeepSpeed forward_fn: a module used through one is not saved in the
        stage's layer files."""
        tokens, meta = inputs
        if tokens.is_floating_point():
            return output_logits(self, inputs)
        ctx = self.ctx
        mb, L = ctx.micro_batch(meta)[0], tokens.size(0)
        h0 = self.drop(self._lookup(tokens) * self.scale)
        emb = ctx.bank.get(mb, "emb") if ctx.cfg.lamemo else None
        out = h0 if emb is None else torch.cat([emb.to(h0.dtype), h0], 0)
        if ctx.cfg.lamemo:
            ctx.bank.put(mb, "emb", xl_update(emb, h0, ctx.mem_len))
        values = (mb, 0 if emb is None else emb.size(0), L)
        return out, ctx.remember_meta(stage_meta(*values, device=tokens.device), values)

    def _lookup(self, tokens):
        if self.ctx.tp == 1:
            return F.embedding(tokens, self.weight)
        # megatron-core: only for tp/pp > 1 (heavy)
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        lo = self.ctx.tp_rank * self.weight.size(0)
        outside = (tokens < lo) | (tokens >= lo + self.weight.size(0))
        e = F.embedding((tokens - lo).masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(e)


def output_logits(module: EmbedPipe, inputs):
    """The tied embedding on the last stage: final dropout, then hidden @ table^T."""
    rows, meta = inputs
    L = module.ctx.micro_batch(meta)[2]
    h = module.drop_out(rows[rows.size(0) - L :])
    if module.ctx.tp > 1:
        # megatron-core: only for tp/pp > 1 (heavy)
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        h = copy_to_tensor_model_parallel_region(h)
    return F.linear(h, module.weight)  # under TP: the logits of this rank's vocabulary rows


class RelBiasPipe(nn.Module):
    def __init__(self, cfg, ctx: StageContext):
        super().__init__()
        n = cfg.n_head // ctx.tp
        self.r_w_bias = nn.Parameter(torch.empty(n, cfg.d_head))
        self.r_r_bias = nn.Parameter(torch.empty(n, cfg.d_head))
        if cfg.future_bias:
            self.r_r_bias_future = nn.Parameter(torch.empty(n, cfg.d_head))
        self.ctx = ctx

    def forward(self, inputs):
        """Make this stage's copy of the shared biases visible to the layers that follow."""
        self.ctx.rel_bias = self
        return inputs


class LayerPipe(nn.Module):
    def __init__(self, cfg, ctx: StageContext, index: int):
        super().__init__()
        self.layer = LaMemoLayer(cfg, index) if cfg.lamemo else XLLayer(cfg, index)
        if ctx.tp > 1:
            parallelize_layer(self.layer, cfg, ctx.tp, torch.float32)
        self.index, self.ctx, self.cfg = index, ctx, cfg
        self.drop_pos = nn.Dropout(cfg.dropout)  # the position table's (the single model's drop_pos)

    def forward(self, inputs):
        rows, meta = inputs
        mb, M, L = self.ctx.micro_batch(meta)
        cfg, bank, li, b = self.cfg, self.ctx.bank, self.index, self.ctx.rel_bias
        assert b is not None  # the stage's RelBiasPipe runs before its layers
        mem_len = self.ctx.mem_len
        if not cfg.lamemo:
            mem = bank.get(mb, f"hid.{li}")
            M = 0 if mem is None else mem.size(0)
        pos = position_sequence(M + L, M, self.ctx.clamp_len, cfg.future_positions, rows.device)
        pos_emb = self.drop_pos(sinusoid(pos, cfg.d_model, rows.dtype))
        mask = causal_mask(L, M, mem_len, self.ctx.same_length, rows.device)
        if cfg.lamemo:
            vf = b.r_r_bias_future if cfg.future_bias else b.r_r_bias
            top = li == cfg.n_layer - 1
            rows, ctx_new, lse_new = self.layer(
                rows,
                M,
                bank.get(mb, f"ctx.{li}"),
                bank.get(mb, f"lse.{li}"),
                pos_emb,
                b.r_w_bias,
                b.r_r_bias,
                vf,
                mask,
                mem_len,
                mem_rows_out=not top,
            )
            if cfg.future_bias and (top or not M):
                # The top layer may skip the look-ahead, the only user of v+, and without memory (M = 0) no layer
                # uses it. DeepSpeed all-reduces tied weights' gradients only where they exist (the other stages
                # would wait in the collective), and its BF16_Optimizer (bf16 with fp32 accumulation) fails on a
                # tied weight that has none (pipe/engine.py _exec_reduce_tied_grads reads weight._hp_grad, set by
                # the first gradient). A zero gradient keeps every stage's copy in: the sum, and so the update, is
                # the single-process one.
                rows = rows + (vf.sum() * 0).to(rows.dtype)
            bank.put(mb, f"ctx.{li}", ctx_new)
            bank.put(mb, f"lse.{li}", lse_new)
            return rows, meta
        out = self.layer(rows, mem, pos_emb, b.r_w_bias, b.r_r_bias, mask)
        if mem_len > 0:
            bank.put(mb, f"hid.{li}", xl_update(mem, rows, mem_len))
        return out, meta


class OutBiasPipe(nn.Module):
    """+ the output bias of this TP rank's vocabulary rows; padding ids (a padded vocabulary) get -inf."""

    def __init__(self, cfg, ctx: StageContext):
        super().__init__()
        self.out_bias = nn.Parameter(torch.zeros(cfg.n_token // ctx.tp))
        self.first, self.n_vocab = ctx.tp_rank * (cfg.n_token // ctx.tp), cfg.n_vocab

    def forward(self, logits):
        return logits + mask_padding(self.out_bias, self.first, self.n_vocab)


def token_nll(logits, labels, vocab_parallel: bool = False):
    """Per-token NLL [L, B] fp32 of the last stage's logits [L, B, V]; vocab_parallel: logits split by vocabulary
    across the TP ranks (megatron's vocab-parallel cross entropy, a collective)."""
    if vocab_parallel:
        # megatron-core: only for tp/pp > 1 (heavy)
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(logits.float().clone(), labels)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="none").view(
        labels.shape
    )


def mean_nll(logits, labels):
    """The pipeline's loss_fn: mean token NLL of a micro-batch (logits [L, B, V], labels [L, B])."""
    return token_nll(logits, labels).mean()


def mean_nll_vocab_parallel(logits, labels):
    """The same over logits split by vocabulary across TP ranks."""
    return token_nll(logits, labels, vocab_parallel=True).mean()


def check_supported(cfg, pp: int) -> None:
    if pp == 1:
        return
    problems = []
    if cfg.n_layer < pp:
        problems.append(f"model.n_layer={cfg.n_layer} is smaller than pp={pp}")
    if cfg.cutoffs or cfg.div_val != 1 or cfg.embed_dim != cfg.d_model or not cfg.tie_weight:
        problems.append(
            "pipeline parallelism supports the full tied softmax only (model.cutoffs: [], div_val: 1, "
            "d_embed: null, tie_weight: true)"
        )
    if cfg.pre_lnorm:
        problems.append("model.pre_lnorm is not supported with pipeline parallelism")
    if problems:
        raise ValueError("pipeline parallelism: " + "; ".join(problems))


def layer_specs(cfg, ctx: StageContext):
    # deepspeed picks its accelerator at import: only after runtime/device.resolve()
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    bias_names = ["r_w_bias", "r_r_bias"] + (["r_r_bias_future"] if cfg.future_bias else [])
    specs = [TiedLayerSpec("embed", EmbedPipe, cfg, ctx, tied_weight_attr=["weight"])]
    for li in range(cfg.n_layer):
        specs.append(TiedLayerSpec("relbias", RelBiasPipe, cfg, ctx, tied_weight_attr=bias_names))
        specs.append(LayerSpec(LayerPipe, cfg, ctx, li))
    specs.append(TiedLayerSpec("embed", EmbedPipe, cfg, ctx, tied_weight_attr=["weight"]))
    specs.append(LayerSpec(OutBiasPipe, cfg, ctx))
    return specs


def stage_bounds(n_layer: int, pp: int, n_specs: int) -> list[int]:
    """Spec index where each stage starts (+ the end): transformer layers split as evenly as possible, every
    boundary just before a RelBias, the embedding on the first stage and the output on the last."""
    per = [n_layer // pp + (1 if s < n_layer % pp else 0) for s in range(pp)]
    bounds, first_layer = [0], 0
    for s in range(1, pp):
        first_layer += per[s - 1]
        bounds.append(1 + 2 * first_layer)
    return bounds + [n_specs]


def build_pipeline(cfg, pp: int, topology=None, activation_checkpoint_interval: int = 0):
    """-> (PipelineModule for this rank's stage, its StageContext). With megatron-core's groups initialised
    for tp > 1, every stage is also split by heads/vocabulary across its TP ranks."""
    # deepspeed picks its accelerator at import: only after runtime/device.resolve()
    from deepspeed.pipe import PipelineModule

    check_supported(cfg, pp)
    tp_rank, tp = tp_rank_size()
    ctx = StageContext(cfg, tp, tp_rank)
    specs = layer_specs(cfg, ctx)

    class MemPipelineModule(PipelineModule):
        def _partition_layers(self, method="uniform"):
            self.parts = stage_bounds(cfg.n_layer, self.num_stages, len(self._layer_specs))
            self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])

    kw = dict(topology=topology) if topology is not None else dict(num_stages=pp)
    module = MemPipelineModule(
        layers=specs,
        loss_fn=mean_nll if tp == 1 else mean_nll_vocab_parallel,
        partition_method="uniform",
        dynamic_shape=True,
        activation_checkpoint_interval=activation_checkpoint_interval,
        # the transformer layers only (an embedding of token ids has no input gradient for
        # a checkpoint to hang on), with torch's non-reentrant checkpoint (replays dropout)
        checkpointable_layers=["LayerPipe"],
        activation_checkpoint_func=functools.partial(checkpoint, use_reentrant=False),
        **kw,
    )
    if tp > 1:
        inv = {v: k for k, v in single_to_stage_names(cfg, module).items()}
        mark_tensor_parallel(module, lambda n: inv.get(n, n))
    return module, ctx


# ---- names: single-device model <-> pipeline stage ------------------------------------------------------------
def single_to_stage_names(cfg, module) -> dict[str, str]:
    """single-device parameter name -> this stage's parameter name, for the parameters this stage holds."""
    start, stop = module._local_start, module._local_stop
    n_specs = 2 * cfg.n_layer + 3
    names = {}
    if start == 0 or stop == n_specs:
        names["word_emb.emb_layers.0.weight"] = "tied_modules.embed.weight"
    names["r_w_bias"] = "tied_modules.relbias.r_w_bias"
    names["r_r_bias"] = "tied_modules.relbias.r_r_bias"
    if cfg.future_bias:
        names["r_r_bias_future"] = "tied_modules.relbias.r_r_bias_future"
    for li in range(cfg.n_layer):
        idx = 2 + 2 * li
        if start <= idx < stop:
            for key in (
                "attn.qkv.weight",
                "attn.r_net.weight",
                "attn.o_net.weight",
                "attn.layer_norm.weight",
                "attn.layer_norm.bias",
                "ff.fc1.weight",
                "ff.fc1.bias",
                "ff.fc2.weight",
                "ff.fc2.bias",
                "ff.layer_norm.weight",
                "ff.layer_norm.bias",
            ):
                names[f"layers.{li}.{key}"] = f"{idx}.layer.{key}"
    if stop == n_specs:
        names["crit.out_bias"] = f"{n_specs - 1}.out_bias"
    return names


def load_single_state(cfg, module, single_sd: dict) -> None:
    """Give this stage (this TP rank's shard of it) the weights of a single-device model."""
    rank, tp = tp_rank_size()
    names = single_to_stage_names(cfg, module)
    local = {names[k]: shard_tensor(k, v, rank, tp) for k, v in single_sd.items() if k in names}
    missing, unexpected = module.load_state_dict(local, strict=False)
    if unexpected or missing:
        raise ValueError(f"pipeline stage weights: missing {missing}, unexpected {unexpected}")


def pipe_to_single(cfg, key: str) -> str:
    """A pipeline stage's parameter name ('tied_modules.embed.weight', '4.layer.attn.qkv.weight') -> the
    single-device name."""
    n = cfg.n_layer
    if key.startswith("tied_modules.embed."):
        idx, rest = 0, key[len("tied_modules.embed.") :]
    elif key.startswith("tied_modules.relbias."):
        idx, rest = 1, key[len("tied_modules.relbias.") :]
    else:
        head, _, rest = key.partition(".")
        if not head.isdigit():
            raise ValueError(f"{key}: not a pipeline parameter name")
        idx = int(head)
    if idx in (0, 2 * n + 1) and rest == "weight":
        return "word_emb.emb_layers.0.weight"
    if idx == 2 * n + 2 and rest == "out_bias":
        return "crit.out_bias"
    if 1 <= idx < 2 * n + 1 and idx % 2 == 1 and rest in ("r_w_bias", "r_r_bias", "r_r_bias_future"):
        return rest
    if 2 <= idx <= 2 * n and idx % 2 == 0 and rest.startswith("layer."):
        return f"layers.{(idx - 2) // 2}.{rest[len('layer.') :]}"
    raise ValueError(f"{key}: no single-device parameter for pipe layer {idx} (n_layer={n})")


def stage_owns(pp_rank: int, single: str) -> bool:
    """Whether this stage writes `single` to a checkpoint: every stage holds the tied relative biases, and the first
    and last the tied embedding; their copies (and Adam states) are equal, so only the first stage writes them."""
    shared = single in ("word_emb.emb_layers.0.weight", "r_w_bias", "r_r_bias", "r_r_bias_future")
    return pp_rank == 0 or not shared


def stage_memory_names(cfg, pp: int, stage: int) -> list[str]:
    """The memory tensors a pipeline stage keeps: its layers' (ctx.l, lse.l | hid.l) and, first stage, LaMemo's emb."""
    b = stage_bounds(cfg.n_layer, pp, 2 * cfg.n_layer + 3)
    layers = [li for li in range(cfg.n_layer) if b[stage] <= 2 + 2 * li < b[stage + 1]]
    if not cfg.has_memory:
        return []
    if cfg.lamemo:
        return (["emb"] if stage == 0 else []) + [f"{k}.{li}" for li in layers for k in ("ctx", "lse")]
    return [f"hid.{li}" for li in layers]

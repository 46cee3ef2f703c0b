"""FLOPs of a training step, two ways: what the step executes (HFU's numerator) and what the PaLM convention
credits the model with (MFU's numerator). Shared by training's progress lines, `megamemo plan` and the benches.

    step_flops(cfg, B)          HFU: the matmul FLOPs one [tgt_len, B] micro-batch executes, forward + backward
    flops_per_token(cfg, B)     the same per target token
    model_flops(cfg, B)         MFU: PaLM appendix B's 6 N + attention, for the micro-batch's L x B target tokens
    model_flops_per_token(cfg)  the same per target token (independent of B)

utilisation = FLOPs per step / (step time x devices x the device's peak, megamemo/runtime/peak.py), for either.

HFU: the executed count
-----------------------
A forward over a [L, B] segment with a full memory of M rows (the steady state of training), counted per matmul
as 2·m·n·k; a training step is 3x the forward (the backward computes each product's two gradients). Counted:

  - every layer's [Q;K;V] projection (LaMemo: memory and current rows; XL/RPE: queries for the current rows only,
    keys and values for all), the position projection r_net over the distances used, attention content and
    position scores and the weighted values of the L current queries over klen = M + L keys, o_net and the
    feed-forward (LaMemo: memory and current rows, since it recomputes the memory rows' states every segment);
  - LaMemo's look-ahead: the M memory queries over the Nk = min(M, L) keys after them (content, values) and their
    position scores over M future distances;
  - less what the top LaMemo layer skips (model/layers.py, mem_rows_out=False): its memory rows' o_net and
    feed-forward, and their look-ahead when the new caches keep none of them (mem_len <= L);
  - the output layer, [L·B, d] x [d, V] (with adaptive softmax cutoffs: the head's shortlist + cluster columns
    only; the tail clusters' work depends on which targets fall there and is not counted, nor the input
    embedding's per-cluster projections with div_val > 1 - a lower bound for such models), and the input and
    output projections between d_embed and d_model when d_embed != d_model (div_val 1).

Not counted: softmax, masks, dropout, layer norms, interpolation and Adam (elementwise work, not FLOPs a
tensor core does). tests/model/test_flops.py checks the count against torch's FlopCounterMode on a real
forward+backward.

MFU: the PaLM convention with a memory
--------------------------------------
PaLM (Chowdhery et al. 2022, appendix B) credits a decoder with T-token sequences, N parameters, L layers and H
heads of width Q with 6N + 12·L·H·Q·T FLOPs per token: 2N forward (each parameter one multiply-add per token)
and 4N backward (the input and the weight gradient), plus the attention's two products per layer, Q·Kᵀ and
softmax·V, each 2·T·H·Q per token forward, x3 for forward + backward. Rematerialisation (activation
recomputation) is not credited: MFU counts what the model needs, not what an implementation chooses to do.

N is every parameter, embedding included (a tied table once). PaLM's own figure fixes this: 540B at 238.3k
tokens/s on 6144 TPU v4 chips (275 TFLOP/s bf16) gives (6 x 540.35e9 + 12 x 118 x 48 x 256 x 2048) x 238.3e3 /
(6144 x 275e12) = 46.2%, the MFU its Table 3 prints; leaving out its 4.7B-parameter (shared) embedding gives
45.8%. Here N = megamemo/model/params.py total_params: all layers (Q/K/V, r_net, o_net, FFN, their biases, layer
norms), the embedding and softmax (tied: once; adaptive: all clusters), and the position biases u, v (LaMemo: v-).

With a memory, a query of the segment attends to klen = mem_len + tgt_len keys (PaLM, like this count, does not
halve T for the causal mask: every query is charged the full key length). Transformer-XL's relative attention,
which XL and LaMemo share, scores each key twice - content (q + u)·kⱼ and position (q + v)·rᵢ₋ⱼ, the latter a
product of the same size over klen relative positions - so its attention has three products where PaLM's has two:
forward 3 x 2·klen·H·Q per token and layer, x3 for the backward:

    model FLOPs per target token = 6·N + 18·n_layer·n_head·d_head·(mem_len + tgt_len)

(without a memory, RPE: klen = tgt_len). PaLM's literal 12·L·H·Q·klen would leave out the position scores, a
matmul the model's definition requires (RoPE's positions in PaLM are elementwise and cost no matmul). Not
credited, because a GPT-like model of the same N does without them: LaMemo's memory rows re-encoded through
every layer and its look-ahead attention, and XL's K/V projections of the memory rows. So MFU is the same for
LaMemo and XL of the same shape and sequence lengths (but for LaMemo's 6 x n_head x d_head more for v-), while HFU
counts what each executes. Executed over model FLOPs per token (= HFU / MFU of any run; at micro-batch 1):
configs/lamemo-1.3b.yaml 1.95, lamemo-7b 2.01, enwik8-base 1.84 (mem_len = tgt_len: the layers' dense work runs
over twice the rows), wt103-base 1.28 (its tied 267,735-word softmax, 110 M of its 151 M parameters, costs both
counts alike); as XL the same shapes give 1.20, 1.21, 1.16, 1.05.
"""

from __future__ import annotations

from .config import ModelConfig
from .params import total_params


def forward_flops(cfg: ModelConfig, batch: int, tgt_len: int | None = None, mem_len: int | None = None) -> float:
    """Forward FLOPs of one [tgt_len, batch] segment with mem_len memory rows (defaults: cfg's training lengths;
    RPE has no memory whatever mem_len says)."""
    B = batch
    L = cfg.tgt_len if tgt_len is None else tgt_len
    M = cfg.mem_len if mem_len is None else mem_len
    d, H, F = cfg.d_model, cfg.n_head * cfg.d_head, cfg.d_inner
    if not cfg.has_memory:
        M = 0
    klen = L + M
    if cfg.lamemo:
        nk = min(M, L)
        lookahead = 2 * M * nk * H * B * 2 + 2 * M * M * H * B  # content and values, position scores
        if cfg.variant == "lamemo_no_lookahead":
            lookahead = 0  # the ablation keeps the cached context
        per_layer = (
            2 * klen * d * 3 * H * B  # qkv for memory and current rows
            + 2 * (klen + M) * d * H  # r_net over past and future distances
            + 3 * 2 * L * klen * H * B  # causal: content, position, values
            + lookahead
            + 2 * klen * H * d * B  # o_net for memory and current rows
            + 2 * klen * 2 * d * F * B
        )  # FFN for memory and current rows
        # the top layer's memory rows feed nothing: no o_net or FFN for them, and no look-ahead when the new
        # caches keep none of them (M = mem_len <= L; LaMemoLayer's mem_rows_out)
        top_saves = 2 * M * H * d * B + 2 * M * 2 * d * F * B + (lookahead if M <= L else 0)
        body = cfg.n_layer * per_layer - top_saves
    else:
        per_layer = (
            2 * L * d * H * B
            + 2 * klen * d * 2 * H * B  # q for current rows, k and v for all
            + 2 * klen * d * H
            + 3 * 2 * L * klen * H * B
            + 2 * L * H * d * B
            + 2 * L * 2 * d * F * B
        )
        body = cfg.n_layer * per_layer
    return body + _embedding_and_output(cfg, L * B)


def _embedding_and_output(cfg: ModelConfig, n: int) -> float:
    """The output layer over n positions, and the d_embed <-> d_model projections (see the module docstring)."""
    d, e = cfg.d_model, cfg.embed_dim
    cols = cfg.n_token if not cfg.cutoffs else cfg.cutoffs[0] + len(cfg.cutoffs)  # the head: shortlist + clusters
    projected = not (cfg.div_val == 1 and e == d)
    out = 2 * n * e * cols + (2 * n * d * e if projected else 0)
    inp = 2 * n * e * d if (cfg.div_val == 1 and e != d) else 0
    return out + inp


def step_flops(cfg: ModelConfig, batch: int, tgt_len: int | None = None, mem_len: int | None = None) -> float:
    """HFU's numerator: the forward + backward FLOPs one training micro-batch of `batch` streams executes, 3x the
    forward (see the module docstring)."""
    return 3 * forward_flops(cfg, batch, tgt_len, mem_len)


def flops_per_token(cfg: ModelConfig, batch: int, tgt_len: int | None = None, mem_len: int | None = None) -> float:
    """Executed (HFU) training FLOPs per target token at `batch` streams per micro-batch (per process): nearly
    independent of batch (only r_net's projection of the position table is shared by the streams)."""
    L = cfg.tgt_len if tgt_len is None else tgt_len
    return step_flops(cfg, batch, L, mem_len) / (L * batch)


def model_flops_per_token(cfg: ModelConfig, tgt_len: int | None = None, mem_len: int | None = None) -> float:
    """MFU's numerator per target token: 6·N + 18·n_layer·n_head·d_head·klen, klen = mem_len + tgt_len keys
    (tgt_len without a memory). Defaults: cfg's training lengths. Derivation: the module docstring."""
    L = cfg.tgt_len if tgt_len is None else tgt_len
    M = (cfg.mem_len if mem_len is None else mem_len) if cfg.has_memory else 0
    return 6 * total_params(cfg) + 18 * cfg.n_layer * cfg.n_head * cfg.d_head * (M + L)


def model_flops(cfg: ModelConfig, batch: int, tgt_len: int | None = None, mem_len: int | None = None) -> float:
    """MFU's numerator for one training micro-batch of `batch` streams: its tgt_len x batch target tokens times
    model_flops_per_token (the counterpart of step_flops)."""
    L = cfg.tgt_len if tgt_len is None else tgt_len
    return L * batch * model_flops_per_token(cfg, L, mem_len)

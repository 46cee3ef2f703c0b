"""The model's typed configuration, the `model` section of a run config: one declared dataclass (megamemo/config/
fields.py: each field's type, choices and bounds are checked on construction); `from_dict` turns a bad field into a
one-line error naming it, and `validate` checks the rules between fields (what a checkpoint records). What a training
run asks of it beyond that is the run config's (megamemo/train/config.py RunConfig.check)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import field
from typing import Annotated, Literal

from megamemo.config.fields import Bool, Field, Float, Int, section
from megamemo.config.run import ConfigError
from megamemo.config.run import section as build_section
from megamemo.util.errors import UsageError

# variant -> (memory kind, attention kind)
VARIANTS = {
    "lamemo": "LaMemo: disentangled RPE + look-ahead + memory interpolation (reference attn_type 3)",
    "lamemo_xlrpe": "LaMemo with Transformer-XL's signed RPE for the look-ahead (reference attn_type 31)",
    "lamemo_no_interp": "LaMemo ablation: no memory interpolation (alpha = 0: memory is its look-ahead context)",
    "lamemo_no_lookahead": "LaMemo ablation: no look-ahead (alpha = 1: memory keeps its causal context)",
    "xl": "Transformer-XL (relative positions, per-layer FIFO memory; reference attn_type 0)",
    "rpe": "Transformer with XL relative positions and no memory",
}
Variant = Literal["lamemo", "lamemo_xlrpe", "lamemo_no_interp", "lamemo_no_lookahead", "xl", "rpe"]  # model.variant
assert typing.get_args(Variant) == tuple(VARIANTS), "model.variant's choices are VARIANTS"


PAD_MULTIPLE = 128  # rows per TP rank a padded vocabulary is a multiple of (model.n_token: auto)


def padded_vocab(vocab: int, tp: int) -> tuple[int, int | None]:
    """(n_token, n_vocab) for a vocabulary of `vocab` symbols under tensor parallelism tp: n_token the next multiple
    of 128 x tp, n_vocab = vocab where that pads (None where it does not). megamemo/train/vocab.py says why."""
    step = PAD_MULTIPLE * tp
    n = -(-vocab // step) * step
    return n, (vocab if n != vocab else None)


@section("model")
class ModelConfig:
    # the architecture: LaMemo, its ablations, Transformer-XL or a Transformer without memory (VARIANTS)
    variant: Variant = "lamemo"
    # rows of the embedding and softmax tables (a run config may say `auto`: see megamemo/train/vocab.py)
    n_token: Annotated[Int, Field(ge=1)] = 256
    # The vocabulary's symbols when the tables are padded beyond it (ids n_vocab .. n_token-1 are padding: masked
    # out of the softmax, never input, target or sampled); None: every row is a symbol (n_vocab = n_token)
    n_vocab: Int | None = None
    n_layer: Annotated[Int, Field(ge=1)] = 2  # Transformer layers
    d_model: Annotated[Int, Field(ge=1)] = 64  # width of the residual stream
    n_head: Annotated[Int, Field(ge=1)] = 2  # attention heads per layer
    d_head: Annotated[Int, Field(ge=1)] = 32  # width of each head (n_head x d_head need not be d_model)
    d_inner: Annotated[Int, Field(ge=1)] = 128  # hidden width of the position-wise feed-forward
    dropout: Annotated[Float, Field(ge=0, lt=1)] = 0.1  # dropout of embeddings, sublayer outputs and memory
    # dropout of the attention probabilities (> 0 keeps eager attention)
    dropatt: Annotated[Float, Field(ge=0, lt=1)] = 0.0
    tgt_len: Annotated[Int, Field(ge=1)] = 64  # tokens per segment: the rows one forward step predicts
    mem_len: Annotated[Int, Field(ge=0)] = 64  # memory rows carried over from the previous segments (0: none)
    clamp_len: Int = -1  # relative distances beyond this share its position (-1: none clamped)
    same_length: Bool = False  # every query attends over the same number of keys (XL's same_length)
    pre_lnorm: Bool = False  # layer norm before each sublayer (pre-LN) instead of after it
    # adaptive softmax and input: cluster boundaries by id ([]: one full softmax)
    cutoffs: list[Int] = field(default_factory=list)
    # adaptive input: each later cluster's width divided by this again (1: all d_embed)
    div_val: Annotated[Int, Field(ge=1)] = 1
    tie_weight: Bool = True  # the output softmax shares the input embedding's table
    tie_projs: list[Bool] = field(default_factory=lambda: [False])  # per adaptive-softmax cluster: its
    # projection shared with the input's
    d_embed: Int | None = None  # embedding width (None: d_model; projected to d_model when another)
    init_std: Float = 0.02  # std of the normal initialisation of weights and position biases
    proj_init_std: Float = 0.01  # std of the normal initialisation of the adaptive projections
    # The reference LaMemo training script never re-initialises r_r_bias_future, so it keeps xavier_uniform_
    # (~15x the scale of r_r_bias). "xavier" reproduces that; "normal" uses N(0, init_std) like the other biases.
    future_bias_init: Literal["xavier", "normal"] = "xavier"
    # How attention is computed: eager (megamemo/model/attention.py) | flex (FlexAttention, one fused kernel;
    # megamemo/kernels/flex.py) | fused (Triton kernels with the rel-shifted position term on chip;
    # megamemo/kernels/fused.py) | auto (training on CUDA: the fastest of the forms that pass a start-up check
    # against eager, timed on one layer at the run's own shapes, megamemo/train/forms.py; on the CPU eager;
    # eval/generate: flex on CUDA). Attention dropout (dropatt > 0) keeps eager in training.
    # Not part of the model's identity (RUNTIME_FIELDS): a checkpoint resumes and converts under any form.
    attention: Literal["auto", "eager", "flex", "fused"] = "auto"

    RUNTIME_FIELDS = ("attention",)

    # ---- derived -------------------------------------------------------------------------------------------
    @property
    def lamemo(self) -> bool:
        return self.variant.startswith("lamemo")

    @property
    def has_memory(self) -> bool:
        return self.variant != "rpe"

    @property
    def future_bias(self) -> bool:
        """Whether the look-ahead has its own position bias v- (attn_type 3); type 31 reuses v+."""
        return self.variant in ("lamemo", "lamemo_no_interp")

    @property
    def future_positions(self) -> str | None:
        """How LaMemo encodes look-ahead distances: "abs" (disentangled RPE) or "signed" (XL's); None for XL/RPE."""
        if not self.lamemo:
            return None
        return "signed" if self.variant == "lamemo_xlrpe" else "abs"

    @property
    def vocab_size(self) -> int:
        """The vocabulary's symbols: ids [0, vocab_size) are tokens, the rest of the n_token rows padding."""
        return self.n_token if self.n_vocab is None else self.n_vocab

    @property
    def embed_dim(self) -> int:
        return self.d_model if self.d_embed is None else self.d_embed

    # ---- validation and (de)serialisation -----------------------------------------------------------------
    def validate(self) -> ModelConfig:
        """The rules between fields (each field's own type, choices and bounds were checked on construction)."""

        def bad(name, why):
            raise ConfigError(f"model.{name}: {why} (got {getattr(self, name)!r})")

        if self.n_vocab is not None and not 1 <= self.n_vocab <= self.n_token:
            bad("n_vocab", f"must be in [1, n_token={self.n_token}] (the symbols of a padded vocabulary)")
        if self.lamemo and self.mem_len == 0:
            bad("mem_len", "LaMemo needs a memory (mem_len >= 1)")
        if self.d_model % 2:
            bad("d_model", "must be even (sinusoidal positions)")
        cut = list(self.cutoffs)
        if cut != sorted(set(cut)) or (cut and (cut[0] < 1 or cut[-1] >= self.vocab_size)):
            # the last cluster holds at least one symbol: a cluster of padding only would take probability mass
            bad("cutoffs", f"must be strictly increasing and inside (0, {self.vocab_size}) (the vocabulary's symbols)")
        n_clusters = len(cut) + 1
        if len(self.tie_projs) not in (1, n_clusters) and self.tie_projs:
            bad("tie_projs", f"needs 1 or {n_clusters} entries (one per cluster)")
        if self.embed_dim % (self.div_val ** len(cut)):
            bad("div_val", "d_embed must be divisible by div_val ** len(cutoffs)")
        return self

    def check_lengths(self, **flags) -> ModelConfig:
        """An evaluation's lengths (eval, generate, harness): flags {"--mem-len": M, ...} (None: the checkpoint's)
        applied and held to validate's rules, as a training config's; -> the config they make. An error names the
        flag: `--mem-len: must be >= 0 (got -5)`."""
        given = {flag: v for flag, v in flags.items() if v is not None}
        fields = {flag: flag.removeprefix("--").replace("-", "_") for flag in given}
        try:
            return dataclasses.replace(self, **{fields[f]: v for f, v in given.items()}).validate()
        except ValueError as e:
            for flag, name in fields.items():
                if str(e).startswith(f"model.{name}:"):
                    raise UsageError(flag + str(e)[len(f"model.{name}") :]) from None
            raise

    def to_dict(self) -> dict:
        """Every field; n_vocab only where the vocabulary is padded, so an unpadded model's dict (its identity in
        checkpoints and fingerprints) is what it was before the field existed."""
        d = dataclasses.asdict(self)
        if d["n_vocab"] is None:
            del d["n_vocab"]
        return d

    def identity(self) -> dict:
        """to_dict() less the fields that choose how, not what, the model computes (RUNTIME_FIELDS)."""
        return {k: v for k, v in self.to_dict().items() if k not in self.RUNTIME_FIELDS}

    @classmethod
    def from_dict(cls, d: dict, where: str = "model") -> ModelConfig:
        return build_section(cls, d, where).validate()

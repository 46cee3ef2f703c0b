"""Import thu-coai/LaMemo and kimiyoung/transformer-xl `MemTransformerLM` weights and constructor configs.

Differences handled here:
  * LaMemo's separate q_net + kv_net (and kimiyoung's fused qkv_net) become one fused [Q; K; V] weight;
  * tied output tables/projections are dropped after checking they equal the embedding's;
  * the adaptive softmax's cluster rows are reversed (the reference PyTorch code reads cluster i from head
    column -i; megamemo uses the forward order);
  * per-cluster output biases (div_val > 1) are concatenated into one [n_token] bias;
  * buffers the reference keeps in its state_dict (pos_emb.inv_freq, *_logits_constant) are dropped.
Anything else unexpected (an unknown key, an unsupported attn_type or option) is an error that names it.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable

import torch

from megamemo.model import MemTransformerLM, ModelConfig
from megamemo.model.config import Variant
from megamemo.util.errors import MegamemoError

ATTN_TYPES = {0: "xl", 3: "lamemo", 31: "lamemo_xlrpe"}
CONFIG_KEYS = {
    "n_token",
    "n_layer",
    "n_head",
    "d_model",
    "d_head",
    "d_inner",
    "dropout",
    "dropatt",
    "tie_weight",
    "d_embed",
    "div_val",
    "tie_projs",
    "pre_lnorm",
    "tgt_len",
    "ext_len",
    "mem_len",
    "cutoffs",
    "same_length",
    "attn_type",
    "clamp_len",
    "sample_softmax",
    "adapt_inp",
    "dtype",
    "tgt_len_eval",
}


class ReferenceFormatError(MegamemoError, ValueError):
    pass


def load_weights_only(path) -> object:
    """A .pt file through torch's weights-only unpickler: tensors and plain data only, never code. A file whose
    unpickling would build anything else (a whole pickled model, or a payload) is refused, saying what it holds."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError...
        text = str(e)
        found = re.search(
            r"(unsupported GLOBAL [\w.]+|Unsupported global: GLOBAL [\w.]+|Unsupported operand \d+)", text, re.I
        )
        if found or "Weights only load failed" in text:
            what = f" ({found.group(0)})" if found else ""
            raise ReferenceFormatError(
                f"{path}: refused: unpickling it would build objects other than tensors and plain data{what}, which "
                f"could run code. megamemo reads .pt files with torch's weights-only loader only; a whole pickled "
                f"model (the reference train.py's torch.save(model)) must be saved as its state_dict first, with the "
                f"reference code: torch.save(torch.load(FILE).state_dict(), 'sd.pt')"
            ) from None
        first = text.strip().splitlines()[0][:200] if text.strip() else ""
        raise ReferenceFormatError(f"{path}: not a readable torch file ({type(e).__name__}: {first})") from None


def config_from_reference(ref: dict) -> ModelConfig:
    unknown = sorted(set(ref) - CONFIG_KEYS)
    if unknown:
        raise ReferenceFormatError(f"reference config: unknown keys {unknown}")
    attn_type = ref.get("attn_type", 0)
    if attn_type not in ATTN_TYPES:
        raise ReferenceFormatError(
            f"reference config: attn_type {attn_type} is not supported (supported: {sorted(ATTN_TYPES)})"
        )
    if ref.get("ext_len", 0):
        raise ReferenceFormatError(f"reference config: ext_len={ref['ext_len']} is not supported (only 0)")
    if ref.get("sample_softmax", -1) > 0:
        raise ReferenceFormatError("reference config: sample_softmax > 0 is not supported")
    d_model = ref["d_model"]
    d_embed = ref.get("d_embed") or d_model
    return ModelConfig(
        variant=typing.cast(Variant, ATTN_TYPES[attn_type]),
        n_token=ref["n_token"],
        n_layer=ref["n_layer"],
        d_model=d_model,
        n_head=ref["n_head"],
        d_head=ref["d_head"],
        d_inner=ref["d_inner"],
        dropout=float(ref.get("dropout", 0.0)),
        dropatt=float(ref.get("dropatt", 0.0)),
        tgt_len=ref.get("tgt_len") or 1,
        mem_len=ref.get("mem_len") or 0,
        clamp_len=ref.get("clamp_len", -1),
        same_length=bool(ref.get("same_length", False)),
        pre_lnorm=bool(ref.get("pre_lnorm", False)),
        cutoffs=list(ref.get("cutoffs") or []),
        div_val=ref.get("div_val", 1),
        tie_weight=bool(ref.get("tie_weight", True)),
        tie_projs=[bool(x) for x in (ref.get("tie_projs") or [False])],
        d_embed=None if d_embed == d_model else d_embed,
    ).validate()


def convert_state_dict(sd: dict, cfg: ModelConfig) -> dict:
    """Reference state_dict -> megamemo state_dict (for a model built from `cfg`)."""
    sd = dict(sd)
    out = {}

    def take(key):
        if key not in sd:
            raise ReferenceFormatError(f"reference state_dict: missing {key!r}")
        return sd.pop(key)

    for k in [k for k in sd if k == "pos_emb.inv_freq" or k.endswith("_logits_constant")]:
        sd.pop(k)
    for name in ("r_w_bias", "r_r_bias") + (("r_r_bias_future",) if cfg.future_bias else ()):
        out[name] = take(name)
    for li in range(cfg.n_layer):
        _take_layer(take, sd, li, out)
    n_parts = len(cfg.cutoffs) + 1
    n_tables = 1 if cfg.div_val == 1 else n_parts
    for i in range(n_tables):
        out[f"word_emb.emb_layers.{i}.weight"] = take(f"word_emb.emb_layers.{i}.weight")
    for k in [k for k in sd if re.fullmatch(r"word_emb\.emb_projs\.\d+", k)]:
        out[k] = sd.pop(k)
    _take_output(take, sd, cfg, out)
    if sd:
        raise ReferenceFormatError(f"reference state_dict: unexpected keys {sorted(sd)}")
    return out


def _take_layer(take: Callable[[str], torch.Tensor], sd: dict, li: int, out: dict) -> None:
    """Layer li's weights, reference names -> megamemo's (a fused qkv_net, or q_net and kv_net joined)."""
    a, m = f"layers.{li}.dec_attn", f"layers.{li}"
    if f"{a}.qkv_net.weight" in sd:
        out[f"{m}.attn.qkv.weight"] = take(f"{a}.qkv_net.weight")
    else:
        out[f"{m}.attn.qkv.weight"] = torch.cat([take(f"{a}.q_net.weight"), take(f"{a}.kv_net.weight")], 0)
    for p in ("r_net.weight", "o_net.weight", "layer_norm.weight", "layer_norm.bias"):
        out[f"{m}.attn.{p}"] = take(f"{a}.{p}")
    for src, dst in (("CoreNet.0", "fc1"), ("CoreNet.3", "fc2"), ("layer_norm", "layer_norm")):
        for p in ("weight", "bias"):
            out[f"{m}.ff.{dst}.{p}"] = take(f"{m}.pos_ff.{src}.{p}")


def _take_output(take: Callable[[str], torch.Tensor], sd: dict, cfg: ModelConfig, out: dict) -> None:
    """The output side (crit.*): weights (or their check against the tied embedding), biases, clusters, and
    projections (tied ones checked against the embedding's)."""
    n_parts = len(cfg.cutoffs) + 1
    n_tables = 1 if cfg.div_val == 1 else n_parts
    biases = []
    for i in range(n_tables):
        w = take(f"crit.out_layers.{i}.weight")
        if cfg.tie_weight:
            if not torch.equal(w, out[f"word_emb.emb_layers.{i}.weight"]):
                raise ReferenceFormatError(
                    f"reference state_dict: crit.out_layers.{i}.weight should be tied to "
                    f"word_emb.emb_layers.{i}.weight but differs"
                )
        else:
            out[f"crit.out_weights.{i}"] = w
        biases.append(take(f"crit.out_layers.{i}.bias"))
    out["crit.out_bias"] = torch.cat(biases)
    if cfg.cutoffs:
        out["crit.cluster_weight"] = take("crit.cluster_weight").flip(0)
        out["crit.cluster_bias"] = take("crit.cluster_bias").flip(0)
    tie_projs = list(cfg.tie_projs) + [cfg.tie_projs[-1]] * (n_parts - len(cfg.tie_projs))
    for i in range(n_parts):
        key = f"crit.out_projs.{i}"
        if key not in sd:
            continue
        p = sd.pop(key)
        if tie_projs[i]:
            src = f"word_emb.emb_projs.{0 if cfg.div_val == 1 else i}"
            if src in out and not torch.equal(p, out[src]):
                raise ReferenceFormatError(f"reference state_dict: {key} should be tied to {src} but differs")
        else:
            out[key] = p


def import_reference(ref_config: dict, state_dict: dict) -> MemTransformerLM:
    """Build a megamemo model holding the reference weights."""
    cfg = config_from_reference(ref_config)
    model = MemTransformerLM(cfg)
    converted = convert_state_dict(state_dict, cfg)
    missing, unexpected = model.load_state_dict(converted, strict=False)
    if missing or unexpected:
        raise ReferenceFormatError(
            f"reference weights do not fit the model: missing {missing}, unexpected {unexpected}"
        )
    return model

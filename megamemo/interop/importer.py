"""`megamemo convert import-reference`: a thu-coai/LaMemo or kimiyoung/transformer-xl checkpoint -> a single-device
checkpoint (megamemo/checkpoint/single.py), replaying the file's reference NLL as a check when it carries one."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megamemo.checkpoint.single import SingleCheckpointError, save_single
from megamemo.interop.reference import ReferenceFormatError, config_from_reference, import_reference, load_weights_only
from megamemo.model.scoring import score_segments


class ReferenceImportError(SingleCheckpointError):
    """A reference file that cannot be imported; the message names it."""


@dataclass(frozen=True)
class ImportReference:
    """What `megamemo convert import-reference` asks of a reference file: each field is one of its flags
    (megamemo/commands/convert.py makes them from these fields, their comments the flags' help)."""

    out: str  # new directory for the single-device checkpoint
    config: str | None = None  # JSON file with the reference MemTransformerLM constructor arguments


def import_reference_file(path, request: ImportReference, log=print) -> Path:
    """A thu-coai/LaMemo or kimiyoung/transformer-xl checkpoint -> a single-device checkpoint. FILE is either a
    dict with `state_dict` and `config` (the constructor's keyword arguments; ../shared/reference's format, whose
    `inputs`/`targets`/`nll` are then replayed as a check) or a bare state_dict with --config JSON."""
    src, out, config_path = Path(path), Path(request.out), request.config
    if out.exists():
        raise ReferenceImportError(f"{out}: already exists; refusing to overwrite")
    try:
        g = load_weights_only(src)
    except ReferenceFormatError as e:
        raise ReferenceImportError(str(e)) from None
    if not isinstance(g, dict):
        raise ReferenceImportError(f"{src}: expected a dict, got {type(g).__name__}")
    if "state_dict" in g:
        sd, ref_cfg = g["state_dict"], g.get("config")
    else:
        sd, ref_cfg = g, None
    if sd and all(k.startswith("module.") for k in sd):  # saved from a DistributedDataParallel wrapper
        sd = {k[len("module.") :]: v for k, v in sd.items()}
    if config_path is not None:
        try:
            ref_cfg = json.loads(Path(config_path).read_text())
        except (OSError, ValueError) as e:
            raise ReferenceImportError(f"--config {config_path}: unreadable JSON ({e})") from None
    if not isinstance(ref_cfg, dict):
        raise ReferenceImportError(
            f"{src}: no constructor config (a 'config' entry, or --config JSON with the "
            f"MemTransformerLM keyword arguments)"
        )
    try:
        model = import_reference(ref_cfg, sd).eval()
    except (ReferenceFormatError, ValueError, KeyError) as e:
        raise ReferenceImportError(f"{src}: {e}") from None
    meta = {
        "source": str(src),
        "imported_from": g.get("reference") or _reference_kind(sd),
        "reference_config": {
            k: v for k, v in ref_cfg.items() if isinstance(v, (int, float, bool, str, list)) or v is None
        },
    }
    if all(k in g for k in ("inputs", "targets", "nll")):
        worst = 0.0

        def compare(scores, x, y, nll):
            nonlocal worst
            want = g["nll"][scores.segments - 1]
            worst = max(worst, float((nll.float() - want.float()).abs().max()))

        score_segments(
            model, zip(g["inputs"], g["targets"], strict=True), on_segment=compare, max_segments=len(g["nll"])
        )
        if worst > 1e-5:
            raise ReferenceImportError(
                f"{src}: the imported model's NLL differs from the file's reference NLL by "
                f"{worst:.3g} (> 1e-5); nothing written"
            )
        meta["check"] = {"segments": len(g["nll"]), "max_abs_diff": worst, "tolerance": 1e-5}
        log(
            f"[convert] check: imported model reproduces the reference per-token NLL over {len(g['nll'])} segments "
            f"(max |diff| {worst:.2e})"
        )
    config_from_reference(ref_cfg)
    return save_single(out, model.cfg, model.state_dict(), meta=meta)


def _reference_kind(sd: dict) -> str:
    if any(k.endswith("dec_attn.q_net.weight") for k in sd):
        return "thu-coai/LaMemo"
    return "kimiyoung/transformer-xl (or LaMemo with a fused qkv_net)"

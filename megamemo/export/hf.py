"""What `megamemo export hf` does (megamemo/commands/export.py): a trained model as a Hugging Face transformers
directory that loads without megamemo.

    megamemo export hf --ckpt CKPT --out DIR [--overwrite] [--data SHARD_DIR]

CKPT is a single-device checkpoint, a run directory or a checkpoint directory (the latter two are converted through
`megamemo convert to-single` into a temporary directory first, which verifies the commit marker and every sha256).
DIR gets:
  config.json              the model config with `auto_map` (AutoConfig, AutoModelForCausalLM -> the files below)
  configuration_megamemo.py, modeling_megamemo.py
                           the model restated in plain torch + transformers (megamemo/export/hf_code/): loaded with
                           `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`
  model.safetensors        megamemo's weights under megamemo's names, in the checkpoint's dtype
  tokenizer.json (+ tokenizer_config.json)
                           bytes/chars vocabularies: byte-level, each byte to the id megamemo gives it; words: the
                           word list (<eos> closes a line, <unk> for unknown words); a subword tokenizer the
                           checkpoint records (tokenizer.file + sha256) is copied
  generation_config.json   megamemo generate's defaults (nucleus sampling, top_p 0.95, no top-k)
DIR appears by an atomic rename; an existing DIR is refused unless --overwrite, and a failure leaves nothing.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megamemo.checkpoint.single import load_single
from megamemo.interop.convert import ToSingle, to_single
from megamemo.interop.load import is_single
from megamemo.interop.vocabulary import start_symbol, vocab_for
from megamemo.util.errors import MegamemoError
from megamemo.util.files import atomic_directory, entry_mismatch, file_sha256, save_tensors

CODE = Path(__file__).with_name("hf_code")
CODE_FILES = ("configuration_megamemo.py", "modeling_megamemo.py")
KNOWN_VARIANTS = ("lamemo", "lamemo_xlrpe", "lamemo_no_interp", "lamemo_no_lookahead", "xl", "rpe")
GENERATION = {"do_sample": True, "top_p": 0.95, "top_k": 0, "temperature": 1.0}


class ExportError(MegamemoError, ValueError):
    """A checkpoint or output directory the export refuses; the message names it."""


# ---- tokenizers ------------------------------------------------------------------------------------------------
def _bytes_to_unicode() -> list[str]:
    """The ByteLevel pre-tokenizer's byte -> character table (printable bytes stand for themselves, the others
    are shifted to 256 + k in order)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, shift = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + shift))
            shift += 1
    return out


def byte_tokenizer(vocab):
    """A `tokenizers` Tokenizer for a bytes/chars vocabulary: UTF-8 bytes of the text, each mapped to its id in
    `vocab` (a BPE without merges over the byte-level alphabet); decoding gives the bytes back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # optional (the eval extra), heavy

    table = _bytes_to_unicode()
    ids = {table[vocab.symbol_byte(s)]: i for i, s in enumerate(vocab.symbols)}
    tok = Tokenizer(models.BPE(vocab=ids, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def word_tokenizer(vocab):
    """Word vocabularies: whitespace-separated words, a newline is <eos> (as megamemo's prompts and corpora)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers  # optional (the eval extra)

    unk = "<unk>" if "<unk>" in vocab.sym2idx else None
    tok = Tokenizer(models.WordLevel(vocab=dict(vocab.sym2idx), unk_token=unk))
    if "<eos>" in vocab.sym2idx:
        tok.normalizer = normalizers.Replace(Regex("\n"), " <eos> ")
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def start_tokens(vocab) -> dict:
    """BOS = EOS = the token a stream with no context starts from (megamemo.interop.vocabulary.start_symbol: <eos>,
    else a newline, else a space), as the tokenizer spells it: lm-eval's `--model hf` prefixes every rolling window
    with the BOS, and generate() pads with the EOS. {} for a vocabulary with none of them."""
    sym = start_symbol(vocab)
    if sym is None:
        return {}
    token = sym if vocab.kind == "words" else _bytes_to_unicode()[vocab.symbol_byte(sym)]
    return {"bos_token": token, "eos_token": token}


def write_tokenizer(meta: dict, dirs: list[Path], out: Path, data=None) -> str:
    """The tokenizer files for the checkpoint's vocabulary into `out`; -> what was written, in words. A subword
    tokenizer's file is looked for in `dirs` (the checkpoint's directories), then in the shard directory."""
    from transformers import PreTrainedTokenizerFast  # optional (the eval extra), heavy

    rec = meta.get("tokenizer") or {}
    if isinstance(rec, dict) and rec.get("file") and not data:
        where = [d / rec["file"] for d in dirs]
        if (meta.get("data") or {}).get("dir"):
            where.append(Path(meta["data"]["dir"]) / rec["file"])
        src = next((p for p in where if p.is_file()), None)
        if src is None:
            raise ExportError(
                f"{dirs[0] / 'config.json'}: tokenizer file {rec['file']!r} not found in "
                f"{' or '.join(str(p.parent) for p in where)}"
            )
        problem = entry_mismatch(
            {"sha256": rec.get("sha256")},
            src.stat().st_size,
            lambda: file_sha256(src),
            recorded="the checkpoint's tokenizer.sha256",
        )
        if problem:
            raise ExportError(f"{src}: {problem} (corrupt or replaced)")
        eod = {"bos_token": rec["eod"], "eos_token": rec["eod"]} if rec.get("eod") else {}
        tok = PreTrainedTokenizerFast(tokenizer_file=str(src), **eod)
        tok.save_pretrained(str(out))
        return f"subword tokenizer {src.name} ({rec.get('kind', '?')}, {len(tok)} entries)"
    try:
        vocab = vocab_for(meta, data)
    except ValueError as e:
        raise ExportError(f"{dirs[0]}: {e}") from None
    tok = byte_tokenizer(vocab) if vocab.kind in ("bytes", "chars") else word_tokenizer(vocab)
    specials: dict[str, object] = {"unk_token": "<unk>"} if vocab.kind == "words" and "<unk>" in vocab.sym2idx else {}
    start = start_tokens(vocab)
    # split_special_tokens: the text's own "Ċ" (U+010A) stays its two UTF-8 bytes, not the newline BOS it spells
    specials.update(start, split_special_tokens=bool(start))
    PreTrainedTokenizerFast(tokenizer_object=tok, **specials).save_pretrained(str(out))
    return f"{vocab.kind} tokenizer ({len(vocab)} symbols)"


# ---- the export ------------------------------------------------------------------------------------------------
def hf_config(model_cfg: dict, dtype: str, source: str) -> dict:
    fields = dict(model_cfg)
    fields.pop("init_std", None), fields.pop("proj_init_std", None), fields.pop("future_bias_init", None)
    return {
        **fields,
        "model_type": "megamemo",
        "architectures": ["MegamemoForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_megamemo.MegamemoConfig",
            "AutoModelForCausalLM": "modeling_megamemo.MegamemoForCausalLM",
        },
        "generation_mem_len": model_cfg["mem_len"] + model_cfg["tgt_len"] - 1,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "megamemo_source": source,
    }


def _check_variant(single: Path) -> None:
    try:
        variant = (json.loads((single / "config.json").read_text()).get("model") or {}).get("variant")
    except (OSError, ValueError) as e:
        raise ExportError(f"{single / 'config.json'}: unreadable ({e})") from None
    if variant not in KNOWN_VARIANTS:
        raise ExportError(
            f"{single / 'config.json'}: model.variant {variant!r} is not one the export knows "
            f"({', '.join(KNOWN_VARIANTS)})"
        )


@dataclass(frozen=True)
class Request:
    """What `megamemo export hf` asks of a checkpoint: each field is one of its flags (megamemo/commands/export.py
    makes them from these fields, their comments the flags' help)."""

    out: str  # the new directory
    overwrite: bool = False  # replace --out if it exists
    data: str | None = None  # shard directory whose vocabulary to use (default: the checkpoint's)


def export_hf(ckpt, request: Request, log=print) -> dict:
    """The checkpoint `ckpt` (single-device, or a training checkpoint of any layout) written as request.out, a
    Hugging Face directory -> a summary dict. Raises ExportError / SingleCheckpointError naming the bad file or
    directory."""
    ckpt, out, overwrite, data = Path(ckpt), Path(request.out), request.overwrite, request.data
    if out.exists() and not overwrite:
        raise ExportError(f"{out}: already exists (pass --overwrite to replace it)")
    if not ckpt.is_dir():
        raise ExportError(f"{ckpt}: not a directory")
    # a training checkpoint is converted into a work directory beside DIR first, deleted afterwards
    work = Path(tempfile.mkdtemp(prefix=".export-", dir=out.parent if out.parent.is_dir() else None))
    try:
        single = ckpt
        if is_single(ckpt):
            _check_variant(ckpt)
        else:
            single = work / "single"
            log(f"[export] {ckpt} is a training checkpoint: converting it to a single-device one first")
            to_single(ckpt, ToSingle(out=str(single)), log=log)
            _check_variant(single)
        model, meta = load_single(single)
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        dtype = str(next(iter(sd.values())).dtype).removeprefix("torch.")
        # --overwrite: the old directory goes only once the new one is in (util.files.atomic_directory)
        with atomic_directory(out, replace=overwrite) as tmp:
            save_tensors(sd, tmp / "model.safetensors", metadata={"format": "pt"})
            for name in CODE_FILES:
                shutil.copyfile(CODE / name, tmp / name)
            import transformers  # optional (the eval extra), heavy

            cfg = hf_config(model.cfg.to_dict(), dtype, str(ckpt))
            cfg["transformers_version"] = transformers.__version__
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            (tmp / "generation_config.json").write_text(
                json.dumps({**GENERATION, "transformers_version": transformers.__version__}, indent=2) + "\n"
            )
            tok = write_tokenizer(meta, list(dict.fromkeys([single, ckpt])), tmp, data)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = sum(t.numel() for t in sd.values())
    return {"out": str(out), "variant": model.cfg.variant, "parameters": n, "dtype": dtype, "tokenizer": tok}

"""lm-evaluation-harness (lm-eval 0.4.x, `pip install megamemo[eval]`): the registered model `megamemo` and what the
offline command `megamemo harness` runs (megamemo/commands/harness.py).

    lm_eval --model megamemo --model_args ckpt=CKPT[,dtype=fp32,mem_len=N,max_gen_toks=256] [--device D] --tasks ...
    megamemo harness --ckpt CKPT --text FILE... [--json OUT] [--device D] [--mem-len N]

CKPT is what `megamemo eval` takes (a single-device checkpoint, a run or checkpoint directory). Text is encoded with
the checkpoint's vocabulary as `megamemo generate` encodes a prompt (bytes/chars: the UTF-8 bytes; words: whitespace
words, <eos> closing each line). Every score goes through megamemo's evaluation loop (megamemo/model/scoring.py,
`evaluate`): segments of the training tgt_len, batch 1, memory carried from segment to segment, so
`loglikelihood_rolling` of a document is megamemo's streaming evaluation of it: its first token is not predicted
(no BOS exists in these vocabularies) and every later one is, once, with the memory of all before it (no
re-encoded windows). `loglikelihood` scores a continuation after its context the same way (an empty context
starts from <eos> for words, a newline or else a space for bytes/chars); `generate_until` decodes greedily (or
samples, with do_sample) through `megamemo generate`'s decoder.

`megamemo harness` runs one lm-eval rolling-loglikelihood task over the given files (one document per file, no
hub, no download) and reports lm-eval's `word_perplexity`, `byte_perplexity` and `bits_per_byte`.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import lm_eval
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import simple_parse_args_string

from megamemo.export.harness_request import Request
from megamemo.interop.load import open_model
from megamemo.interop.vocabulary import encode_prompt, start_symbol, vocab_for
from megamemo.model.generation import generate
from megamemo.model.scoring import evaluate
from megamemo.runtime.device import torch_device
from megamemo.util.errors import UsageError

TASK = "megamemo_text"
METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")


def lm_eval_arguments(model_args: dict, lm_eval_config: dict | None) -> dict:
    """The constructor's arguments from lm_eval's two sources: `--model_args` and what lm_eval adds to every model
    (batch_size, max_batch_size, device: its --device, `cuda:0` unless given). The device is lm_eval's --device; a
    `device` in --model_args is the same setting and wins (LM.create_from_arg_* would pass it twice: a TypeError)."""
    extra = {k: v for k, v in (lm_eval_config or {}).items() if v is not None and k not in model_args}
    return {**model_args, **extra}


@register_model("megamemo")
class MegamemoLM(LM):
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        return cls(**lm_eval_arguments(simple_parse_args_string(arg_string), additional_config))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        return cls(**lm_eval_arguments(dict(arg_dict), additional_config))

    def __init__(
        self,
        ckpt: str,
        device: str | None = None,
        dtype: str = "checkpoint",
        mem_len: int | None = None,
        max_gen_toks: int = 256,
        data: str | None = None,
        **_ignored,
    ):
        super().__init__()
        if device not in (None, "auto") and str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm_eval passes --device (default cuda) to every model; HFLM falls back too
            print(f"[lm-eval] megamemo: device {device!r} is not available here, using the CPU", file=sys.stderr)
            device = "auto"
        device = torch_device(device)
        self.model, meta = open_model(ckpt, device, dtype)
        self.model.cfg.check_lengths(**{"--mem-len": None if mem_len is None else int(mem_len)})
        self.vocab = vocab_for(meta, data)
        if len(self.vocab) > self.model.cfg.vocab_size:
            raise UsageError(
                f"{ckpt}: vocabulary of {len(self.vocab)} symbols does not fit the model's "
                f"{self.model.cfg.vocab_size} (model.n_vocab or n_token)"
            )
        self._device = torch.device(device)
        self.mem_len = self.model.cfg.mem_len if mem_len is None else int(mem_len)
        self.max_gen_toks = int(max_gen_toks)
        self.ckpt = str(ckpt)

    # ---- text <-> ids --------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return encode_prompt(self.vocab, text.encode("utf-8"), "lm-eval request")

    def start_token(self) -> int:
        """The context of a request whose context is empty."""
        sym = start_symbol(self.vocab)
        return 0 if sym is None else self.vocab.sym2idx[sym]

    # ---- scoring through megamemo's evaluation loop --------------------------------------------------------
    def score(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (NLL [n-1] of ids[1:], each given all before it; whether each was the most likely token), memory
        carried over segments of tgt_len (batch 1: megamemo eval's batches of one stream)."""
        t = torch.tensor(ids, dtype=torch.long)
        L = self.model.cfg.tgt_len
        batches = (
            (t[s : s + n, None], t[s + 1 : s + 1 + n, None])
            for s in range(0, t.numel() - 1, L)
            for n in [min(L, t.numel() - 1 - s)]
        )
        nll: list[torch.Tensor] = []
        hit: list[torch.Tensor] = []

        def on_segment(n, h) -> None:
            nll.append(n[:, 0].double().cpu())
            hit.append(h[:, 0].cpu())

        evaluate(self.model, batches, mem_len=self.mem_len, device=self._device, on_segment=on_segment)
        if not nll:
            return torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.bool)
        return torch.cat(nll), torch.cat(hit)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args
            ctx = self.encode(context) or [self.start_token()]
            cont = self.encode(continuation)
            nll, hit = self.score(ctx + cont)
            nll, hit = nll[len(ctx) - 1 :], hit[len(ctx) - 1 :]
            out.append((-float(nll.sum()), bool(hit.all())))
            self.cache_hook.add_partial("loglikelihood", (context, continuation), out[-1])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            (text,) = req.args
            out.append(-float(self.score(self.encode(text))[0].sum()))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), out[-1])
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, kw = req.args
            kw = dict(kw or {})
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            n = int(kw.get("max_gen_toks", self.max_gen_toks))
            ids = self.encode(context) or [self.start_token()]
            sample = bool(kw.get("do_sample", False)) and float(kw.get("temperature", 1.0)) > 0
            new = generate(
                self.model,
                ids,
                n,
                greedy=not sample,
                top_p=float(kw.get("top_p", 1.0)),
                temperature=float(kw.get("temperature", 1.0)),
                seed=int(kw.get("seed", 0)),
            )
            text = self.vocab.decode(new)
            for stop in until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, kw), text)
        return out


# ---- megamemo harness --------------------------------------------------------------------------------------------
def read_texts(files: list[str]) -> list[dict]:
    docs = []
    for f in files:
        try:
            text = Path(f).read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"{f}: not UTF-8 text ({e})") from None
        if not text.strip():
            raise UsageError(f"{f}: empty text (nothing to score)")
        docs.append({"path": str(f), "text": text})
    return docs


def text_task(docs: list[dict]):
    """An lm-eval rolling-loglikelihood task over the documents, held in memory (no dataset download)."""
    # heavy: only when a task runs, not when this module is imported to register the model
    import datasets
    from lm_eval.api.task import ConfigurableTask

    config = {
        "task": TASK,
        "output_type": "loglikelihood_rolling",
        "test_split": "test",
        "custom_dataset": lambda **_: {"test": datasets.Dataset.from_list(docs)},
        "doc_to_text": "",
        "doc_to_target": lambda doc: doc["text"],
        "metric_list": [
            {
                "metric": m,
                "aggregation": "bits_per_byte" if m == "bits_per_byte" else "weighted_perplexity",
                "higher_is_better": False,
            }
            for m in METRICS
        ],
        "metadata": {"version": 1.0},
    }
    return ConfigurableTask(config=config)


def run_harness(ckpt, request: Request) -> dict:
    """The task over request.text's files, scored by lm-eval -> its metrics and what was scored."""
    from lm_eval.evaluator import evaluate as lm_eval_evaluate  # heavy: only when the harness runs

    docs = read_texts(request.text)
    lm = MegamemoLM(ckpt, device=request.device, mem_len=request.mem_len)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notes on custom datasets are not for this user
    # lm-eval's own evaluation of the task, without simple_evaluate's index of every installed task (20 s of YAML)
    res = lm_eval_evaluate(
        lm=lm,
        task_dict={"tasks": {TASK: text_task(docs)}, "groups": {}, "group_map": {}},
        bootstrap_iters=0,
        log_samples=False,
    )["results"][TASK]
    out: dict[str, Any] = {m: float(res[f"{m},none"]) for m in METRICS}
    out.update(
        {
            "ckpt": str(ckpt),
            "files": [d["path"] for d in docs],
            "variant": lm.model.cfg.variant,
            "tgt_len": lm.model.cfg.tgt_len,
            "mem_len": lm.mem_len,
            "lm_eval": lm_eval.__version__,
            "bytes": sum(len(d["text"].encode("utf-8")) for d in docs),
        }
    )
    return out

"""Run as a program (`python -I hf_without_megamemo.py JOB.json OUT.json`): loads exported directories with
transformers alone, in a Python where `import megamemo` fails, and writes what the tests compare with megamemo.

JOB: a list of {"dir", "tokens": [ids], "segment": L, "prompt": [ids], "new": N, "text": str} ->
OUT: per job {"nll": per-token NLL of tokens[1:] scored segment by segment with the cache, "greedy": N token ids
greedily generated after prompt, "encoded": the exported tokenizer's ids of text, "loss": labels' loss of the
first segment, "nll_first": that segment's mean NLL as read off the logits, "vocab" and "targets": the sizes of its two
reductions; with "bf16": whether the model loaded in bf16 computes its position sinusoids in fp32}."""

import importlib.abc
import json
import sys


class _NoMegamemo(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("megamemo",):
            raise ImportError(f"{name} is blocked in this process")
        return None


sys.meta_path.insert(0, _NoMegamemo())
try:
    import megamemo  # noqa: F401

    sys.exit("megamemo is importable: the isolation failed")
except ImportError:
    pass

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402


def run(job: dict) -> dict:
    model = AutoModelForCausalLM.from_pretrained(job["dir"], trust_remote_code=True).eval()
    out = {"class": type(model).__name__, "module": type(model).__module__}
    ids = torch.tensor(job["tokens"])[None]
    L, cache, nll = job["segment"], None, []
    with torch.no_grad():
        for s in range(0, ids.size(1) - 1, L):
            inp, tgt = ids[:, s : s + L], ids[:, s + 1 : s + L + 1]
            inp = inp[:, : tgt.size(1)]
            o = model(inp, past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            nll += (-o.logits.log_softmax(-1).gather(2, tgt[..., None])[0, :, 0]).tolist()
        first = ids[:, : L + 1]
        o = model(first, labels=first)
        out["loss"] = float(o.loss)
        out["nll_first"] = float(-o.logits[:, :-1].log_softmax(-1).gather(2, first[:, 1:, None]).mean())
        out["vocab"], out["targets"] = o.logits.size(-1), first.size(1) - 1
        if job.get("new"):
            g = model.generate(torch.tensor(job["prompt"])[None], max_new_tokens=job["new"], do_sample=False)
            out["greedy"] = g[0, len(job["prompt"]) :].tolist()
    out["nll"] = nll
    if job.get("bf16"):  # positions in fp32 whatever the dtype: the bf16 model's sinusoids are the fp32 ones, cast
        low = AutoModelForCausalLM.from_pretrained(job["dir"], trust_remote_code=True, dtype=torch.bfloat16).eval()
        klen = 5000
        want = model._sinusoids(klen, 0, torch.float32, "cpu").to(torch.bfloat16)
        out["bf16_positions_exact"] = bool(torch.equal(low._sinusoids(klen, 0, torch.bfloat16, "cpu"), want))
        out["bf16_dtype"] = str(next(low.parameters()).dtype)
    if "text" in job:
        tok = AutoTokenizer.from_pretrained(job["dir"])
        out["encoded"] = tok(job["text"])["input_ids"]
        out["decoded"] = tok.decode(out["encoded"])
    return out


if __name__ == "__main__":
    jobs = json.loads(open(sys.argv[1]).read())
    json.dump([run(j) for j in jobs], open(sys.argv[2], "w"))

"""A committed training checkpoint of any layout (TP x PP x DP, ZeRO 0-2, fp32/bf16/fp16) read back in
single-device form: weights, Adam moments and memory under the single-device model's names, checked for
completeness and consistency on the way.

DeepSpeed 0.19 files of one checkpoint (m = model-parallel rank = stage * tp + tp_rank; m = tp_rank without PP):
    mp_rank_<m>_model_states.pt                  module (TP shard; None under PP), param_shapes, LR scheduler, counters
    layer_<i>-model_<t>-model_states.pt          PP only: the weights of pipe layer i (spec index) on TP rank t
    [bf16_]zero_pp_rank_<d>_mp_rank_<m>_optim_states.pt   ZeRO 1/2: DP rank d's partition of every flattened
                                                 parameter group (fp32 masters, exp_avg, exp_avg_sq)
    megamemo/rank_<r>.json/.safetensors          per rank: layout (dp/tp/pp ranks, global columns of each micro-
                                                 batch), data cursor, counters, memory per micro-batch
Pipe layer i (megamemo/parallel/pipeline.py): 0 embedding, 1+2l relative biases (tied), 2+2l layer l,
2n+1 the tied embedding (output), 2n+2 the output bias.

Every reading error is a ConvertError naming the file (or the marker) that is missing, extra or inconsistent.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from megamemo.checkpoint.single import SingleCheckpointError
from megamemo.checkpoint.state import read_json
from megamemo.model import Memory, MemTransformerLM, ModelConfig
from megamemo.parallel.tensor import merge_memory_tensors, merge_tensors

PROBE_FILE = "megamemo/probe.safetensors"
_OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_LAYER_RE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")


class ConvertError(SingleCheckpointError):
    """A training checkpoint that cannot be converted; the message names the directory or file."""


def load_pt(path: Path) -> dict:
    """A DeepSpeed file through torch's weights-only unpickler (never runs pickled code)."""
    from megamemo.train.engine import safe_load

    if not path.is_file():
        raise ConvertError(f"{path}: missing")
    try:
        return safe_load(path)
    except Exception as e:  # noqa: BLE001 - any unpickling problem is reported with the file name
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConvertError(f"{path}: cannot be loaded safely (truncated or not a DeepSpeed file?): "
                           f"{type(e).__name__}: {first[:300]}") from None


def _numel(shape) -> int:
    return int(math.prod(shape))


# ---- names: pipe layers -> single-device model ---------------------------------------------------------------
def pipe_to_single(cfg: ModelConfig, key: str) -> str:
    """A pipeline stage's parameter name ('tied_modules.embed.weight', '4.layer.attn.qkv.weight') or a layer
    file's key prefixed with its spec index ('0.weight') -> the single-device name."""
    n = cfg.n_layer
    if key.startswith("tied_modules.embed."):
        idx, rest = 0, key[len("tied_modules.embed."):]
    elif key.startswith("tied_modules.relbias."):
        idx, rest = 1, key[len("tied_modules.relbias."):]
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
        return f"layers.{(idx - 2) // 2}.{rest[len('layer.'):]}"
    raise ValueError(f"{key}: no single-device parameter for pipe layer {idx} (n_layer={n})")


def stage_layers(cfg: ModelConfig, pp: int, stage: int) -> tuple[int, int]:
    """[start, stop) spec indices of a stage (the same split as the trainer's)."""
    from megamemo.parallel.pipeline import stage_bounds

    b = stage_bounds(cfg.n_layer, pp, 2 * cfg.n_layer + 3)
    return b[stage], b[stage + 1]


def stage_memory_names(cfg: ModelConfig, pp: int, stage: int, names) -> list[str]:
    """The memory tensors a pipeline stage keeps: its layers' (ctx.l, lse.l, hid.l) and, first stage, emb."""
    start, stop = stage_layers(cfg, pp, stage)
    out = []
    for name in names:
        head, _, tail = name.partition(".")
        if name == "emb":
            keep = start == 0
        elif tail.isdigit():
            keep = start <= 2 + 2 * int(tail) < stop
        else:
            raise ConvertError(f"memory tensor {name!r}: unknown kind")
        if keep:
            out.append(name)
    return out


# ---- flat ZeRO partitions -> parameters ----------------------------------------------------------------------
def unflatten(parts: list[torch.Tensor], shapes: dict, paddings: list[int] | None, n_ranks: int,
              where: str) -> dict[str, torch.Tensor]:
    """One flattened parameter group, given as the partitions of every DP rank in rank order, cut back into its
    parameters (in `shapes` order, skipping DeepSpeed's per-parameter alignment padding)."""
    flat = torch.cat([p.reshape(-1) for p in parts])
    out, off = {}, 0
    for i, (name, shape) in enumerate(shapes.items()):
        n = _numel(shape)
        if off + n > flat.numel():
            raise ConvertError(f"{where}: the partitions hold {flat.numel()} values, too few for {name} at "
                               f"offset {off}")
        out[name] = flat[off:off + n].view(tuple(shape)).clone()
        off += n + (paddings[i] if paddings is not None else 0)
    align = 2 * n_ranks                 # DeepSpeed pads each flattened group to a multiple of 2 x ranks
    if -(-off // align) * align != -(-flat.numel() // align) * align:
        raise ConvertError(f"{where}: the partitions hold {flat.numel()} values but the parameters use {off}: "
                           f"the layout is not understood")
    return out


# ---- the checkpoint ------------------------------------------------------------------------------------------
class TrainingCheckpoint:
    """A committed DeepSpeed checkpoint written by `megamemo train`, in any layout."""

    def __init__(self, step_dir: Path, marker: dict):
        self.dir = Path(step_dir)
        self.marker = marker
        self.where = self.dir / "COMMITTED"
        if "model" not in marker:
            raise ConvertError(f"{self.where}: no model config recorded")
        self.cfg = ModelConfig.from_dict(marker["model"], where=f"{self.where}:model")
        lay = marker.get("layout") or {}
        try:
            self.tp, self.pp, self.dp = int(lay.get("tp", 1)), int(lay.get("pp", 1)), int(lay["dp"])
            self.world = int(marker.get("world_size", lay.get("world_size")))
        except (KeyError, TypeError, ValueError):
            raise ConvertError(f"{self.where}: layout {lay} lacks dp/tp/pp/world_size") from None
        if self.tp * self.pp * self.dp != self.world:
            raise ConvertError(f"{self.where}: tp {self.tp} x pp {self.pp} x dp {self.dp} != world size "
                               f"{self.world}")
        self.layout = lay
        self.zero = int(lay.get("zero_stage", 1))
        self.precision = marker.get("precision", "fp32")
        self.n_specs = 2 * self.cfg.n_layer + 3
        self._model_files: dict[int, dict] = {}
        self.ranks = self._read_rank_layouts()
        self._check_files()

    # ---- completeness ------------------------------------------------------------------------------------
    def _read_rank_layouts(self) -> list[dict]:
        rank_dir = self.dir / "megamemo"
        want = {f"rank_{r:05d}.{ext}" for r in range(self.world) for ext in ("json", "safetensors")}
        have = {p.name for p in rank_dir.glob("rank_*")} if rank_dir.is_dir() else set()
        missing, extra = sorted(want - have), sorted(have - want)
        if missing:
            raise ConvertError(f"{rank_dir / missing[0]}: missing (world size {self.world})")
        if extra:
            raise ConvertError(f"{rank_dir / extra[0]}: unexpected rank file (the checkpoint's world size is "
                               f"{self.world})")
        out, seen = [], {}
        for r in range(self.world):
            js = rank_dir / f"rank_{r:05d}.json"
            doc = read_json(js, ConvertError)
            lay = doc.get("layout")
            if not isinstance(lay, dict):
                raise ConvertError(f"{js}: no layout recorded")
            for key, v in (("tp", self.tp), ("pp", self.pp), ("dp", self.dp)):
                if int(lay.get(key, 1)) != v:
                    raise ConvertError(f"{js}: layout {key}={lay.get(key)} but {self.where} says {v}")
            coord = (int(lay["dp_rank"]), int(lay.get("tp_rank", 0)), int(lay.get("pp_rank", 0)))
            if coord in seen:
                raise ConvertError(f"{js}: (dp, tp, pp) rank {coord} also held by rank {seen[coord]}")
            seen[coord] = r
            out.append({"rank": r, "json": js, "tensors": js.with_suffix(".safetensors"), "doc": doc,
                        "dp_rank": coord[0], "tp_rank": coord[1], "pp_rank": coord[2],
                        "micro_batches": [tuple(c) for c in lay["micro_batches"]]})
        return out

    def _expected_files(self) -> set[str]:
        mp = self.tp * self.pp
        want = {f"mp_rank_{m:02d}_model_states.pt" for m in range(mp)}
        if self.pp > 1:
            want |= {f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in range(self.n_specs)
                     for t in range(self.tp)}
        return want

    def _check_files(self) -> None:
        want = self._expected_files()
        have = {p.name for p in self.dir.glob("*model_states.pt")}
        for missing in sorted(want - have):
            raise ConvertError(f"{self.dir / missing}: missing (layout tp={self.tp} pp={self.pp} dp={self.dp})")
        for extra in sorted(have - want):
            raise ConvertError(f"{self.dir / extra}: unexpected shard for layout tp={self.tp} pp={self.pp} "
                               f"dp={self.dp}")
        optim = {p.name: _OPTIM_RE.match(p.name) for p in self.dir.glob("*_optim_states.pt")}
        mp = self.tp * self.pp
        got = set()
        for name, m in sorted(optim.items()):
            if m is None or int(m.group(1)) >= self.dp or int(m.group(2)) >= mp:
                raise ConvertError(f"{self.dir / name}: unexpected optimizer shard for layout tp={self.tp} "
                                   f"pp={self.pp} dp={self.dp}")
            got.add((int(m.group(1)), int(m.group(2))))
        if self.zero >= 1 or got:
            for d in range(self.dp):
                for m in range(mp):
                    if (d, m) not in got:
                        raise ConvertError(f"{self.dir / f'zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt'}: "
                                           f"missing (ZeRO stage {self.zero}, dp={self.dp})")
        self._optim_names = {(int(m.group(1)), int(m.group(2))): n for n, m in optim.items()}

    # ---- DeepSpeed files ---------------------------------------------------------------------------------
    def model_file(self, m: int) -> dict:
        if m not in self._model_files:
            self._model_files[m] = load_pt(self.dir / f"mp_rank_{m:02d}_model_states.pt")
        return self._model_files[m]

    def _optim(self, d: int, m: int) -> tuple[Path, dict]:
        path = self.dir / self._optim_names[(d, m)]
        osd = load_pt(path).get("optimizer_state_dict")
        if not isinstance(osd, dict):
            raise ConvertError(f"{path}: no optimizer_state_dict")
        return path, osd

    def _to_single(self, key: str, where) -> str:
        if self.pp == 1:
            return key
        try:
            return pipe_to_single(self.cfg, key)
        except ValueError as e:
            raise ConvertError(f"{where}: {e}") from None

    def _module_part(self, m: int) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
        """{single name: tensor as stored in the module} of model-parallel rank m, and each tensor's file."""
        stage, t = divmod(m, self.tp)
        if self.pp == 1:
            path = self.dir / f"mp_rank_{m:02d}_model_states.pt"
            module = self.model_file(m).get("module")
            if not isinstance(module, dict):
                raise ConvertError(f"{path}: no 'module' state dict")
            buffers = set(self.model_file(m).get("buffer_names") or [])
            return ({k: v for k, v in module.items() if isinstance(v, torch.Tensor) and k not in buffers},
                    {k: path for k in module})
        out, files = {}, {}
        start, stop = stage_layers(self.cfg, self.pp, stage)
        for i in range(start, stop):
            path = self.dir / f"layer_{i:02d}-model_{t:02d}-model_states.pt"
            for k, v in load_pt(path).items():
                if not isinstance(v, torch.Tensor):
                    continue
                name = self._to_single(f"{i}.{k}", path)
                if name in out and not torch.equal(out[name], v):
                    raise ConvertError(f"{path}: tied {name} differs from its copy in {files[name].name}")
                out[name], files[name] = v, path
        return out, files

    def _param_shapes(self, m: int) -> list[dict]:
        shapes = self.model_file(m).get("param_shapes")
        if shapes is None:
            raise ConvertError(f"{self.dir / f'mp_rank_{m:02d}_model_states.pt'}: no param_shapes")
        return shapes

    def _zero_part(self, m: int, keys, steps: set | None = None) -> dict:
        """ZeRO 1/2: {key: {single name: fp32 tensor}} of model-parallel rank m, gathered over the DP partitions,
        each optimizer file read once; key None = the fp32 master weights, else an Adam state ('exp_avg',
        'exp_avg_sq'). `steps` collects the Adam step counts found."""
        shapes = self._param_shapes(m)
        parts = {key: [[] for _ in shapes] for key in keys}
        paddings, where = None, None
        for d in range(self.dp):
            path, osd = self._optim(d, m)
            where = path
            count = osd.get("partition_count", self.dp)
            count = max(count) if isinstance(count, (list, tuple)) else count
            if count != self.dp:
                raise ConvertError(f"{path}: the state is split over {count} ranks, the layout has dp={self.dp}")
            base = osd.get("base_optimizer_state") or {}
            state, pg = base.get("state", {}), base.get("param_groups", [])
            for key in keys:
                if key is None:
                    groups = osd.get("single_partition_of_fp32_groups")
                    if groups is None:
                        raise ConvertError(f"{path}: no single_partition_of_fp32_groups (not a ZeRO 1/2 optimizer "
                                           f"state)")
                else:
                    try:
                        groups = [state[g["params"][0]][key] for g in pg]
                    except (KeyError, IndexError):
                        raise ConvertError(f"{path}: no Adam state {key!r} for every parameter group (was a step "
                                           f"taken?)") from None
                if len(groups) != len(shapes):
                    raise ConvertError(f"{path}: {len(groups)} parameter groups, param_shapes has {len(shapes)}")
                for gi, g in enumerate(groups):
                    parts[key][gi].append(g.float())
            if steps is not None:
                steps.update(int(st["step"]) for st in state.values())
                self._param_groups = [{k: v for k, v in g.items() if k != "params"} for g in pg]
            paddings = paddings or osd.get("param_alignment_paddings")
            del osd, base, state
        out = {}
        for key in keys:
            out[key] = {}
            for gi, group_shapes in enumerate(shapes):
                pads = paddings[gi] if paddings is not None else None
                for name, t in unflatten(parts[key][gi], group_shapes, pads, self.dp,
                                         f"{where} (group {gi})").items():
                    out[key][self._to_single(name, where)] = t
            parts[key] = None
        return out

    def _zero0_part(self, m: int, key: str | None) -> dict[str, torch.Tensor]:
        """ZeRO 0, fp32: the torch optimizer's state in the model file, by parameter index."""
        path = self.dir / f"mp_rank_{m:02d}_model_states.pt"
        ms = self.model_file(m)
        if self.pp > 1 or self.precision != "fp32":
            raise ConvertError(f"{path}: ZeRO-0 optimizer state under {self.precision}"
                               f"{' and pipeline parallelism' if self.pp > 1 else ''} is not supported")
        opt = ms.get("optimizer")
        if not isinstance(opt, dict) or "state" not in opt:
            raise ConvertError(f"{path}: no optimizer state")
        buffers = set(ms.get("buffer_names") or [])
        names = [k for k, v in ms["module"].items() if isinstance(v, torch.Tensor) and k not in buffers]
        index = [i for g in opt["param_groups"] for i in g["params"]]
        if len(index) != len(names):
            raise ConvertError(f"{path}: the optimizer holds {len(index)} parameters, the module {len(names)}")
        out = {}
        for name, i in zip(names, index):
            st = opt["state"].get(i)
            if st is None or key not in st:
                raise ConvertError(f"{path}: no Adam state {key!r} for {name} (was a step taken?)")
            out[name] = st[key].float().reshape(ms["module"][name].shape).clone()
        return out

    def _merge(self, parts: dict[int, dict[str, torch.Tensor]], what: str,
               files: dict[int, dict[str, Path]] | None = None) -> dict[str, torch.Tensor]:
        """Per model-parallel rank dicts -> one dict: TP shards joined per stage, tied copies across stages
        checked equal."""
        out, origin = {}, {}
        for stage in range(self.pp):
            ms = [stage * self.tp + t for t in range(self.tp)]
            keys = set(parts[ms[0]])
            for m in ms[1:]:
                if set(parts[m]) != keys:
                    raise ConvertError(f"{self.dir}: {what} of model-parallel ranks {ms[0]} and {m} hold different "
                                       f"tensors: {sorted(set(parts[m]) ^ keys)}")
            for k in sorted(keys):
                try:
                    v = merge_tensors(k, [parts[m][k] for m in ms])
                except ValueError as e:
                    raise ConvertError(f"{self.dir}: {what}: {e}") from None
                if k in out:
                    if out[k].shape != v.shape or not torch.equal(out[k], v):
                        raise ConvertError(f"{self.dir}: {what}: tied {k} differs between pipeline stages "
                                           f"{origin[k]} and {stage}")
                    continue
                out[k], origin[k] = v, stage
        self._origin = {k: (files or {}).get(origin[k] * self.tp, {}).get(k) for k in out}
        return out

    # ---- what conversion asks for ------------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        """fp32 single-device state dict (masters for bf16/fp16), checked against the model config."""
        parts, files = {}, {}
        for m in range(self.tp * self.pp):
            module, files[m] = self._module_part(m)
            if self.precision == "fp32":
                parts[m] = {k: v.float() for k, v in module.items()}
                continue
            masters = self._zero_part(m, [None])[None] if self.zero >= 1 else self._zero0_masters(m)
            for k, v in module.items():
                if k not in masters:
                    masters[k] = v.float()
                elif masters[k].shape != v.shape or not torch.equal(masters[k].to(v.dtype), v):
                    raise ConvertError(f"{files[m][k]}: fp32 master of {k} does not round to the module's "
                                       f"{v.dtype} copy: the optimizer files do not belong to these weights")
            parts[m] = masters
        sd = self._merge(parts, "weights", files)
        check_shapes(self.cfg, sd, self.where, self._origin)
        return sd

    def _zero0_masters(self, m: int) -> dict[str, torch.Tensor]:
        from megamemo.checkpoint.convert import unpartitioned_fp32

        path = self.dir / f"mp_rank_{m:02d}_model_states.pt"
        if self.pp > 1 or not isinstance(self.model_file(m).get("module"), dict):
            raise ConvertError(f"{path}: fp32 masters of a ZeRO-0 {self.precision} pipeline run are not supported "
                               f"(use ZeRO 1)")
        found = unpartitioned_fp32(self.model_file(m), path)
        if found is None:
            raise ConvertError(f"{path}: no fp32 master weights for this {self.precision} run")
        return found

    def optimizer(self) -> dict:
        """{'exp_avg': {name: t}, 'exp_avg_sq': {...}, 'step': int, 'param_groups': [...]}: full fp32 moments."""
        keys = ("exp_avg", "exp_avg_sq")
        parts, steps = {k: {} for k in keys}, set()
        for m in range(self.tp * self.pp):
            if self.zero >= 1:
                got = self._zero_part(m, keys, steps)
            else:
                got = {k: self._zero0_part(m, k) for k in keys}
                opt = self.model_file(m)["optimizer"]
                steps.update(int(st["step"]) for st in opt.get("state", {}).values())
                self._param_groups = [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]
            for k in keys:
                parts[k][m] = got[k]
        out = {}
        for k in keys:
            out[k] = self._merge(parts[k], f"Adam {k}")
            check_shapes(self.cfg, out[k], self.where, {}, partial=True)
        if len(steps) != 1:
            raise ConvertError(f"{self.dir}: Adam step counts differ between parameters/ranks: {sorted(steps)}")
        out["step"], out["param_groups"] = steps.pop(), self._param_groups
        return out

    def engine_state(self) -> dict:
        """LR scheduler, DeepSpeed's step/sample counters and the loss scale (the same on every rank)."""
        ms = self.model_file(0)
        out = {"lr_scheduler": ms.get("lr_scheduler"), "global_steps": ms.get("global_steps"),
               "global_samples": ms.get("global_samples"), "skipped_steps": ms.get("skipped_steps")}
        scaler = None
        if self.zero >= 1:
            scaler = self._optim(0, 0)[1].get("loss_scaler")
        elif isinstance(ms.get("optimizer"), dict):
            scaler = ms["optimizer"].get("loss_scaler")
        out["loss_scaler"] = {k: getattr(scaler, k) for k in ("cur_scale", "cur_iter", "last_overflow_iter",
                                                              "cur_hysteresis") if hasattr(scaler, k)}
        out["loss_scaler"] = {k: float(v) if isinstance(v, (float, torch.Tensor)) else v
                              for k, v in out["loss_scaler"].items()}
        return out

    def rank_state(self) -> dict:
        """The data cursor and counters, checked equal on every rank (the position is global)."""
        first = self.ranks[0]["doc"].get("state", {})
        for r in self.ranks[1:]:
            st = r["doc"].get("state", {})
            for key in ("counters",):
                if st.get(key) != first.get(key):
                    raise ConvertError(f"{r['json']}: {key} {st.get(key)} differ from rank 0's {first.get(key)}")
            a, b = dict(st.get("data", {})), dict(first.get("data", {}))
            for d in (a, b):
                d.pop("rank", None), d.pop("world_size", None)
            if a != b:
                raise ConvertError(f"{r['json']}: data cursor {a} differs from rank 0's {b}")
        if first.get("counters", {}).get("step") != self.marker.get("step"):
            raise ConvertError(f"{self.ranks[0]['json']}: step {first.get('counters', {}).get('step')} but "
                               f"{self.where} says {self.marker.get('step')}")
        return {"data": first.get("data"), "counters": first.get("counters")}

    def memory(self) -> Memory:
        """The memory of every global stream [M, B, ...], TP head shards and PP stages joined."""
        by_cols: dict[tuple[int, int], dict[int, dict[int, dict[str, torch.Tensor]]]] = {}
        for r in self.ranks:
            try:
                tensors = load_file(str(r["tensors"]))
            except Exception as e:  # noqa: BLE001 - safetensors raises its own types
                raise ConvertError(f"{r['tensors']}: unreadable ({type(e).__name__}: {e})") from None
            for k, cols in enumerate(r["micro_batches"]):
                pre = f"memory/mb{k}/"
                mine = {n[len(pre):]: t for n, t in tensors.items() if n.startswith(pre) and "__" not in n}
                by_cols.setdefault(cols, {}).setdefault(r["pp_rank"], {})[r["tp_rank"]] = mine
        cols = sorted(by_cols)
        B = int(self.layout.get("batch_size", cols[-1][1] if cols else 0))
        pos = 0
        for c0, c1 in cols:
            if c0 != pos:
                raise ConvertError(f"{self.dir / 'megamemo'}: the ranks' micro-batches cover columns {cols}, not "
                                   f"[0, {B}) once each")
            pos = c1
        if pos != B:
            raise ConvertError(f"{self.dir / 'megamemo'}: the ranks' micro-batches cover columns {cols}, not "
                               f"[0, {B})")
        joined = []
        for c in cols:
            stages = by_cols[c]
            full: dict[str, torch.Tensor] = {}
            for s in sorted(stages):
                shards = [stages[s][t] for t in sorted(stages[s])]
                if len(shards) != self.tp or any(set(x) != set(shards[0]) for x in shards):
                    raise ConvertError(f"{self.dir / 'megamemo'}: columns {c}, stage {s}: tensor-parallel ranks "
                                       f"hold different memory tensors")
                try:
                    merged = merge_memory_tensors(shards) if shards[0] else {}
                except ValueError as e:
                    raise ConvertError(f"{self.dir / 'megamemo'}: columns {c}: memory {e}") from None
                for k in merged:
                    if k in full:
                        raise ConvertError(f"{self.dir / 'megamemo'}: columns {c}: memory {k} kept by two stages")
                full.update(merged)
            joined.append(full)
        names = set(joined[0]) if joined else set()
        for c, j in zip(cols, joined):
            if set(j) != names:
                raise ConvertError(f"{self.dir / 'megamemo'}: columns {c} hold memory {sorted(j)}, columns "
                                   f"{cols[0]} hold {sorted(names)}")
        mem = Memory({k: torch.cat([j[k] for j in joined], 1) for k in sorted(names)}, batch_size=B)
        check_memory(self.cfg, mem, self.dir / "megamemo")
        return mem

    def probe(self) -> dict | None:
        return read_probe(self.dir)

    def meta(self) -> dict:
        return {"source": str(self.dir), "step": self.marker.get("step"), "layout": self.layout,
                "precision": self.precision, "model_fingerprint": self.marker.get("model_fingerprint")}


# ---- checks --------------------------------------------------------------------------------------------------
def check_shapes(cfg: ModelConfig, sd: dict, where, origin: dict | None = None, partial: bool = False) -> None:
    """Every tensor present with the shape the config gives (partial: a subset of names is fine)."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in MemTransformerLM(cfg).state_dict().items()}
    missing = [] if partial else sorted(set(expected) - set(sd))
    extra = sorted(set(sd) - set(expected))
    bad = sorted(k for k in set(sd) & set(expected) if tuple(sd[k].shape) != expected[k])
    if missing or extra or bad:
        detail = "; ".join(f"{k} is {list(sd[k].shape)} in {(origin or {}).get(k) or 'the checkpoint'}, the "
                           f"config needs {list(expected[k])}" for k in bad[:4])
        raise ConvertError(f"{where}: the model config does not match the weights: missing {missing}, unexpected "
                           f"{extra}, wrong shapes {bad}" + (f" ({detail})" if detail else ""))


def check_memory(cfg: ModelConfig, mem: Memory, where) -> None:
    """Memory tensors named and shaped as the single-device model makes them."""
    n, dh, d = cfg.n_head, cfg.d_head, cfg.d_model
    for k, t in mem.tensors.items():
        head, _, tail = k.partition(".")
        if k == "emb":
            want = (d,)
        elif head == "ctx" and tail.isdigit() and int(tail) < cfg.n_layer:
            want = (n, dh)
        elif head == "lse" and tail.isdigit() and int(tail) < cfg.n_layer:
            want = (n,)
        elif head == "hid" and tail.isdigit() and int(tail) <= cfg.n_layer:
            want = (d,)
        else:
            raise ConvertError(f"{where}: unexpected memory tensor {k}")
        if tuple(t.shape[2:]) != want or t.size(0) > max(cfg.mem_len, 0):
            raise ConvertError(f"{where}: memory {k} has shape {list(t.shape)}, the config needs "
                               f"[<= {cfg.mem_len}, B, {', '.join(map(str, want))}]")


def read_probe(step_dir: Path) -> dict | None:
    """The probe a training run recorded at this checkpoint (megamemo/checkpoint/probe.py), or None."""
    path = Path(step_dir) / PROBE_FILE
    if not path.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("probe", "{}"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001
        raise ConvertError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    n = int(meta.get("segments", 0))
    try:
        segs = [(tensors[f"inputs.{i}"], tensors[f"targets.{i}"], tensors[f"nll.{i}"]) for i in range(n)]
    except KeyError as e:
        raise ConvertError(f"{path}: tensor {e} missing") from None
    if n == 0:
        raise ConvertError(f"{path}: no segments recorded")
    return {**meta, "segments": segs, "path": path}

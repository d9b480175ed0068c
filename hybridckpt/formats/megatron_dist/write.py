"""Export to a Megatron-Core torch_dist checkpoint: `hybridckpt export --to megatron [--tp N --pp M]`.

What megatron-core 0.19's `dist_checkpointing.save` writes for Megatron-LM's `save_checkpoint`
with `--ckpt-format torch_dist --dist-ckpt-optim-fully-reshardable` (pinned by
tests/real/cases/megatron_core_dense_fully_reshardable), and what `load_checkpoint` reads back
at ANY tp/pp (it reshards on load):
- `OUT/latest_checkpointed_iteration.txt` (the iteration, no newline) and `OUT/iter_{N:07d}/`:
  torch's DCP files (`formats.dcp.write_files`; no planner data, the checkpoint id a string, as
  Megatron's planner saves them), then `metadata.json` `{"sharded_backend": "torch_dist",
  "sharded_backend_version": 1}`, written last (a folder without it is an unfinished save);
- model keys under megatron-core's GLOBAL names, from HF names by the INVERSE of the reader's
  rules (the family's megatron dialect: models/<family>/dialects/megatron.rules, with
  Transformer Engine norm names, fused q/k/v per query group, SwiGLU fc1 `[gate; up]`, the
  vocabulary padded with zero rows to a multiple of 128 x tp, as `_vocab_size_with_padding`,
  or of the source's `--make-vocab-size-divisible-by` x tp for a Megatron source),
  then stacked on a leading layer axis by rules/megatron_dist_layers.rules inverted
  (`decoder.layers.<suffix>` `[num_layers, ...]`);
- chunks as the ranks of a tp x pp run hold them: one per layer and tensor-parallel rank, split
  on the axis rules/megatron_tp.rules gives the key (column parallel rows, row parallel columns,
  SwiGLU fc1 as a gate and an up block per rank, norms whole), the file of (stage, tp rank)
  `__{stage * tp + rank}_0.distcp`;
- a `<module>._extra_state/shard_{layer}_{num_layers}` ShardedObject `[None]` for every linear
  layer (tensor_parallel/layers.py: what a local-spec model requests on load);
- `fully_reshardable` optimizer state: `optimizer.state.param.<key>` (the fp32 master),
  `optimizer.state.exp_avg.<key>`, `optimizer.state.exp_avg_sq.<key>`, each chunked like its
  model key (distrib_optimizer.py `sharded_param_state_fully_reshardable`);
- the common state (`formats.megatron_dist.write_common`).
Dense Llama, Qwen2 and Qwen3. Every value is the source's, bit for bit.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from hybridckpt import lazy
from hybridckpt.errors import ConfigError
from hybridckpt.formats.dcp import write_request as torch_request
from hybridckpt.formats.dcp.write_files import Item
from hybridckpt.formats.dcp.write_request import TorchExport
from hybridckpt.formats.megatron.config import family_architecture
from hybridckpt.formats.megatron_dist import write_common as mc
from hybridckpt.formats.megatron_dist.model import LAYERS_RULES
from hybridckpt.formats.rules_files import load_rules
from hybridckpt.lazy import LazyTensor
from hybridckpt.rules import parse_rules
from hybridckpt.writers import ExportRequest, Written

VOCAB_MULTIPLE = 128  # Megatron's --make-vocab-size-divisible-by default
MAX_VOCAB_MULTIPLE = 1 << 16  # a source's larger value is not taken (it would pad that many zero rows)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LINEAR = re.compile(r"^(decoder\.layers\.(?:.+\.)?linear_\w+)\.weight$")


def _count(x: Any) -> bool:
    """A positive int (not a bool), as a source's metadata must give a size or count."""
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def padded_vocab(vocab: int, tp: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """megatron/training/vocab_utils.py `_vocab_size_with_padding`."""
    step = multiple * tp
    return -(-vocab // step) * step


def _variables(cfg: Any, tp: int, multiple: int) -> dict:
    from hybridckpt import models

    v = models.rule_variables(cfg)
    swiglu = family_architecture(cfg, "export --to megatron").swiglu
    return {
        **v,
        "padded_vocab": padded_vocab(v["vocab_size"], tp, multiple),
        "swiglu": swiglu,
        "te_norms": True,
    }


def megatron_names(
    tensors: Mapping[str, LazyTensor], cfg: Any, v: Mapping, strict: bool = True
) -> dict:
    """HF-named tensors under megatron-core's per-layer global names (the reader's rules, inverted)."""
    text, origin = family_architecture(cfg, "export --to megatron").dialect.rules()
    inverse = parse_rules(text, dict(v), origin=origin).invert()
    return inverse.apply(dict(tensors), strict=strict).tensors


def _tp_boxes(name: str, shape: tuple[int, ...], tp_rules, tp: int) -> list[tuple[int, tuple]]:
    """(tp rank, box) of each chunk of per-layer tensor `name` in a tp-way run."""
    whole = tuple((0, n) for n in shape)
    merge = tp_rules.tp_merge_for(name).merge
    if merge.name == "replicated" or tp == 1:
        return [(0, whole)]
    axis = merge.args[0] % len(shape)
    parts = 2 if merge.name == "halves" else 1
    n = shape[axis] // parts
    if shape[axis] % (parts * tp):
        raise ConfigError(
            f"export --to megatron: {name} {shape} does not split {tp} ways on axis {axis}"
        )
    step = n // tp
    out = []
    for r in range(tp):
        for h in range(parts):
            box = list(whole)
            box[axis] = (h * n + r * step, h * n + (r + 1) * step)
            out.append((r, tuple(box)))
    return out


def check_layout(v: Mapping[str, Any], tp: int, pp: int) -> None:
    """What Megatron asks of a tp x pp run of this model (TransformerConfig.__post_init__:
    attention heads and query groups divisible by tp; equal pipeline stages)."""
    if tp < 1 or pp < 1:
        raise ConfigError(f"export --to megatron: --tp and --pp must be >= 1, got tp={tp} pp={pp}")
    for what, n in (("attention heads", v["num_heads"]), ("query groups", v["num_kv_heads"])):
        if int(n) % tp:
            raise ConfigError(f"export --to megatron: {n} {what} do not split {tp} ways (tp={tp})")


def layout(per_layer: Mapping[str, LazyTensor], *, tp: int, pp: int, num_layers: int, swiglu: bool):
    """{stacked key: (boxes, files)}: the chunks of a tp x pp run (module doc)."""
    if num_layers % pp:
        raise ConfigError(
            f"export --to megatron: {num_layers} layers do not split into {pp} equal stages"
        )
    tp_rules = load_rules("megatron_tp.rules", {"swiglu": swiglu, "te_down_proj": False})
    per_stage = num_layers // pp
    out: dict[str, tuple[list, list]] = {}
    for name, t in per_layer.items():
        m = _LAYER.match(name)
        if m:
            layer = int(m.group(1))
            key, stage, lift = (
                f"decoder.layers.{m.group(2)}",
                layer // per_stage,
                ((layer, layer + 1),),
            )
        else:
            key, stage, lift = name, 0 if name.startswith("embedding.") else pp - 1, ()
        boxes, files = out.setdefault(key, ([], []))
        for rank, box in _tp_boxes(name, tuple(t.shape), tp_rules, tp):
            boxes.append((*lift, *box))
            files.append(stage * tp + rank)
    return out


def _stack(per_layer: Mapping[str, LazyTensor]) -> dict[str, LazyTensor]:
    """Per-layer names stacked on the layer axis (rules/megatron_dist_layers.rules inverted)."""
    res = load_rules(LAYERS_RULES).invert().apply(dict(per_layer), strict=False)
    return {**{n: per_layer[n] for n in res.unconsumed}, **res.tensors}


def state_items(
    model: Mapping[str, LazyTensor],
    slots: Mapping[str, Mapping[str, LazyTensor]] | None,
    chunks: Mapping[str, tuple[list, list]],
    *,
    num_layers: int,
    per_stage: int,
    tp: int,
    common: dict,
) -> list[Item]:
    """The DCP items: model keys, their `_extra_state` objects, the optimizer state and the
    common state, each chunk in its rank's file."""
    items = []
    for key, t in model.items():
        boxes, files = chunks[key]
        items.append(Item((key,), tensor=t, boxes=tuple(boxes), files=tuple(files)))
        m = _LINEAR.match(key)
        if m:  # a Megatron linear layer: its (empty) extra state, one object per layer
            for layer in range(num_layers):
                name = f"{m.group(1)}._extra_state/shard_{layer}_{num_layers}"
                items.append(Item((name,), value=[None], files=((layer // per_stage) * tp,)))
    for slot, tensors in (slots or {}).items():
        for key in model:
            boxes, files = chunks[key]
            t = lazy.cast(tensors[key], np.float32)  # fp32 masters and moments, as Megatron keeps them
            items.append(
                Item(
                    (f"optimizer.state.{slot}.{key}",),
                    tensor=t,
                    boxes=tuple(boxes),
                    files=tuple(files),
                )
            )
    items.append(Item((mc.COMMON_KEY,), value=[common], files=(0,)))
    return items


def write_export(job: TorchExport, *, tp: int = 1, pp: int = 1) -> tuple[list[str], list[str]]:
    """Write `job` (HF-named params, AdamW slots, step, the source's hyper; `job.masters`: the
    fp32 values when the params were cast) as a Megatron-Core torch_dist checkpoint chunked for
    tp x pp (module doc); returns (files, notes)."""
    from hybridckpt import models

    cfg = job.cfg
    if cfg is None:
        raise ConfigError(
            "export --to megatron: needs a model config (the source has none; pass --config)"
        )
    family = models.family_of(cfg).name
    exported = sorted(f for f, d in models.dialects("megatron").items() if d.get("EXPORTED", False))
    if family not in exported:  # (a family's megatron dialect says EXPORTED)
        raise ConfigError(f"export --to megatron: writes {exported} models; this one is {family}")
    job.check_adamw("export --to megatron")
    slots, trainer = job.slots, job.trainer
    multiple = trainer.get("make_vocab_size_divisible_by")
    multiple = multiple if _count(multiple) and multiple <= MAX_VOCAB_MULTIPLE else VOCAB_MULTIPLE
    v = _variables(cfg, tp, multiple)
    check_layout(v, tp, pp)
    num_layers = int(v["num_layers"])
    model_pl = megatron_names(job.params, cfg, v)
    chunks = layout(model_pl, tp=tp, pp=pp, num_layers=num_layers, swiglu=v["swiglu"])
    model = _stack(model_pl)
    opt = None
    if slots:
        opt = {"param": _stack(megatron_names(job.masters or job.params, cfg, v))}
        opt |= {s: _stack(megatron_names(t, cfg, v, strict=False)) for s, t in slots.items()}
    hyper = job.hyper
    n = int(job.step or 0)
    origin = family_architecture(cfg, "export --to megatron").dialect.rules()[1]
    notes = [f"megatron-core names by {origin} inverted, layers stacked; "
             f"chunks of a tp={tp} pp={pp} run; vocabulary padded to {v['padded_vocab']}"]  # fmt: skip
    gbs = trainer.get("global_batch_size")  # (the source's metadata: numbers checked, else left out)
    gbs = gbs if _count(gbs) else None
    consumed = trainer.get("consumed_train_samples")
    consumed = consumed if _count(consumed) or consumed == 0 else n * (gbs or 0)
    if consumed != trainer.get("consumed_train_samples"):
        notes.append(f"consumed_train_samples written as {consumed} (the source recorded none usable)")
    hf = models.config_to_hf(cfg)
    arch = family_architecture(cfg, "export --to megatron")
    described, more = mc.model_args(hf, arch.match)
    notes += more
    sizes = {
        **described, "padded_vocab_size": v["padded_vocab"], "make_vocab_size_divisible_by": multiple,
        "global_batch_size": gbs, "tokenizer_type": tok if isinstance(tok := trainer.get("tokenizer_type"), str) else None,
    }  # fmt: skip
    args = mc.args_namespace(sizes, tp=tp, pp=pp, optimizer=bool(slots), consumed=consumed)
    groups = schedule = None
    if slots:
        source_schedule = trainer.get("opt_param_scheduler")
        schedule = mc.scheduler_state(hyper, source_schedule, consumed)
        groups = mc.param_groups(hyper, n, schedule)
        notes.append(f"Megatron pairs the optimizer's param groups by max_lr/min_lr: resume with --lr {schedule['max_lr']!r} "
                     f"--min-lr {schedule['min_lr']!r}")  # fmt: skip
        if not source_schedule:
            notes.append("no Megatron LR schedule in the source: a constant one at its peak lr is written; resume with "
                         "--override-opt-param-scheduler (the run's own schedule)")  # fmt: skip
    flops = trainer.get("num_floating_point_operations_so_far", 0)
    common = mc.common_state(args=args, iteration=n, groups=groups, schedule=schedule,
                             flops=flops if isinstance(flops, int) else 0)  # fmt: skip
    items = state_items(model, opt, chunks, num_layers=num_layers, per_stage=num_layers // pp, tp=tp,
                        common=common)  # fmt: skip
    name = f"iter_{n:07d}"
    dest = job.destination()
    with dest as tmp:
        folder = os.path.join(tmp, name)
        os.mkdir(folder)
        files = job.write_items(folder, items, files=tp * pp, checkpoint_id=os.path.join(dest.dst, name),
                                planner=False, id_as_path=False)  # fmt: skip
        with open(os.path.join(folder, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
        with open(os.path.join(tmp, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(n))
        dest.commit()
    names = [f"{name}/{x}" for x in files] + [
        f"{name}/metadata.json",
        "latest_checkpointed_iteration.txt",
    ]
    return names, notes


def write_request(request: ExportRequest) -> Written:
    """A writers-registry entry: `request` (formats/dcp/write_request.py) through `write_export`."""
    return torch_request.run(request, write_export)

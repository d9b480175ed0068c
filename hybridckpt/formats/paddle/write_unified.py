"""Export into Paddle's unified layouts: `hybridckpt export --to paddlenlp-unified|paddleformers-unified`.

The export job (`jobs/export.py`) hands over what it would write as Hugging Face files: the
model's tensors under HF names (`[out, in]`, as our checkpoints hold them: fp32, the master
weights of a 16-bit run), the optimizer slots under the same names, the step. `write_export`
writes them with `write_unified` in the chosen flavour (`LAYOUTS`):
- `paddlenlp-unified`: PaddleNLP's structured names and `[in, out]` Linear weights (the family
  must have a paddlenlp dialect), optimizer state in the weights' layout;
- `paddleformers-unified`: PaddleFormers 1.x's HF names and `[out, in]` weights, the optimizer
  state and master weights of Linear weights in Paddle's `[in, out]` (`paddleformers.py`).
Params cast to a 16-bit `dtype` with the optimizer keep their fp32 values as `master_weights-*`
(what Paddle's AMP O2 saves); AdamW's beta pows are written from the step and the betas
(the source's, `adam_betas` in its trainer state, else Paddle's defaults). The folder appears
complete or not at all (`writers.destination.Destination`). `write_unified` is also the library
function that writes a unified checkpoint into a folder of the caller's.
"""

from __future__ import annotations

import builtins
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from hybridckpt import lazy, values
from hybridckpt.containers import safetensors_file
from hybridckpt.errors import ConfigError, MappingError
from hybridckpt.formats.paddle import paddleformers
from hybridckpt.formats.paddle.files import BF16
from hybridckpt.formats.paddle.optimizer import (
    BETA_POWS,
    DEFAULT_BETAS,
    SLOT_OF_ACCUMULATOR,
    beta_pow,
)
from hybridckpt.formats.paddle.rules import hf_rules
from hybridckpt.formats.paddle.unified import (
    ACCUMULATOR_SUFFIX,
    MASTER_INDEX,
    MAX_SHARD_BYTES,
    MODEL_INDEX,
    OPT_INDEX,
    TIED_EMBEDDING,
    TIED_HEAD,
)
from hybridckpt.lazy import LazyTensor
from hybridckpt.lazy.dtypes import cast_floating
from hybridckpt.writers.destination import Destination

LAYOUTS = {
    "paddlenlp-unified": paddleformers.PADDLENLP,
    "paddleformers-unified": paddleformers.PADDLEFORMERS,
}
SIXTEEN_BIT = (np.dtype(np.float16), BF16)


def write_export(request) -> Any:
    """The Paddle unified formats' writer (`request.layout`, a key of `LAYOUTS`): the HF-named
    params (and slots, step) of a model config, never at or around one of the request's sources.
    AdamW's beta pows come from the source's `adam_betas` when it recorded them, else Paddle's
    defaults."""
    from hybridckpt.writers import Written, cast_notes, preflight

    preflight(request)

    layout, cfg, named = request.layout, request.config, request.named
    params, dtype = named.params, request.dtype
    slots = named.slots if request.optimizer else None
    step, betas = named.step, request.trainer.get("adam_betas")
    if betas is not None:  # (a source's trainer state: two numbers, else one line naming it)
        betas = values.numbers(betas, (request.sources or ("source",))[0], "trainer state 'adam_betas'", 2)
    out, overwrite, sources = request.out, request.overwrite, request.sources
    if layout not in LAYOUTS:
        raise ConfigError(f"export: layout {layout!r}; expected one of {sorted(LAYOUTS)}")
    if cfg is None:
        raise ConfigError(
            f"export --to {layout}: needs a model config (the source has none; pass --config)"
        )
    first = np.dtype(next(iter(params.values())).dtype)
    written = np.dtype(dtype) if dtype is not None else first
    master = None
    if slots and written in SIXTEEN_BIT and first == np.float32:
        master = dict(params)  # AMP O2: fp32 master weights beside the 16-bit params
    dest = Destination(out, overwrite=overwrite, sources=sources, marker=True)
    with dest as tmp:
        files = write_unified(
            tmp,
            params,
            config=cfg,
            slots=slots or None,
            master=master,
            step=step,
            betas=tuple(betas) if betas else DEFAULT_BETAS,
            dtype=dtype,
            flavour=LAYOUTS[layout],
            max_shard_bytes=request.max_shard_bytes or MAX_SHARD_BYTES,  # (--max-shard-gb)
        )
        dest.commit()
    return Written(tuple(files), len(params), sum(t.nbytes for t in params.values()), cast_notes(request))


def _storable(t: LazyTensor) -> LazyTensor:
    return lazy.Bitcast(t, np.dtype(np.uint16)) if np.dtype(t.dtype) == BF16 else t


def _write_group(
    out_dir: str,
    prefix: str,
    index_name: str,
    tensors: Mapping[str, LazyTensor],
    max_shard_bytes: int,
    extra: Mapping | None = None,
    file_format: str = "np",
) -> list[str]:
    shards = safetensors_file.plan_shards(
        ((k, tensors[k].nbytes) for k in tensors), max_shard_bytes
    )
    weight_map, files = {}, []
    for i, names in enumerate(shards, 1):
        fname = f"{prefix}-{i:05d}-of-{len(shards):05d}.safetensors"
        safetensors_file.write(
            os.path.join(out_dir, fname), {k: tensors[k] for k in names}, {"format": file_format}
        )
        files.append(fname)
        weight_map.update({k: fname for k in names})
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
        "weight_map": weight_map,
    }
    index.update(extra or {})
    with builtins.open(os.path.join(out_dir, index_name), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    return files + [index_name]


def write_unified(
    out_dir: str,
    hf_tensors: Mapping[str, LazyTensor],
    *,
    config,
    slots: Mapping[str, Mapping[str, LazyTensor]] | None = None,
    master: Mapping[str, LazyTensor] | None = None,
    step: int | None = None,
    betas: tuple[float, float] = DEFAULT_BETAS,
    dtype=None,
    fuse_attention_qkv: bool = False,
    fuse_attention_ffn: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    flavour: str = paddleformers.PADDLENLP,
) -> list[str]:
    """Write a unified checkpoint of an HF-named model into `out_dir`: PaddleNLP's (`flavour`
    "paddlenlp", the default; its family must have a paddlenlp dialect) or
    PaddleFormers' ("paddleformers"; any family, HF names).

    hf_tensors: HF names -> tensors (`[out, in]`; LazyTensors or arrays), in the dtype to save
    (`dtype` casts them; bf16 is written as U16 like PaddleNLP). slots: optimizer slot name
    (torch's: "exp_avg", "exp_avg_sq", "momentum_buffer") -> HF name -> fp32 tensor (HF layout),
    each written as the Paddle accumulator of `optimizer.SLOT_OF_ACCUMULATOR`; master: fp32, HF
    names (optional: Paddle keeps them for 16-bit params); `step`: optimizer steps taken (the
    beta pows that go with Adam's moments = beta ** (step + 1), `optimizer.beta_pow`); needed
    with Adam moments. `fuse_attention_qkv` / `fuse_attention_ffn` write PaddleNLP's fused qkv /
    gate_up layers. Returns the file names written. PaddleNLP's names come from
    `RuleSet.invert()` of rules/paddle_decoder.rules (the mapping is written once, for import);
    PaddleFormers' optimizer state of Linear weights is transposed to `[in, out]`
    (`paddleformers.state_to_paddle`).
    """
    if flavour not in paddleformers.FLAVOURS:
        raise ConfigError(
            f"write_unified: flavour {flavour!r}; expected one of {paddleformers.FLAVOURS}"
        )

    def lazies(d):
        return {k: lazy.as_lazy(v) for k, v in d.items()}

    hf_params = lazies(hf_tensors)
    if flavour == paddleformers.PADDLENLP:
        inverse = hf_rules(
            config, fuse_qkv=fuse_attention_qkv, fuse_ffn=fuse_attention_ffn
        ).invert()
        params = inverse.apply(hf_params).tensors

        def stored(state, what):
            got = inverse.apply(lazies(state), strict=False).tensors
            missing = sorted(set(params) - set(got))
            if missing:
                raise MappingError(f"write_unified: no {what} for {missing[:10]}")
            return got

    else:
        params = hf_params

        def stored(state, what):
            return paddleformers.state_to_paddle(hf_params, lazies(state), what)

    params, _ = cast_floating(params, dtype)  # (None: every tensor as stored)
    os.makedirs(out_dir, exist_ok=True)
    state_key = {k: k for k in params}  # the name each param's optimizer state is saved under
    if flavour == paddleformers.PADDLENLP:
        model_files = {k: _storable(t) for k, t in params.items()}
        file_format = "np"
    else:  # as PaddleFormers' prepare_safe_save_state_dict: bf16 as BF16, {"format": "pt"}
        model_files = dict(params)
        file_format = "pt"
        if getattr(config, "tie_word_embeddings", False) and TIED_EMBEDDING in params:
            # the model's state dict lists the shared param under the head's name too, and the
            # optimizer keys take the last structured name of each param
            model_files.setdefault(TIED_HEAD, params[TIED_EMBEDDING])
            state_key[TIED_EMBEDDING] = TIED_HEAD
    written = _write_group(
        out_dir, "model", MODEL_INDEX, model_files, max_shard_bytes, file_format=file_format
    )
    if slots:
        accumulator = {slot: acc for acc, slot in SLOT_OF_ACCUMULATOR.items()}
        unknown = sorted(set(slots) - set(accumulator))
        if unknown:
            raise MappingError(
                f"write_unified: Paddle has no accumulator for slots {unknown}; known: "
                f"{sorted(accumulator)}"
            )
        pows = {acc: beta for acc, (slot, beta) in BETA_POWS.items() if slot in slots}
        if pows and step is None:
            raise ConfigError(
                f"write_unified: the optimizer step is needed to write {', '.join(sorted(pows))}"
            )
        pow_values = {acc: beta_pow(betas[beta], step) for acc, beta in pows.items()}
        opt: dict[str, LazyTensor] = {}
        per_slot = {slot: stored(tensors, slot) for slot, tensors in slots.items()}
        for k in params:
            for slot, tensors in per_slot.items():
                opt[f"{state_key[k]}/{accumulator[slot]}{ACCUMULATOR_SUFFIX}"] = lazy.cast(
                    tensors[k], np.float32
                )
            for acc, value in pow_values.items():
                opt[f"{state_key[k]}/{acc}{ACCUMULATOR_SUFFIX}"] = lazy.ArrayTensor(value)
        written += _write_group(
            out_dir,
            "optimizer",
            OPT_INDEX,
            opt,
            max_shard_bytes,
            {"master_weights": master is not None},
        )
    if master is not None:
        mw = stored(master, "master weights")
        written += _write_group(
            out_dir,
            "master_weights",
            MASTER_INDEX,
            {state_key[k]: lazy.cast(mw[k], np.float32) for k in params},
            max_shard_bytes,
        )
    from hybridckpt.models import config_to_hf

    model_dtype = {
        np.dtype(np.float32): "float32",
        np.dtype(np.float16): "float16",
        BF16: "bfloat16",
    }
    cfg_json = dict(config_to_hf(config))
    first = next(iter(params.values()))
    cfg_json["dtype"] = model_dtype.get(np.dtype(first.dtype), str(first.dtype))
    if flavour == paddleformers.PADDLENLP:
        cfg_json["fuse_attention_qkv"] = fuse_attention_qkv
        cfg_json["fuse_attention_ffn"] = fuse_attention_ffn
    with builtins.open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg_json, f, indent=2)
    return written + ["config.json"]

"""Open any checkpoint, ours included: HF-named lazy tensors, optimizer slots, trainer metadata.

`open_checkpoint` is the one way every job sees a checkpoint. It detects the format (or takes
`fmt`), asks the format (or `formats.orbax_store` for our own Orbax checkpoints) for a `SourceCheckpoint`
and renames it once, by rules only (`naming.source_to_hf`), to single-card HF names. A source with
no model config and no `config=` is opened model-agnostic: its tensors keep the source's own
names (tensor-parallel pieces already merged, pipeline stages already global), which is what
`inspect`, the consolidating `export` and the generic `import` need. Nothing is read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridckpt import naming
from hybridckpt.errors import ConfigError
from hybridckpt.io.model_files import ModelFile
from hybridckpt.io.remote import view
from hybridckpt.naming import Named


@dataclass(frozen=True)
class Opened:
    """A checkpoint of any format, as every job sees it.

    format:   the format name ("hf", "megatron", ..., "orbax" for ours)
    path:     what was opened
    config:   the model config, or None (model-agnostic: `named` holds the source's own names)
    named:    params and optimizer slots: under HF names when `config` is set
    trainer:  trainer metadata (step, consumed samples, ...; our trainer_state for ours)
    topology: parallel degrees read from the files
    notes:    remarks from the format and the rules
    files:    the config, generation config and tokenizer files that travel with the weights
              (`io.model_files`): an import stores them, an HF export writes them
    hyper:    the optimizer's hyperparameters as the source recorded them (lr, betas, eps,
              weight_decay; `OptimizerState.hyper`, typed), kept by an import as `optimizer_hyper`;
              with `model_only` its param groups name the exported params (`naming.exported_hyper`)
    """

    format: str
    path: str
    config: Any
    named: Named
    trainer: Mapping[str, Any] = field(default_factory=dict)
    topology: Mapping[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    hyper: Mapping[str, Any] = field(default_factory=dict)  # the optimizer's hyper-parameters, source names
    leaf_of: Any = None  # source param name -> the names it ends under (`naming.leaf_namer`)
    hf_of: Any = None  # source param name -> its HF names (the source's names without a config)
    files: Mapping[str, ModelFile] = field(default_factory=dict)

    @property
    def step(self) -> int | None:
        return self.named.step


def open_checkpoint(
    path: str | os.PathLike,
    fmt: str = "auto",
    *,
    config: Any = None,
    rules: str | os.PathLike | None = None,
    step: int | None = None,
    strict: bool = True,
    verify_reads: bool = True,
    model_only: bool = False,
    param_order: Any = None,
) -> Opened:
    """Open `path` (any supported format, our Orbax checkpoints included) without reading it.

    config: an HF `config.json` / Meta `params.json` path or a model config, for sources that
      carry none (or to override theirs). rules: a user rules file applied before the format's.
    step: which step of a source that holds several (our Orbax checkpoint, torchtitan `step-N/`,
      Trainer `checkpoint-N/`, Megatron `iter_N/`, DeepSpeed `global_stepN/`, MaxText `N/`;
      default: the latest, or the one the source's tracker names); a source of one step takes
      only its own step. A step not there is a FormatError listing those that are.
    verify_reads: every read of our Orbax checkpoint is checked against the CRC-32s its import
      recorded (`store.checked`); False reads it unchecked.
    model_only: with a model config, `named` holds only the model's tensors (buffers and tied
      copies dropped, every name and shape checked: `naming.model_hf`), as an export writes them.
    param_order: the parameter names in index order (a sequence, or a file of one name a line)
      of an optimizer state keyed by index (HF Trainer, accelerate, a plain torch loop), instead
      of the order the model and the writing tool give (`formats.index_naming`).
    """
    from hybridckpt.formats import registry

    src = registry.open_source(path, fmt, config=config, step=step, verify_reads=verify_reads,
                               param_order=param_order, rules=rules)
    names = naming.names_of(src, src.config, rules=rules, strict=strict, model_only=model_only)
    shown = view.url_of(view.local_path(path)) or os.path.abspath(os.fspath(path))  # a URL stays one
    return Opened(src.format, shown, names.config, names.named, dict(src.trainer),
                  dict(src.topology), names.named.notes, names.hyper, names.leaf_of, names.hf_of, dict(src.files))


def unknown_architecture(opened: Opened) -> str | None:
    """The architecture of a source whose `config.json` names one no family implements (kept as
    trainer `"hf_config"` by the HF reader), else None."""
    raw = opened.trainer.get("hf_config") if opened.config is None else None
    if not isinstance(raw, Mapping):
        return None
    archs = raw.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    return raw.get("model_type") if isinstance(raw.get("model_type"), str) else "an unnamed architecture"


def require_config(opened: Opened, what: str) -> Any:
    """The model config of `opened`, or a ConfigError saying `what` needs one."""
    arch = unknown_architecture(opened)
    if arch is not None:
        from hybridckpt.models.family import supported_hf

        raise ConfigError(
            f"{opened.path}: {arch} is not supported by any model family (supported: {supported_hf()}); "
            f"its tensors are read under their own names (inspect, import, export), but {what} needs "
            f"a supported model"
        )
    if opened.config is None:
        raise ConfigError(
            f"{opened.path}: this {opened.format} checkpoint carries no model config; {what} needs "
            f"one: pass --config with an HF config.json or a Meta params.json"
        )
    return opened.config

"""Open any checkpoint, ours included: HF-named lazy tensors, optimizer slots, trainer metadata.

`open_checkpoint` is the one way every job sees a checkpoint. It detects the format (or takes
`fmt`), asks the format (or `store.as_source` for our own Orbax checkpoints) for a `SourceCheckpoint`
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
from hybridckpt.errors import ConfigError, FormatError
from hybridckpt.formats.config_file import read_json
from hybridckpt.io import model_files
from hybridckpt.io.model_files import ModelFile
from hybridckpt.jobs import index_optimizer
from hybridckpt.naming import Named
from hybridckpt.optim.groups import checked_hyper


def config_file(path: str) -> str:
    """The config file `--config` names: the file itself, or in a folder its `config.json` (HF),
    else its `params.json` (Meta); a folder with neither is a ConfigError."""
    if not os.path.isdir(path):
        return path
    for name in ("config.json", "params.json"):
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise ConfigError(f"--config {path}: a folder without config.json or params.json; expected an HF config.json "
                      f"or a Meta params.json (or a folder holding one)")


def load_config_file(path: str, vocab_size: int | None = None) -> Any:
    """A model config from an HF `config.json` or a Meta `params.json` (or a folder holding one:
    `config_file`)."""
    from hybridckpt import models

    path = config_file(path)
    try:
        data = read_json(path)
    except FormatError as e:  # missing or not a JSON object: a bad --config
        raise ConfigError(str(e)) from None
    if "dim" in data and "n_layers" in data:
        return models.config_from_meta_params(data, vocab_size=vocab_size, source=path)
    return models.config_from_hf(data, source=path)


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
              weight_decay; `OptimizerState.hyper`), kept by an import as `optimizer_hyper`
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


def _config_arg(config: Any) -> Any:
    """`config` may be a path (config.json / params.json), a model config, or None."""
    if isinstance(config, str | os.PathLike):
        return load_config_file(os.fspath(config))
    return config


def open_checkpoint(
    path: str | os.PathLike,
    fmt: str = "auto",
    *,
    config: Any = None,
    rules: str | os.PathLike | None = None,
    step: int | None = None,
    strict: bool = True,
    verify_reads: bool = True,
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
    param_order: the parameter names in index order (a sequence, or a file of one name a line)
      of an optimizer state keyed by index (HF Trainer, accelerate, a plain torch loop), instead
      of the order the model and the writing tool give (`jobs.index_optimizer`).
    """
    from hybridckpt import readers
    from hybridckpt.writers.ownership import given

    path = os.path.abspath(given(path, "the source"))
    cfg = _config_arg(config)
    fmt = readers.detect(path) if fmt == "auto" else fmt
    src = readers.open_source(path, fmt, config=cfg, step=step, verify_reads=verify_reads)
    src = index_optimizer.resolve(src, cfg or src.config, param_order,
                                  user_rules=naming.user_rules(src, cfg or src.config, rules) if rules else None)
    named, cfg = naming.named_for_model(src, cfg or src.config, rules=rules, strict=strict)
    user = naming.user_rules(src, cfg, rules) if rules else None
    hyper = checked_hyper(src.optimizer.hyper, path) if src.optimizer is not None else {}  # (any source's: typed)
    files, skipped = model_files_of(src, path, config)
    return Opened(src.format, path, cfg, named, dict(src.trainer), dict(src.topology), named.notes + tuple(skipped),
                  hyper, naming.leaf_namer(src, cfg, user_rules=user),
                  naming.leaf_namer(src, cfg, user_rules=user, tree=False), files)


def model_files_of(src: Any, path: str, config: Any) -> tuple[dict[str, ModelFile], list[str]]:
    """The config, generation and tokenizer files that travel with `src` (`io.model_files`):
    what our store recorded; else those in the source's folder (or, when its config.json lies in
    the folder above, as for torchtitan's `step-N` and PaddleFormers' `checkpoint-N`, there);
    a `--config` file is the config.json, with the files beside it."""
    if src.format == "orbax" or src.files:  # (ours: what the import stored, nothing else)
        return dict(src.files), []
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    files, skipped = model_files.find(folder)
    if model_files.CONFIG not in files and config is None and src.config is not None:
        above, more = model_files.find(os.path.dirname(folder))
        if model_files.CONFIG in above:
            files, skipped = above | files, skipped + more
    if isinstance(config, str | os.PathLike):
        cpath = os.path.abspath(config_file(os.fspath(config)))
        data = read_json(cpath)
        if not ("dim" in data and "n_layers" in data):  # an HF config.json (a Meta params.json is not carried)
            beside, more = model_files.find(os.path.dirname(cpath))
            files, skipped = files | beside, skipped + more
            files[model_files.CONFIG] = ModelFile(model_files.CONFIG, cpath, os.path.getsize(cpath))
    return files, skipped


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

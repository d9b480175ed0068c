"""What every format importer returns: a checkpoint described as lazy global tensors.

An importer (hybridckpt/formats/<format>.py) turns a folder into a `SourceCheckpoint`: tensors
under the source's own global names (tensor-parallel shards already merged by the format's `tp`
rules, pipeline-local layer numbers already made global), the Adam moments of each trainable
tensor under the same names, the step, and the text of the rules that rename the source's names
into the single-card HF names (`hf_rules`). Nothing is read until a box of a tensor is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridckpt.io.model_files import ModelFile
from hybridckpt.lazy import LazyTensor


@dataclass(frozen=True)
class OptimizerState:
    """Per-parameter optimizer state, by slot, under the same source names as the tensors.

    slots:  slot name (the framework's own, e.g. torch's "exp_avg", "exp_avg_sq") -> source name
            -> LazyTensor (fp32). Which optimizer this is follows from the slot names
            (`hybridckpt.optim.for_slots`); shapes follow from each slot's relation to its param.
    step:   the optimizer's step count (torch's `step`, optax's `count`)
    master: fp32 master weights where the source keeps them apart from 16-bit model weights
    hyper:  the param-group hyperparameters (lr, betas, eps, weight_decay) when recorded
    groups: every param group as recorded, alike or not (its hyperparameters and `params`, how
            many params it names), where the format reads them (`torch_optim.group_table`)
    """

    slots: Mapping[str, Mapping[str, LazyTensor]]
    step: int | None = None
    master: Mapping[str, LazyTensor] = field(default_factory=dict)
    hyper: Mapping[str, Any] = field(default_factory=dict)
    groups: tuple[Mapping[str, Any], ...] = ()

    @property
    def optimizer(self):
        """The declared optimizer (`hybridckpt.optim.Optimizer`) these slots belong to."""
        from hybridckpt import optim

        return optim.for_slots(self.slots)

    def num_params(self) -> int:
        """How many parameters have state (the size of the largest slot)."""
        return max((len(v) for v in self.slots.values()), default=0)


@dataclass(frozen=True)
class IndexKeyedOptimizer:
    """A torch `Optimizer.state_dict()` keyed by parameter INDEX, not yet given names.

    The HF Trainer's `optimizer.pt`, accelerate's `optimizer.bin`, Lightning's `optimizer_states[k]`
    and a plain loop's `torch.save({"optimizer": opt.state_dict()})` record no parameter names: index
    i is the i-th parameter the optimizer was built with, over its groups in order. The names follow
    from the model's `named_parameters()` order and the tool's grouping rule (`optim.param_order`),
    decided where the model config is known (`jobs.open`).

    path:   the file the state was read from (for messages)
    tool:   who wrote it: "trainer", "accelerate", "lightning" or "torch" (the grouping rule to try)
    state:  index -> slot name -> LazyTensor (torch's `state[i]` without `step`)
    steps:  index -> that entry's `step`
    groups: the `param_groups` as recorded (hyper-parameters and `params`, their index lists)
    """

    path: str
    tool: str
    state: Mapping[int, Mapping[str, LazyTensor]]
    steps: Mapping[int, float] = field(default_factory=dict)
    groups: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class SourceCheckpoint:
    """A checkpoint of any format as lazy global tensors plus what is known about it.

    format:      short format name ("hf", "megatron", "meta-llama", "dcp", "deepspeed", ...)
    path:        the folder or file it was read from
    tensors:     source global name -> LazyTensor (model weights, as the source stores them)
    optimizer:   per-parameter optimizer slots by source name, or None when the source has none
    hf_rules:    rules text (hybridckpt.rules) mapping source names to HF names; "" when the
                 source names already are HF names. `{var}` in it is filled from the model
                 config (`models.rule_variables(cfg)`: num_heads, num_kv_heads, head_dim,
                 hidden_size, vocab_size, num_layers, intermediate_size, tied) and `rule_vars`
    rule_vars:   extra variables for `hf_rules` (e.g. {"swiglu": True, "padded_vocab": 256})
    config:      the model config (models.LlamaConfig / GPT2Config) when the source carries one
    step:        the training step / iteration, when known
    topology:    parallel degrees read from the files, e.g. {"tp": 2, "pp": 2, "dp": 4}
    trainer:     other trainer metadata (consumed samples, lr, rng, ...), JSON-serialisable
    notes:       human-readable remarks (skipped entries, assumptions), shown by `inspect`
    files:       the config, generation config and tokenizer files that travel with the weights
                 (`io.model_files.ModelFile` by name); set by `jobs.open` for other formats'
                 folders, by `formats.orbax_store` from what an import stored
    index_optimizer: an optimizer state keyed by parameter index, awaiting its names (set by the
                 reader with `optimizer=None`; `jobs.open` names it from the model's config)
    """

    format: str
    path: str
    tensors: Mapping[str, LazyTensor]
    optimizer: OptimizerState | None = None
    hf_rules: str = ""
    rule_vars: Mapping[str, Any] = field(default_factory=dict)
    config: Any = None
    step: int | None = None
    topology: Mapping[str, int] = field(default_factory=dict)
    trainer: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    files: Mapping[str, ModelFile] = field(default_factory=dict)
    index_optimizer: IndexKeyedOptimizer | None = None

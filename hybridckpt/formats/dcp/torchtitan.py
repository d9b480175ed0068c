"""torchtitan inside a DCP folder: its step folders, names, fused q/k/v optimizer state, trainer state.

Layout (torchtitan 0.3.0, the same code as pytorch/torchtitan at main; older releases noted):
- `CheckpointManager.save(step)` writes `<folder>/step-{step}/`, a DCP folder
  (pytorch/torchtitan:torchtitan/components/checkpointer/dcp.py `_create_checkpoint_id`). Its
  state dict is `_flattened_model_states_sd()`: the model's own fqns at the TOP level (no
  `model.` prefix), beside `optimizer`, `lr_scheduler` (`{"last_epoch"}`,
  components/optimizer/lr_scheduler.py), `train_state` (`{"step", "ntokens_seen"}`, trainer.py
  `Trainer.state_dict`) and `dataloader`. Given the parent folder, the latest `step-N` is read.
- The optimizer state is flat and keyed by PARAMETER fqn (components/optimizer/utils.py
  `get_flat_optim_state_dict`): `optimizer.state.<fqn>.{exp_avg,exp_avg_sq,step}` and
  `optimizer.param_groups.<fqn>.<key>` (`structure` reads both).
- Llama 3 and Qwen3 keep q/k/v as ONE parameter, `layers.N.attention.qkv_linear.wqkv.weight`
  (`fuse_qkv=True` in every config of models/llama3/__init__.py and models/qwen3/__init__.py),
  `[(heads + 2 * kv_heads) * head_dim, dim]` with rows per kv group `[heads/kv_heads q heads | k
  | v]` (models/common/attention.py `FusedQKVLinear`: the forward views the output
  `[n_kv, heads/kv_heads + 2, head_dim]`). Its state-dict hook `_split_qkv_on_save` saves the
  MODEL tensor split, `qkv_linear.wq/wk/wv.weight`, while the moments stay under the fused name.
  `split_fused_qkv` splits those (and a fused model tensor, as main saved it before the hook, in
  2026-04..06) into the same wq/wk/wv names by `rules/torchtitan_fused_qkv.rules`; then one set
  of rules takes params and moments alike to HF names. Splitting needs the head counts: without
  a model config the moments stay fused (noted).
- Names (`{qkv}` and `{head}` of the rules, told apart here): 0.3 has `attention.qkv_linear.wq`
  and the head `lm_head.weight` (models/llama3/state_dict_adapter.py `from_hf_map`); older
  releases `attention.wq` and `output.weight` (v0.2.x models/llama3/model/state_dict_adapter.py).
  A tied head (`enable_weight_tying`) is in the model state dict under both names and in the
  optimizer once, as `tok_embeddings.weight`; the rules drop the head copy when the config ties.
- RoPE, as each model's own `StateDictAdapter.to_hf` converts it: Llama 3 rotates Meta's
  interleaved pairs (`ComplexRoPE`), so wq/wk rows are permuted like Meta's
  (`rules/torchtitan_llama.rules`); Qwen3 rotates half-split (`CosSinRoPE._rotate_half`, as HF)
  and its adapter permutes nothing (`rules/torchtitan_qwen3.rules`; q_norm/k_norm tell it apart).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from hybridckpt.formats.dcp.storage import load_item
from hybridckpt.formats.rules_files import load_rules
from hybridckpt.io.dcp_metadata import DcpMetadata, metadata_files
from hybridckpt.lazy import LazyTensor

_STEP_DIR = re.compile(r"^step-(\d+)$")
# CheckpointManager's states other than the model and the optimizer (top-level keys)
TRAINER_STATES = ("lr_scheduler", "train_state", "dataloader")
FUSED = ".attention.qkv_linear.wqkv."
_FUSED_RULES = "torchtitan_fused_qkv.rules"


def step_folders(path: str) -> dict[int, str]:
    """`step-N` DCP folders directly under `path` (a CheckpointManager folder), by step."""
    try:
        names = os.listdir(path)
    except OSError:
        return {}
    out = {}
    for n in names:
        m = _STEP_DIR.match(n)
        full = os.path.join(path, n)
        if m and os.path.isdir(full) and metadata_files(full):
            out[int(m.group(1))] = full
    return out


def latest_step_folder(path: str) -> str | None:
    """The latest `step-N` folder under `path` when `path` is not a DCP folder itself."""
    if not os.path.isdir(path) or metadata_files(path):
        return None
    steps = step_folders(path)
    return steps[max(steps)] if steps else None


@dataclass(frozen=True)
class Dialect:
    """Which torchtitan names a checkpoint holds: `rules` (file under formats/rules/) and the
    `rule_vars` that fill it (`qkv`: "qkv_linear." in 0.3, "" before; `head`: the head's name;
    `freqs_cis`: whether an older release kept its RoPE buffer)."""

    family: str
    rules: str
    rule_vars: Mapping[str, object] = field(default_factory=dict)

    def note(self) -> str:
        permuted = "wq/wk RoPE rows permuted" if self.family == "llama" else "no RoPE permutation"
        return f"torchtitan {self.family} names: rules/{self.rules} ({permuted})"


def dialect(names) -> Dialect | None:
    """The torchtitan dialect of model tensor `names` (after the model prefix), or None."""
    names = list(names)
    titan = any(n.startswith("tok_embeddings.") for n in names) or any(
        ".attention.wq." in n or ".attention.qkv_linear." in n for n in names
    )
    if not titan:
        return None
    qkv = "qkv_linear." if any(".attention.qkv_linear." in n for n in names) else ""
    if "lm_head.weight" in names or "output.weight" in names:
        head = "lm_head" if "lm_head.weight" in names else "output"
    else:  # no head saved: the release's own name (the rules then match nothing there)
        head = "lm_head" if qkv else "output"
    qwen3 = any(".attention.q_norm." in n for n in names)
    family, rules = ("qwen3", "torchtitan_qwen3.rules") if qwen3 else ("llama", "torchtitan_llama.rules")
    return Dialect(family, rules, {"qkv": qkv, "head": head, "freqs_cis": "freqs_cis" in names})


def split_fused_qkv(
    tensors: Mapping[str, LazyTensor], num_heads: int, num_kv_heads: int
) -> dict[str, LazyTensor]:
    """`tensors` with every `qkv_linear.wqkv.{weight,bias}` split into `qkv_linear.wq/wk/wv`
    (lazy views; the others as they are)."""
    if not any(FUSED in n for n in tensors):
        return dict(tensors)
    rules = load_rules(_FUSED_RULES, {"num_heads": num_heads, "num_kv_heads": num_kv_heads})
    res = rules.apply(tensors, strict=False)
    return {**{n: tensors[n] for n in res.unconsumed}, **res.tensors}


def has_fused(tensors: Mapping[str, LazyTensor]) -> bool:
    return any(FUSED in n for n in tensors)


def is_trainer_state(key: str) -> bool:
    """A key of CheckpointManager's lr_scheduler / train_state / dataloader states."""
    return key.split(".", 1)[0] in TRAINER_STATES


def trainer_state(md: DcpMetadata) -> dict:
    """`train_state.step`, `train_state.ntokens_seen` and `lr_scheduler.last_epoch` when saved
    (plain ints; anything else is left out)."""
    out = {}
    for key in ("train_state.step", "train_state.ntokens_seen", "lr_scheduler.last_epoch"):
        if key in md.bytes_items:
            value = load_item(md, key)
            if isinstance(value, int) and not isinstance(value, bool):
                out[key] = value
    return out

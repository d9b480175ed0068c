"""ERNIE 4.5 MoE family config (`Ernie4_5_MoeForCausalLM`: ERNIE-4.5-21B-A3B, 300B-A47B; Baidu's,
trained in Paddle) and its HF form and rule variables (no JAX).

huggingface/transformers:src/transformers/models/ernie4_5_moe/modeling_ernie4_5_moe.py and
configuration_ernie4_5_moe.py (5.24): ERNIE 4.5's attention (`models.ernie4_5`: interleaved RoPE,
`use_bias`) with, on layer i where `(i + 1) % moe_layer_interval == 0` and
`moe_layer_start_index <= i <= moe_layer_end_index` (-1: the last layer), a mixture of
`moe_num_experts` SwiGLU experts (width `moe_intermediate_size`, no biases):
- router (`Ernie4_5_MoeTopKRouter`, fp32): probabilities = softmax(x @ gate); the `moe_k` experts
  chosen by the top-k of probabilities + `e_score_correction_bias` (`Ernie4_5_MoeStatics`, stored
  `[1, experts]`, for the choice only); their plain probabilities divided by max(sum,
  `moe_norm_min`), cast to the hidden dtype;
- `moe_num_shared_experts` > 0: a shared SwiGLU of width `moe_intermediate_size * shared` (with
  the `use_bias` biases) on the same input, added.
Other layers have the dense SwiGLU of `intermediate_size` (biases with `use_bias`). With
`use_bias` the lm_head has a bias too (`lm_head.bias`, also when tied).

HF `config.json`: architectures `Ernie4_5_MoeForCausalLM` (or `model_type` "ernie4_5_moe"); keys
absent take Ernie4_5_MoeConfig's defaults (HF_DEFAULTS; `head_dim` hidden / heads). The releases'
config.json carries keys transformers ignores (`moe_gate`, `moe_use_aux_free`, ...): not kept.
transformers renames the stored `mlp.moe_statics.e_score_correction_bias` to
`mlp.gate.moe_statics.e_score_correction_bias` on load (its conversion mapping) and back on save;
a file holding the in-memory name is read under the stored one (`hf_name_fixes`), as a file with
transformers' fused experts is.

MTP: the releases carry `num_nextn_predict_layers` multi-token-prediction modules i = 0, 1, ...:
`model.mtp_emb_norm.{i}.weight`, `model.mtp_hidden_norm.{i}.weight`, `model.mtp_linear_proj.{i}.weight`
`[E, 2E]` and a decoder layer `model.mtp_block.{i}.*` (layer index num_layers + i, past
`moe_layer_end_index` in the releases: a dense MLP). transformers ignores them on load
(`_keys_to_ignore_on_load_unexpected = ["mtp"]`) and saves none; here they are params (`mtp`), kept
bit for bit through import and export, unused by the forward pass. `mtp_layers` counts the modules
a checkpoint carries (`fit_to_hf_names`); an MTP layer the config makes an MoE layer is refused.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping
from typing import Any

from hybridckpt.models.config_checks import check_positive, require
from hybridckpt.models.ernie4_5 import config as dense
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.llama import config as llama
from hybridckpt.models.mixtral.config import fused_expert_fixes, layer_list

ARCHITECTURE = "Ernie4_5_MoeForCausalLM"
MODEL_TYPE = "ernie4_5_moe"
HF_DEFAULTS = {"moe_intermediate_size": 1536, "moe_k": 6, "moe_num_experts": 64, "moe_num_shared_experts": 2,
               "moe_layer_start_index": 1, "moe_layer_end_index": -1, "moe_layer_interval": 1,
               "moe_norm_min": 1e-12, "intermediate_size": 12288}  # fmt: skip
_MTP_BLOCK = re.compile(r"model\.mtp_block\.(\d+)\.")
STATICS = "mlp.moe_statics.e_score_correction_bias"  # the stored name
STATICS_IN_MEMORY = "mlp.gate.moe_statics.e_score_correction_bias"  # transformers' module name


@dataclasses.dataclass(frozen=True)
class Ernie45MoeConfig(dense.Ernie45Config):
    """ERNIE 4.5 MoE: Ernie45Config's fields (intermediate_size the dense layers' width) plus the
    MoE fields of the module docstring (`moe_layer_end_index` resolved: never -1)."""

    moe_num_experts: int = 64
    moe_k: int = 6
    moe_intermediate_size: int = 1536
    moe_num_shared_experts: int = 2
    moe_layer_start_index: int = 1
    moe_layer_end_index: int = -1
    moe_layer_interval: int = 1
    moe_norm_min: float = 1e-12
    num_nextn_predict_layers: int = 0
    mtp_layers: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        where = type(self).__name__
        check_positive(self, ("moe_num_experts", "moe_k", "moe_intermediate_size", "moe_layer_interval"))
        for name in ("moe_num_shared_experts", "moe_layer_start_index", "moe_layer_end_index"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (-1 if name == "moe_layer_end_index" else 0):
                raise ConfigError(f"{where}.{name}: expected an int >= 0, found {v!r:.60}")
        if self.moe_layer_end_index == -1:
            object.__setattr__(self, "moe_layer_end_index", self.num_layers - 1)
        if self.moe_k > self.moe_num_experts:
            raise ConfigError(f"{where}: moe_k {self.moe_k} exceeds moe_num_experts {self.moe_num_experts}")
        m = self.moe_norm_min
        if isinstance(m, bool) or not isinstance(m, int | float) or not 0 <= m < 1:
            raise ConfigError(f"{where}.moe_norm_min: expected a number in [0, 1), found {m!r:.60}")
        object.__setattr__(self, "moe_norm_min", float(m))
        n = self.num_nextn_predict_layers
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= self.num_layers:
            raise ConfigError(f"{where}.num_nextn_predict_layers: expected 0..num_layers, found {n!r:.60}")
        if self.mtp_layers is None:
            object.__setattr__(self, "mtp_layers", n)
        if not isinstance(self.mtp_layers, int) or not 0 <= self.mtp_layers <= n:
            raise ConfigError(f"{where}.mtp_layers: expected 0..num_nextn_predict_layers ({n}), "
                              f"found {self.mtp_layers!r:.60}")  # fmt: skip
        moe_mtp = [i for i in range(self.mtp_layers) if self._is_moe(self.num_layers + i)]
        if moe_mtp:
            raise ConfigError(f"{where}: MTP layer {moe_mtp[0]} (layer index {self.num_layers + moe_mtp[0]}) "
                              f"would be a mixture of experts (moe_layer_end_index {self.moe_layer_end_index}); "
                              f"only dense MTP layers (the releases') are supported")  # fmt: skip
        if not self.moe_layers:
            raise ConfigError(f"{where}: no layer is a mixture of experts (moe_layer_start_index "
                              f"{self.moe_layer_start_index}, end {self.moe_layer_end_index}, interval "
                              f"{self.moe_layer_interval}); a dense model is an Ernie4_5ForCausalLM")  # fmt: skip

    @property
    def family(self) -> str:
        return "ernie4_5_moe"

    def _is_moe(self, i: int) -> bool:
        """Layer i's MLP is the mixture (`Ernie4_5_MoeDecoderLayer.__init__`'s condition)."""
        return (i + 1) % self.moe_layer_interval == 0 and self.moe_layer_start_index <= i <= self.moe_layer_end_index

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Layers whose MLP is the mixture."""
        return tuple(i for i in range(self.num_layers) if self._is_moe(i))

    @property
    def dense_layers(self) -> tuple[int, ...]:
        moe = set(self.moe_layers)
        return tuple(i for i in range(self.num_layers) if i not in moe)

    @property
    def routing_bias(self) -> bool:
        """The correction bias is added for the choice (a test turns it off)."""
        return True


def from_hf(d: Mapping[str, Any], source: str) -> Ernie45MoeConfig:
    """An Ernie45MoeConfig from an HF `config.json` dict; `source` names the file in errors."""
    view = {**HF_DEFAULTS, **{k: v for k, v in d.items() if v is not None or k == "head_dim"}}
    require(view, llama.HF_REQUIRED, source, ARCHITECTURE)
    for key in ("moe_num_experts", "moe_k", "moe_layer_start_index", "moe_layer_end_index"):
        if isinstance(view[key], list | tuple):  # ERNIE-VL's per-modality lists
            raise ConfigError(f"{source}: {key} {view[key]!r:.60} is a list (ERNIE 4.5 VL); expected an int")
    cfg = dense.read_llama(dense.llama_view(view, None), source)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    try:
        return Ernie45MoeConfig(
            **fields, use_bias=view.get("use_bias") or False,
            **{k: view[k] for k in HF_DEFAULTS if k != "intermediate_size"},
            num_nextn_predict_layers=view.get("num_nextn_predict_layers") or 0,
        )
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def to_hf(cfg: Ernie45MoeConfig) -> dict[str, Any]:
    """A `config.json` dict transformers loads back as an Ernie4_5_MoeForCausalLM (`head_dim` only
    when it is not hidden / heads: no Ernie4_5_MoeConfig field)."""
    d = dense.to_hf(cfg) | {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
    if cfg.head_dim * cfg.num_heads == cfg.hidden_size:
        del d["head_dim"]
    d |= {k: getattr(cfg, k) for k in HF_DEFAULTS if k != "intermediate_size"}
    if cfg.num_nextn_predict_layers:
        d["num_nextn_predict_layers"] = cfg.num_nextn_predict_layers
    return d


def fit_to_hf_names(cfg: Ernie45MoeConfig, names: Collection[str]) -> Ernie45MoeConfig:
    """`cfg` with `mtp_layers` the MTP modules i = 0, 1, ... whose `model.mtp_block.{i}.` keys are
    among the HF `names` (at most `num_nextn_predict_layers`)."""
    present = set()
    for name in names:
        m = _MTP_BLOCK.match(name)
        if m:
            present.add(int(m.group(1)))
    count = 0
    while count in present and count < cfg.num_nextn_predict_layers:
        count += 1
    return cfg if count == cfg.mtp_layers else dataclasses.replace(cfg, mtp_layers=count)


def hf_name_fixes(names: Collection[str]) -> str:
    """Rules renaming transformers' in-memory spellings to the stored ones, when a file holds them:
    the fused experts (`mlp.experts.gate_up_proj` / `down_proj`, lazily split per expert) and the
    correction bias under the router (`mlp.gate.moe_statics.*`); "" for the releases' layout."""
    fused = fused_expert_fixes(names, "mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj")
    statics = any(n.endswith("." + STATICS_IN_MEMORY) for n in names)
    if not statics:
        return fused
    lines = fused.removesuffix("* -> *\n")
    pre = "model.layers.$L"
    return f"{lines}{pre}.{STATICS_IN_MEMORY} -> {pre}.{STATICS}\n* -> *\n"


def rule_variables(cfg: Ernie45MoeConfig) -> dict[str, Any]:
    """ERNIE's rule variables plus the layer lists `moe_layers` / `dense_layers` ("0,1,..."),
    `mtp_layers` (the MTP modules' indices 0..mtp_layers-1) and `num_experts`."""
    return dense.rule_variables(cfg) | {
        "num_experts": cfg.moe_num_experts,
        "mtp_layers": layer_list(tuple(range(cfg.mtp_layers))),
        "moe_layers": layer_list(cfg.moe_layers),
        "dense_layers": layer_list(cfg.dense_layers),
    }

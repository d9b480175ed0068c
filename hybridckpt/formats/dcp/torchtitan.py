"""torchtitan inside a DCP folder: its step folders, names, fused q/k/v optimizer state, trainer state.

Layout (torchtitan 0.3.0, the same code as pytorch/torchtitan at main; older releases noted).
Pinned by checkpoints torchtitan 0.3.0 wrote itself (tests/real/cases/torchtitan_{llama3,qwen3,
qwen3_moe}, tests/real/test_real_torchtitan.py: FSDP2 on 2 ranks, EP 2 x FSDP 2 on 4):
- `CheckpointManager.save(step)` writes `<folder>/step-{step}/`, a DCP folder
  (pytorch/torchtitan:torchtitan/components/checkpointer/dcp.py `_create_checkpoint_id`). Its
  state dict is `_flattened_model_states_sd()`: the model's own fqns at the TOP level (no
  `model.` prefix), beside `optimizer`, `lr_scheduler` (`{"last_epoch"}`,
  components/optimizer/lr_scheduler.py), `train_state` (`{"step", "ntokens_seen"}`, trainer.py
  `Trainer.state_dict`) and `dataloader`. Given the parent folder, the latest `step-N` is read (`steps`; `--step` picks another).
- The optimizer state is flat and keyed by PARAMETER fqn (components/optimizer/utils.py
  `get_flat_optim_state_dict`): `optimizer.state.<fqn>.{exp_avg,exp_avg_sq,step}` and
  `optimizer.param_groups.<fqn>.<key>` (`structure` reads both). The group's `lr` is the one
  LambdaLR set for the NEXT step (`initial_lr` beside it), which is what a resumed step uses.
- Llama 3 and Qwen3 keep q/k/v as ONE parameter, `layers.N.attention.qkv_linear.wqkv.weight`
  (`fuse_qkv=True` in every config of models/llama3/__init__.py and models/qwen3/__init__.py),
  `[(heads + 2 * kv_heads) * head_dim, dim]` with rows per kv group `[heads/kv_heads q heads | k
  | v]` (models/common/attention.py `FusedQKVLinear`: the forward views the output
  `[n_kv, heads/kv_heads + 2, head_dim]`). Its state-dict hook `_split_qkv_on_save` saves the
  MODEL tensor split, `qkv_linear.wq/wk/wv.weight` (gathered first: one whole chunk each on
  disk), while the moments stay under the fused name, FSDP-sharded.
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
  (models/llama/dialects/torchtitan.rules); Qwen3 rotates half-split (`CosSinRoPE._rotate_half`,
  as HF) and its adapter permutes nothing (models/qwen3/dialects/torchtitan.rules; its k_norm
  tells it apart).
- MoE layers (Qwen3-MoE; every layer of torchtitan's Qwen3 MoE configs) hold `moe.` instead of
  `feed_forward.`: the experts of a layer are ONE parameter per projection with the expert on the
  leading axis (`moe.routed_experts.inner_experts.w1_EFD`/`w3_EFD` `[experts, hidden, dim]`,
  `w2_EDF` `[experts, dim, hidden]`; `moe.experts.w1|w3|w2` up to v0.2.x), sharded over experts
  (EP) and FSDP in the DCP files (the reader joins the chunks at their global offsets): while
  efsdp * ep <= experts both shard the EXPERT axis (`_StridedShard(0)` over efsdp, `Shard(0)`
  over ep: whole experts per chunk, rank r of 2 x 2 holding expert (r % 2) * 2 + r // 2), the
  hidden axis (`Shard(1)` over efsdp) only when efsdp * ep > experts (distributed/fsdp.py). Their
  moments are keyed by the same grouped parameter. `split_experts` takes params and moments
  alike apart into one lazy view per expert (`rules/torchtitan_moe_experts.rules`), every grouped
  tensor checked to hold the config's number of experts; the family's rules then give
  HF's per-expert names (`mlp.experts.E.gate_proj.weight`, router `mlp.gate.weight`), as the
  adapters' `to_hf` do. The load-balancing buffer `moe.expert_bias_E` (selection only) has no HF
  Qwen3-MoE counterpart and torchtitan's `to_hf` drops it: so do the rules, with a note when it
  is not zero (the HF model then routes without it, as torchtitan's own export does; after 3
  steps of the real case, |bias| ~3e-3 already changes some tokens' experts, logits by ~0.2).
  It is saved whole (a buffer, not FSDP-sharded), without optimizer state. torchtitan computes
  the experts in bfloat16 (`GroupedExperts.forward` casts), so its own logits differ from an
  fp32 forward by bf16 rounding.
- DeepSeek V3 (`attention.wkv_a` tells it apart; models/deepseek_v3/state_dict_adapter.py):
  MLA names (models/deepseek_v3/dialects/torchtitan.rules), dense first layers, shared experts, and
  `moe.expert_bias_E` kept as HF's `mlp.gate.e_score_correction_bias` (a buffer: zero moments).
  Its MTP layers (`mtp_layers.i.*`) become HF's `model.layers.{n + i}.*` after the n main layers
  (`mtp_tensors`), with the main embedding and head as their `embed_tokens` / `shared_head.head`.
Which family the names are is the families' to say: each has a torchtitan dialect
(`models/<family>/dialects/torchtitan.py`: `MARKERS`, substrings some tensor name holds, the most
of them winning; `NOTE`; optional `KEEPS_EXPERT_BIAS`, `FLAGS` rule variables and `RULES`; and
`torchtitan.rules`, its names -> HF names), found through the registry (`dialect`). The fused
q/k/v split, the grouped experts' split, the MTP renumbering and the trainer state are
torchtitan's own, the same for every family, and stay here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from hybridckpt import lazy, models
from hybridckpt.containers.dcp_metadata import DcpMetadata, metadata_files
from hybridckpt.errors import FormatError
from hybridckpt.formats.dcp.storage import load_item
from hybridckpt.formats.rules_files import load_rules
from hybridckpt.io.step_folders import StepFolders, StepPattern, listing
from hybridckpt.lazy import LazyTensor
from hybridckpt.models.dialect import most_specific

# CheckpointManager's states other than the model and the optimizer (top-level keys)
TRAINER_STATES = ("lr_scheduler", "train_state", "dataloader")
FUSED = ".attention.qkv_linear.wqkv."
_FUSED_RULES = "torchtitan_fused_qkv.rules"
_EXPERTS_RULES = "torchtitan_moe_experts.rules"
DIALECT = "torchtitan"  # models/<family>/dialects/torchtitan.{py,rules}
# a grouped experts parameter: 0.3 / main, and releases up to v0.2.x
_GROUPED = re.compile(
    r"^layers\.\d+\.moe\.(routed_experts\.inner_experts\.w[123]_E(FD|DF)|experts\.w[123])$"
)
_EXPERT_BIAS = re.compile(r"^layers\.\d+\.moe\.expert_bias(_E)?$")


STEP_DIRS = StepPattern("step-")  # CheckpointManager.save(step): `<folder>/step-{step}/`


def steps(path: str) -> StepFolders | None:
    """The `step-N` DCP folders directly under `path` (a CheckpointManager folder), or None when
    `path` is a DCP folder itself or holds none. A step folder counts when it holds DCP metadata
    (names only), as torchtitan's own `_find_load_step` counts those with a `.metadata`; the
    default is the latest."""
    if not os.path.isdir(path) or metadata_files(path):
        return None
    found = listing(path, STEP_DIRS, lambda f: bool(metadata_files(f)))
    return found if found.folders else None


@dataclass(frozen=True)
class Dialect:
    """Which torchtitan names a checkpoint holds: the family whose torchtitan dialect they are
    (`models/<family>/dialects/torchtitan.{py,rules}`) and the `rule_vars` that fill its rules
    (`qkv`: "qkv_linear." in 0.3, "" before; `head`: the head's name; `freqs_cis`: whether an
    older release kept its RoPE buffer; the MoE layers' facts; the family's `FLAGS`)."""

    family: str
    rule_vars: Mapping[str, object] = field(default_factory=dict)
    moe: bool = False  # some layer is an MoE layer (`moe.`)

    @property
    def spec(self) -> models.Dialect:
        # among the families that speak torchtitan (`models.dialects`, which imports those 4 of the
        # 27 packages only): `family_named` would import every family to find one
        found = models.dialects(DIALECT).get(self.family)
        return found if found is not None else models.family_named(self.family).dialect(DIALECT)

    def rules_text(self) -> str:
        """The rules text that takes these names to HF's (the family's dialect)."""
        return self.spec.rules_text()

    def keeps_expert_bias(self) -> bool:
        """The family's HF form keeps torchtitan's load-balancing expert bias (as a param)."""
        return bool(self.spec.get("KEEPS_EXPERT_BIAS", False))

    def note(self) -> str:
        origin = self.spec.rules()[1]
        return f"torchtitan {self.family} names: {origin} ({self.spec.get('NOTE', '')})"


def _is_torchtitan(names: list[str]) -> bool:
    """Names of torchtitan's own modules, which every model of it has."""
    return any(n.startswith("tok_embeddings.") for n in names) or any(
        ".attention.wq." in n or ".attention.qkv_linear." in n for n in names
    )


def export_families() -> list[str]:
    """Our families torchtitan 0.3 trains dense (their torchtitan dialect says `EXPORTED`)."""
    return sorted(f for f, d in models.dialects(DIALECT).items() if d.get("EXPORTED", False))


def export_dialect(family: str) -> Dialect | None:
    """The dialect torchtitan 0.3 saves a dense model of our `family` in (fused q/k/v moments,
    `qkv_linear.` names, head `lm_head`; the writer inverts its rules), or None when
    torchtitan has no such model here."""
    if family not in export_families():
        return None
    rule_vars = {"qkv": "qkv_linear.", "head": "lm_head", "freqs_cis": False, "dense_ffn": True,
                 "shared_experts": False, "expert_bias_to_hf": False, "expert_bias_dropped": False}  # fmt: skip
    return Dialect(family, rule_vars)


def dialect(names) -> Dialect | None:
    """The torchtitan dialect of model tensor `names` (after the model prefix), or None when
    they are not torchtitan's. The family is the one whose `MARKERS` (substrings some name
    holds) the names show, the most of them winning (Qwen3-MoE's q/k norms and `moe.` over
    Qwen3's q/k norms over Llama's none); a FormatError when no family, or several alike, fit."""
    names = list(names)
    known = models.dialects(DIALECT)
    marks = {f: tuple(d.get("MARKERS", ())) for f, d in known.items()}
    fits = {
        f: len(m) if all(any(k in n for n in names) for k in m) else None for f, m in marks.items()
    }
    if not _is_torchtitan(names) and not any(fits[f] for f in fits):
        return None
    best = most_specific(fits)
    if len(best) != 1:
        raise FormatError(
            f"torchtitan names ({sorted(names)[:3]}, ...) fit "
            + (
                f"the families {best} alike"
                if best
                else f"no family; families read: {sorted(known)}"
            )
        )
    family = best[0]
    qkv = "qkv_linear." if any(".attention.qkv_linear." in n for n in names) else ""
    if "lm_head.weight" in names or "output.weight" in names:
        head = "lm_head" if "lm_head.weight" in names else "output"
    else:  # no head saved: the release's own name (the rules then match nothing there)
        head = "lm_head" if qkv else "output"
    bias = any(_EXPERT_BIAS.match(n) for n in names)
    keeps = bool(known[family].get("KEEPS_EXPERT_BIAS", False))
    rule_vars = {
        "qkv": qkv,
        "head": head,
        "freqs_cis": "freqs_cis" in names,
        "dense_ffn": any(".feed_forward." in n for n in names),
        "shared_experts": any(".moe.shared_experts." in n for n in names),
        # kept as a param (DeepSeek V3's e_score_correction_bias), else dropped (noted)
        "expert_bias_to_hf": bias and keeps,
        "expert_bias_dropped": bias and not keeps,
    }
    for var, mark in dict(known[family].get("FLAGS", {})).items():
        rule_vars[var] = any(mark in n for n in names)
    return Dialect(family, rule_vars, moe=any(".moe." in n for n in names))


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


def fuse_qkv(
    tensors: Mapping[str, LazyTensor], num_heads: int, num_kv_heads: int
) -> dict[str, LazyTensor]:
    """The inverse of `split_fused_qkv` (the same rules, inverted): every `qkv_linear.wq/wk/wv`
    triple fused into `qkv_linear.wqkv`, rows per kv group `[heads/kv_heads q | k | v]` (what
    torchtitan's optimizer keys the moments by); the others as they are."""
    rules = load_rules(_FUSED_RULES, {"num_heads": num_heads, "num_kv_heads": num_kv_heads}).invert()
    res = rules.apply(tensors, strict=False)
    return {**{n: tensors[n] for n in res.unconsumed}, **res.tensors}


def has_fused(tensors: Mapping[str, LazyTensor]) -> bool:
    return any(FUSED in n for n in tensors)


def grouped_experts(tensors: Mapping[str, LazyTensor]) -> list[str]:
    """The names of grouped experts parameters (`[experts, ...]`) among `tensors`."""
    return [n for n in tensors if _GROUPED.match(n)]


def split_experts(
    tensors: Mapping[str, LazyTensor], experts: Mapping[str, int], what: str
) -> dict[str, LazyTensor]:
    """`tensors` with every grouped experts parameter taken apart into one lazy view per expert,
    `layers.N.moe.experts.E.w1|w3|w2.weight` (the others as they are; `moe.expert_bias_E` under
    one name). `experts`: layer prefix (`layers.N`) -> the number of experts that layer must
    hold on the leading axis (`expert_counts`); `what` names the checkpoint in the error."""
    grouped = grouped_experts(tensors)
    if not grouped and not any(_EXPERT_BIAS.match(n) for n in tensors):
        return dict(tensors)
    for n in grouped:
        t, want = tensors[n], experts.get(_layer(n))
        if t.ndim != 3 or t.shape[0] != want:
            raise FormatError(
                f"{what}: '{n}' is {tuple(t.shape)}; expected [{want}, ...]: {want} experts on "
                "the leading axis (the config's count and its layer's router rows)"
            )
    res = load_rules(_EXPERTS_RULES).apply_unstack(tensors, strict=False)
    return {**{n: tensors[n] for n in res.unconsumed}, **res.tensors}


def _layer(name: str) -> str:
    return name.split(".moe.", 1)[0]


def expert_counts(
    tensors: Mapping[str, LazyTensor], n_config: int | None, what: str
) -> dict[str, int]:
    """Layer prefix -> its number of experts: the router's rows (`moe.router.gate.weight`
    `[experts, dim]`), which must equal the config's count when the config gives one; without a
    router, the config's count, else the first grouped tensor's."""
    out = {}
    for n in grouped_experts(tensors):
        layer = _layer(n)
        router = tensors.get(f"{layer}.moe.router.gate.weight")
        rows = router.shape[0] if router is not None and router.ndim == 2 else None
        if rows is not None and n_config is not None and rows != n_config:
            raise FormatError(
                f"{what}: '{layer}.moe.router.gate.weight' routes to {rows} experts; the config "
                f"says {n_config}"
            )
        out[layer] = rows or n_config or tensors[n].shape[0]
    return out


def num_experts(cfg) -> int | None:
    """The number of routed experts a model config declares, or None (no config, or not MoE)."""
    if cfg is None:
        return None
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        v = models.rule_variables(cfg).get(key, getattr(cfg, key, None))
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def moe_tensors(
    tensors: dict[str, LazyTensor], slots: dict[str, dict[str, LazyTensor]], cfg, what: str
) -> tuple[dict, dict, list[str]]:
    """Params and every slot with their grouped experts split per expert (`split_experts`), and
    notes: how many experts were split, and a non-zero `moe.expert_bias_E` that HF's Qwen3-MoE
    cannot carry (dropped, as torchtitan's `to_hf` drops it)."""
    tensors, slots, notes = mtp_tensors(tensors, slots, what)
    grouped = grouped_experts(tensors)
    bias = sorted(n for n in tensors if _EXPERT_BIAS.match(n))
    if not grouped and not bias:
        return tensors, slots, notes
    kept = dialect(tensors).keeps_expert_bias()
    counts = expert_counts(tensors, num_experts(cfg), what)
    count = tensors[grouped[0]].shape[0] if grouped else 0
    tensors = split_experts(tensors, counts, what)
    slots = {s: split_experts(t, counts, f"{what} (optimizer {s})") for s, t in slots.items()}
    if grouped:
        notes.append(
            f"torchtitan grouped experts ({len(grouped)} tensors of {count} experts, e.g. "
            f"'{grouped[0]}') split into one tensor per expert, params and moments alike"
        )
    if bias and kept and slots:
        # a buffer, not a parameter: no optimizer state; the family keeps it as a param
        # (HF's e_score_correction_bias), so its moments are zeros, as AdamW's own would be
        for b in bias:
            t = tensors[_bias_name(b)]
            zeros = lazy.ArrayTensor(np.zeros(t.shape, np.dtype(t.dtype)))
            for tree in slots.values():
                tree[_bias_name(b)] = zeros
        notes.append(
            f"torchtitan's expert bias ({bias[0]}, ...) is HF's mlp.gate.e_score_correction_bias: "
            "a buffer without optimizer state, given zero moments"
        )
    elif bias:
        peak = max(float(abs(tensors[_bias_name(b)].materialize()).max(initial=0.0)) for b in bias)
        if peak != 0.0:
            notes.append(
                f"torchtitan's load-balancing expert bias ({bias[0]}, ...; max |bias| {peak:g}) is "
                "dropped as torchtitan's Qwen3 to_hf drops it: HF Qwen3-MoE has none, so the "
                "converted model selects its top-k experts without it"
            )
    return tensors, slots, notes


_MTP = re.compile(r"^mtp_layers\.(\d+)\.(.+)$")
_MAIN_LAYER = re.compile(r"^layers\.(\d+)\.")


def mtp_tensors(
    tensors: dict[str, LazyTensor], slots: dict[str, dict[str, LazyTensor]], what: str
) -> tuple[dict, dict, list[str]]:
    """DeepSeek V3's MTP layers (models/deepseek_v3/mtp.py: `mtp_layers.i.*`, a decoder block
    plus `enorm`, `hnorm`, `eh_proj`, `mtp_norm`) renamed `layers.{n + i}.*` after the n main
    layers, as the adapter's `to_hf` numbers them (`_map_to_hf_layer_key`). An MTP layer uses the
    main model's `tok_embeddings` and head (mtp.py `forward`), which HF's checkpoints store per
    MTP module (`embed_tokens`, `shared_head.head`): both given as aliases of the main ones
    (`layers.{n + i}.mtp_embed.weight`, `mtp_head.weight`), with the same moments."""
    mtp = {n: m for n in tensors if (m := _MTP.match(n))}
    if not mtp:
        return tensors, slots, []
    main = {int(m.group(1)) for n in tensors if (m := _MAIN_LAYER.match(n))}
    n_main = max(main) + 1 if main else 0
    head = "lm_head.weight" if "lm_head.weight" in tensors else "output.weight"
    for need in ("tok_embeddings.weight", head):
        if need not in tensors:
            raise FormatError(f"{what}: MTP layers {sorted(mtp)[:1]} but no '{need}' to share")
    ids = sorted({int(m.group(1)) for m in mtp.values()})

    def rename(tree: dict[str, LazyTensor]) -> dict[str, LazyTensor]:
        out = {}
        for k, t in tree.items():
            m = _MTP.match(k)
            out[f"layers.{n_main + int(m.group(1))}.{m.group(2)}" if m else k] = t
        for i in ids:
            for alias, src in (("mtp_embed", "tok_embeddings.weight"), ("mtp_head", head)):
                if src in tree:
                    out[f"layers.{n_main + i}.{alias}.weight"] = tree[src]
        return out

    note = (
        f"torchtitan MTP layers {ids} numbered after the {n_main} main layers (HF layers "
        f"{[n_main + i for i in ids]}); their embed_tokens / shared_head.head are the main "
        "model's tok_embeddings and head, which they share in torchtitan (moments too)"
    )
    return rename(tensors), {s: rename(t) for s, t in slots.items()}, [note]


def _bias_name(name: str) -> str:
    """The expert bias's name after `split_experts` (one name for every release)."""
    return name[: -len("_E")] if name.endswith("_E") else name


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

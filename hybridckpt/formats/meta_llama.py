"""Meta Llama reference checkpoints (`params.json` + `consolidated.{mp:02d}.pth`) and Mistral's
native layout (`params.json` + `consolidated.safetensors`).

Layout (meta-llama/llama and meta-llama/llama3 `llama/model.py`, `llama/generation.py`
`Llama.build`; fairscale/nn/model_parallel/layers.py):
- `params.json`: `dim`, `n_layers`, `n_heads`, `n_kv_heads` (absent = n_heads), `vocab_size`
  (-1 in Llama 1/2: the tokenizer's size), `multiple_of`, `ffn_dim_multiplier`, `norm_eps`,
  `rope_theta`, `use_scaled_rope` (Llama 3.1+: HF's llama3 RoPE scaling; read by
  `models.llama.config.config_from_meta_params`).
- One flat torch.save state dict per model-parallel rank, `consolidated.00.pth` ..
  `consolidated.{n-1:02d}.pth` (all must exist): `tok_embeddings.weight`,
  `layers.{i}.attention.{wq,wk,wv,wo}.weight`, `layers.{i}.feed_forward.{w1,w2,w3}.weight`,
  `layers.{i}.{attention_norm,ffn_norm}.weight`, `norm.weight`, `output.weight`, and in some
  releases `rope.freqs` (a buffer, skipped).
- Shards merge by the `tp` rules of `rules/meta_llama.rules`. `tok_embeddings` is split on dim 1
  in Llama 1/2 (ParallelEmbedding) and on dim 0 in Llama 3 (VocabParallelEmbedding): decided by
  comparing rank 0's shard shape with `dim`. When n_kv_heads < mp (Llama 3.1 405B), each kv
  head is replicated on mp / n_kv_heads consecutive ranks: one rank of each group is read.
- q/k rows are interleaved RoPE pairs per head; `hf_rules` permute them to HF's half-split.

Mistral (mistralai/mistral-inference:src/mistral_inference/transformer.py `Transformer.from_folder`:
`params.json` plus `consolidated.safetensors`, or a single `consolidated.00.pth`, never both;
transformer_layers.py: the same module names as Meta's, q/k rotated as interleaved pairs by
rope.py `apply_rotary_emb`, so the same rules and RoPE permutation):
- `params.json` is `TransformerArgs` (mistral_inference/args.py): `dim`, `n_layers`, `head_dim`,
  `hidden_dim` (the SwiGLU width), `n_heads`, `n_kv_heads`, `norm_eps`, `vocab_size`, optional
  `rope_theta`, `sliding_window` (`_sliding_window` in some releases), `moe`, `lora`,
  `vision_encoder`. `hidden_dim` and `head_dim` (absent from Meta's `ModelArgs`) tell a Mistral
  params.json apart, whichever file holds the weights.
- It becomes an HF MistralConfig dict as transformers' own converter writes it
  (huggingface/transformers:src/transformers/models/mistral/convert_mistral_weights_to_hf.py
  `convert_config`: `sliding_window` may be a string; `max_seq_len` or 32768 for
  max_position_embeddings), read by `models.config_from_hf`. A missing `rope_theta` is 1e6
  without a sliding window and 1e4 with one (mistral-inference@b818190 transformer.py, the rule
  Mistral 7B v0.1's windowed params.json was released under; HF's conversion of it says 10000).
- `moe` (Mixtral: mistral_inference/moe.py `MoeArgs` `num_experts`, `num_experts_per_tok`):
  every layer's `feed_forward` is a `MoeLayer` (transformer_layers.py `TransformerBlock`): a
  router `layers.{i}.feed_forward.gate.weight` [experts, dim] and experts
  `layers.{i}.feed_forward.experts.{e}.{w1,w2,w3}.weight` (`FeedForward`, `hidden_dim` wide),
  renamed to HF's `block_sparse_moe.*` as transformers' converter does
  (convert_mistral_weights_to_hf.py `STATE_DICT_MAPPING`, "MOE model: routed experts"). Its
  routing (top-k of the logits, then a softmax over those k) equals HF Mixtral's softmax, top-k,
  renormalise. The config is an HF MixtralConfig dict. mistral-inference splits no expert across
  ranks (it has pipeline ranks only), so Mixtral comes as one file; experts in several
  `consolidated.NN.pth` are refused by the missing `tp` rule.
- Refused: `vision_encoder` (Pixtral), `moe` keys other than the two above, per-layer
  `sliding_window` lists that differ between layers: no family implements them.
"""

from __future__ import annotations

import os
import re

import numpy as np

from hybridckpt.containers.pickle import torch_save
from hybridckpt.containers.safetensors_file import read_header
from hybridckpt.errors import ConfigError, FormatError, UnknownModelError
from hybridckpt.formats.config_file import read_json
from hybridckpt.formats.rules_files import load_rules, rules_text
from hybridckpt.lazy import LazyTensor
from hybridckpt.source_checkpoint import SourceCheckpoint

NAME = "meta-llama"
PARAMS = "params.json"
_SHARD = re.compile(r"^consolidated\.(\d{2})\.pth$")
SAFETENSORS = "consolidated.safetensors"  # Mistral's native layout
_RULES = "meta_llama.rules"
_SKIPPED = ("rope.freqs",)
_KV = re.compile(r"^layers\.\d+\.attention\.w[kv]\.weight$")


def _shards(folder: str) -> list[str]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(n for n in names if _SHARD.match(n))


def detect(path: str) -> bool:
    return (
        os.path.isdir(path)
        and os.path.isfile(os.path.join(path, PARAMS))
        and (bool(_shards(path)) or os.path.isfile(os.path.join(path, SAFETENSORS)))
    )


def read_params(path: str) -> dict:
    """`params.json` as a dict (FormatError naming the file when missing or malformed)."""
    return read_json(path)


def _files(folder: str) -> list[str]:
    names = _shards(folder)
    idx = sorted(int(_SHARD.match(n).group(1)) for n in names)
    if not idx:
        raise FormatError(f"{folder}: no consolidated.NN.pth files")
    missing = sorted(set(range(idx[-1] + 1)) - set(idx))
    if missing:
        raise FormatError(
            f"{folder}: consolidated.{idx[-1]:02d}.pth exists but "
            f"{', '.join(f'consolidated.{i:02d}.pth' for i in missing)} is missing"
        )
    return [os.path.join(folder, f"consolidated.{i:02d}.pth") for i in idx]


def _load_states(folder: str) -> tuple[list[str], list[dict[str, LazyTensor]]]:
    """The weight files and their flat state dicts: `consolidated.NN.pth` (one per rank) or
    Mistral's single `consolidated.safetensors`."""
    st_file = os.path.join(folder, SAFETENSORS)
    if os.path.isfile(st_file):
        if _shards(folder):  # mistral-inference's from_folder asserts the same
            raise FormatError(
                f"{folder}: holds both {SAFETENSORS} and consolidated.NN.pth; which is the model?"
            )
        return [st_file], [dict(read_header(st_file).tensors)]
    files = _files(folder)
    states = []
    for f in files:
        st = torch_save.load(f)
        if not isinstance(st, dict) or not all(isinstance(v, LazyTensor) for v in st.values()):
            raise FormatError(f"{f}: expected a flat dict of tensors")
        states.append(st)
    return files, states


def is_mistral_params(params: dict) -> bool:
    """A Mistral `TransformerArgs` params.json (it requires `hidden_dim` and `head_dim`)."""
    return "hidden_dim" in params and "head_dim" in params


def _sliding_window(params: dict, source: str):
    w = params.get("sliding_window", params.get("_sliding_window"))
    if isinstance(w, list):  # per-layer windows (mistral-inference args.py allows a list)
        if not w or len(set(w)) != 1:
            raise UnknownModelError(
                f"{source}: sliding_window {w} differs between layers; no family implements "
                f"per-layer windows"
            )
        w = w[0]
    if isinstance(w, str):  # "This may sometimes be a string in `params.json`" (convert_config)
        try:
            w = int(w)
        except ValueError:
            raise ConfigError(f"{source}: sliding_window {w!r} is not an integer") from None
    return w


def mistral_config(params: dict, source: str):
    """The MistralConfig of a Mistral params.json: the HF dict transformers' `convert_config`
    writes, read by `models.config_from_hf` (see the module docstring)."""
    from hybridckpt import models

    if params.get("vision_encoder"):
        raise UnknownModelError(
            f"{source}: 'vision_encoder': a vision encoder (Pixtral) is not implemented by any family"
        )
    moe = _moe_keys(params.get("moe"), source)
    missing = [k for k in ("dim", "n_layers", "n_heads", "norm_eps", "vocab_size") if k not in params]
    if missing:
        raise ConfigError(f"{source}: a Mistral params.json needs {missing}")
    window = _sliding_window(params, source)
    theta = params.get("rope_theta")
    if theta is None:
        theta = 1e6 if window is None else 1e4
    hf = {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_size": params["dim"],
        "num_hidden_layers": params["n_layers"],
        "intermediate_size": params["hidden_dim"],
        "num_attention_heads": params["n_heads"],
        "num_key_value_heads": params.get("n_kv_heads") or params["n_heads"],
        "head_dim": params["head_dim"],
        "rms_norm_eps": params["norm_eps"],
        "vocab_size": params["vocab_size"],
        "rope_theta": theta,
        "sliding_window": window,
        "max_position_embeddings": params.get("max_seq_len", 32768),
        "tie_word_embeddings": False,
    }
    if moe:
        hf |= {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **moe}
    return models.config_from_hf(hf, source=source)


_MOE_ARGS = ("num_experts", "num_experts_per_tok")  # mistral_inference/moe.py MoeArgs


def _moe_keys(moe, source: str) -> dict:
    """The HF MixtralConfig keys of params.json's `moe` ({} without one)."""
    if not moe:
        return {}
    if not isinstance(moe, dict) or set(moe) != set(_MOE_ARGS):
        found = sorted(moe) if isinstance(moe, dict) else moe
        raise UnknownModelError(
            f"{source}: 'moe' {found!r}: only Mixtral's MoeArgs {list(_MOE_ARGS)} are implemented"
        )
    return {"num_local_experts": moe["num_experts"], "num_experts_per_tok": moe["num_experts_per_tok"]}


def _vocab_parallel(emb: LazyTensor, dim: int, mp: int, file: str) -> bool:
    """Whether tok_embeddings is split on the vocab dim (Llama 3) or on dim (Llama 1/2)."""
    if emb.ndim != 2:
        raise FormatError(f"{file}: tok_embeddings.weight has shape {emb.shape}, expected 2-D")
    if mp == 1 or emb.shape[1] == dim:
        return True
    if emb.shape[1] * mp == dim:
        return False
    raise FormatError(
        f"{file}: tok_embeddings.weight shard {emb.shape} fits neither [vocab/{mp}, {dim}] "
        f"(Llama 3) nor [vocab, {dim}/{mp}] (Llama 1/2) for params.json dim={dim}"
    )


def _dedup_kv(name: str, shards: list[LazyTensor], rows: int, files: list[str]) -> list[LazyTensor]:
    """Keep one rank per group of ranks that replicate the same kv heads."""
    total = sum(s.shape[0] for s in shards)
    if total == rows:
        return shards
    if total % rows or len(shards) % (total // rows):
        raise FormatError(
            f"{files[0]}: {name} shards hold {total} rows in all, expected {rows} (n_kv_heads * head_dim) "
            f"or a multiple from replicated kv heads"
        )
    rep = total // rows
    return shards[::rep]


def open(path: str, *, config=None) -> SourceCheckpoint:  # noqa: A001 - the format contract
    """Plan the import of a Meta Llama or Mistral folder (reads params.json and the pickles or
    the safetensors header only)."""
    from hybridckpt import models

    params_path = os.path.join(path, PARAMS)
    params = read_params(params_path)
    files, states = _load_states(path)
    mp = len(files)
    names = list(states[0])
    for f, st in zip(files[1:], states[1:], strict=True):
        if set(st) != set(names):
            diff = sorted(set(st) ^ set(names))[:5]
            raise FormatError(f"{f}: holds different keys than {files[0]} (e.g. {diff})")
    dim = params.get("dim")
    if not isinstance(dim, int):
        raise FormatError(f"{params_path}: 'dim' should be an int, found {dim!r}")
    if "tok_embeddings.weight" not in states[0]:
        raise FormatError(f"{files[0]}: no tok_embeddings.weight")
    emb0 = states[0]["tok_embeddings.weight"]
    vocab_parallel = _vocab_parallel(emb0, dim, mp, files[0])
    vocab = emb0.shape[0] * (mp if vocab_parallel else 1)
    file_vocab = params.get("vocab_size", -1)
    given = getattr(config, "vocab_size", None)
    if isinstance(file_vocab, int) and file_vocab > 0 and file_vocab != vocab:
        raise FormatError(
            f"{params_path}: vocab_size {file_vocab} but tok_embeddings holds {vocab} rows"
        )
    if given is not None and given != vocab:
        raise ConfigError(
            f"{path}: the given config has vocab_size {given} but tok_embeddings holds {vocab} rows"
        )
    if is_mistral_params(params):
        cfg = mistral_config(params, params_path)
    else:
        cfg = models.config_from_meta_params(
            params, vocab if file_vocab in (None, -1) else None, source=params_path
        )

    model_vars = models.rule_variables(cfg)
    variables = {
        "vocab_parallel": vocab_parallel,
        "num_heads": model_vars["num_heads"],
        "num_kv_heads": model_vars["num_kv_heads"],
        "moe": bool(params.get("moe")),
    }
    rules = load_rules(_RULES, variables)
    kv_rows = model_vars["num_kv_heads"] * model_vars["head_dim"]
    tensors: dict[str, LazyTensor] = {}
    notes = []
    for n in names:
        if n in _SKIPPED:
            notes.append(f"skipped {n} (a RoPE buffer, not a weight)")
            continue
        shards = [st[n] for st in states]
        for f, s in zip(files[1:], shards[1:], strict=True):
            if s.shape != shards[0].shape:
                raise FormatError(
                    f"{f}: key {n!r} has shape {s.shape}, expected {shards[0].shape} as in {files[0]}"
                )
            if np.dtype(s.dtype) != np.dtype(shards[0].dtype):
                raise FormatError(
                    f"{f}: key {n!r} is {s.dtype}, expected {shards[0].dtype} as in {files[0]}"
                )
        if _KV.match(n) and mp > 1:
            deduped = _dedup_kv(n, shards, kv_rows, files)
            if len(deduped) != len(shards):
                notes.append(
                    f"wk/wv: kv heads replicated on {len(shards) // len(deduped)} ranks each; one of each read"
                )
            shards = deduped
        tensors[n] = rules.merge_tp(n, shards)
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=tensors,
        optimizer=None,
        hf_rules=rules_text(_RULES),
        rule_vars=variables,
        config=cfg,
        step=None,
        topology={"tp": mp},
        trainer={},
        notes=tuple(dict.fromkeys(notes)),
    )

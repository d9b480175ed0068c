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
- Shards merge by the `tp` rules of `rules/meta_tp.rules`. `tok_embeddings` is split on dim 1
  in Llama 1/2 (ParallelEmbedding) and on dim 0 in Llama 3 (VocabParallelEmbedding): decided by
  comparing rank 0's shard shape with `dim`. When n_kv_heads < mp (Llama 3.1 405B), each kv
  head is replicated on mp / n_kv_heads consecutive ranks: one rank of each group is read.
- q/k rows are interleaved RoPE pairs per head; the family's `hf_rules` permute them to HF's
  half-split.

Mistral's native layout (mistralai/mistral-inference:src/mistral_inference/transformer.py
`Transformer.from_folder`): `params.json` plus `consolidated.safetensors`, or a single
`consolidated.00.pth`, never both; transformer_layers.py: the same module names as Meta's, q/k
rotated as interleaved pairs by rope.py `apply_rotary_emb`. mistral-inference splits no tensor
across ranks; Mixtral's experts in several `consolidated.NN.pth` are refused by the missing `tp`
rule.

Which family a `params.json` describes, its model config, and the names -> HF names are the
families' (`models/<family>/dialects/meta.py` and `meta.rules`, through the registry): each
matcher's `PARAMS` are keys the params.json must give (a value other than null, false, 0 or
empty), the family giving the most of them wins (Llama: none; Mistral: `hidden_dim`,
`head_dim`; Mixtral: those and `moe`), and its `config(params, vocab_size, source)` builds the
config. The model-parallel merges (`rules/meta_tp.rules`, fairscale's layout) are this format's.
"""

from __future__ import annotations

import os
import re

import numpy as np

from hybridckpt import models
from hybridckpt.containers.safetensors_file import read_header
from hybridckpt.errors import ConfigError, FormatError
from hybridckpt.formats.rules_files import load_rules
from hybridckpt.io.config_file import read_json
from hybridckpt.lazy import LazyTensor
from hybridckpt.models.dialect import most_specific
from hybridckpt.source_checkpoint import SourceCheckpoint

NAME = "meta-llama"
PARAMS = "params.json"
_SHARD = re.compile(r"^consolidated\.(\d{2})\.pth$")
SAFETENSORS = "consolidated.safetensors"  # Mistral's native layout
_TP_RULES = "meta_tp.rules"
DIALECT = "meta"  # models/<family>/dialects/meta.{py,rules}
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
    # (imported on a read: detection imports this module for every source)
    from hybridckpt.containers.pickle import torch_save

    files = _files(folder)
    states = []
    for f in files:
        st = torch_save.load(f)
        if not isinstance(st, dict) or not all(isinstance(v, LazyTensor) for v in st.values()):
            raise FormatError(f"{f}: expected a flat dict of tensors")
        states.append(st)
    return files, states


def dialect(params: dict, source: str) -> models.Dialect:
    """The meta dialect of the family `params` describe (module docstring); a FormatError when
    no family's, or several alike, fit."""
    known = models.dialects(DIALECT)
    fits = {
        f: len(marks) if all(params.get(k) for k in marks) else None
        for f, d in known.items()
        for marks in [tuple(d.get("PARAMS", ()))]
    }
    best = most_specific(fits)
    if len(best) != 1:
        keys = sorted(params)[:12]
        what = f"the families {best} alike" if best else f"no family; read: {sorted(known)}"
        raise FormatError(f"{source}: params.json keys {keys} fit {what}")
    return known[best[0]]


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
    fam = dialect(params, params_path)
    cfg = fam.get("config")(params, vocab if file_vocab in (None, -1) else None, params_path)

    model_vars = models.rule_variables(cfg)
    variables = {
        "vocab_parallel": vocab_parallel,
        "num_heads": model_vars["num_heads"],
        "num_kv_heads": model_vars["num_kv_heads"],
    }
    rules = load_rules(_TP_RULES, variables)
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
        hf_rules=fam.rules_text(),
        rule_vars=variables,
        config=cfg,
        step=None,
        topology={"tp": mp},
        trainer={},
        notes=tuple(dict.fromkeys(notes)),
    )

"""PaddleFormers 1.x unified checkpoints, and how they differ from PaddleNLP's.

Both write the same files (`unified.py`: `model-*.safetensors` + `model.safetensors.index.json`,
`optimizer-*` with keys `<name>/moment1_0`, `/moment2_0`, `/beta1_pow_acc_0`, `/beta2_pow_acc_0`,
`master_weights-*` in 16-bit runs, `config.json`). PaddleFormers (the successor of PaddleNLP;
`save_checkpoint_format="unified_checkpoint"`) differs in names and layouts
(PaddlePaddle/PaddleFormers: paddleformers/trainer/unified_checkpoint/load_save_single_card.py
`save_single_card_checkpoint` / `save_single_card_optimizer`, unified_checkpoint.py; checked on
real saves of paddleformers 1.2.0, /work/shared/formats/paddle.md):
- names are HF's (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`);
- the MODEL state dict goes through `ConversionMixin.convert_transpose_selected_weights(state_dict,
  model.transpose_weight_keys)` before `safe_save_file`: the Linear weights the model lists
  there (Llama, Qwen2/3, Mistral: q/k/v/o_proj, gate/up/down_proj), Paddle `[in, out]`, are
  written as HF `[out, in]`; embeddings, norms, biases and the output head as they are: the head
  is `paddleformers.nn.lm_head.LMHead`, whose weight is `[vocab, hidden]` in Paddle already
  (HF's layout; its TP split is axis 0), not an `nn.Linear`;
- the OPTIMIZER state (`optimizer.state_dict()`, renamed `<param.name>_<acc>_0` ->
  `<name>/<acc>_0`) and the master weights (its `master_weights`, plus the fp32 params of a
  16-bit run) are NOT transposed: moments and masters of a transposed Linear weight stay
  Paddle's `[in, out]`, the transpose of the saved weight; the head's are `[vocab, hidden]`.

So what a 2-D tensor's optimizer state looks like is decided by the weight it belongs to: a
transposed Linear weight (every 2-D param but an embedding and the head, `SAME_LAYOUT_SUFFIXES`)
has its moments and master transposed (`in_paddle_layout`). `state_to_hf` turns such state to HF
`[out, in]` on import and `state_to_paddle` back on export, each checking the shape against the
weight's. (Checked against the files PaddleFormers 1.2's Trainer writes: tests/real/cases/
paddleformers_*.)

Two things both trainers do (unified_checkpoint/utils.py, load_save_single_card.py):
- the optimizer keys are renamed through `{param.name: structured name}` built over the model's
  state dict, which lists a tied embedding under both of its names: the state of a tied
  embedding can come out under `lm_head.weight` (`retied` puts it back under the embedding's
  name);
- with `unified_checkpoint_config` "skip_save_model_weight" no model files are written and the
  master weights are loaded as the model weights (`select_model_weight_index`): the params are
  then the masters (`weights_from_masters`: Linear ones transposed to HF `[out, in]` under HF
  names).

`flavour` tells the two apart: PaddleNLP's names carry the family's `base_model_prefix`
(`llama.`, `qwen2.`, `mistral.`); Qwen3's is `model`, like HF's, so then the layouts decide: a
non-square Linear weight stored `[in, out]` (its shape equal to its moment's, or the transpose
of the config's HF shape for `mlp.gate_proj`) is PaddleNLP's.
"""

from __future__ import annotations

from collections.abc import Mapping

from hybridckpt import lazy
from hybridckpt.errors import FormatError, MappingError
from hybridckpt.formats.paddle.rules import families
from hybridckpt.lazy import LazyTensor

PADDLENLP = "paddlenlp"
PADDLEFORMERS = "paddleformers"
FLAVOURS = (PADDLENLP, PADDLEFORMERS)
# 2-D params not in a model's `transpose_weight_keys`: stored alike by the model and the
# optimizer. The embedding is `[vocab, hidden]`; so is the head (an LMHead, not an nn.Linear).
SAME_LAYOUT_SUFFIXES = ("embed_tokens.weight", "lm_head.weight")


def in_paddle_layout(name: str, weight_shape: tuple[int, ...]) -> bool:
    """Whether PaddleFormers keeps the optimizer state of param `name` (`weight_shape`, as saved
    in the model files) in Paddle's `[in, out]`, the transpose of the saved weight."""
    return len(weight_shape) == 2 and not name.endswith(SAME_LAYOUT_SUFFIXES)


def state_to_hf(
    weights: Mapping[str, LazyTensor], state: Mapping[str, LazyTensor], where: str
) -> dict[str, LazyTensor]:
    """PaddleFormers optimizer state (moments or master weights) by HF name, in the weights'
    layout: Linear weights' state transposed from `[in, out]`; a shape that is neither is a
    FormatError naming `where`, the key, expected and found."""
    out = {}
    for name, t in state.items():
        w = weights.get(name)
        shape = tuple(w.shape) if w is not None else None
        if shape is not None and in_paddle_layout(name, shape):
            want = shape[::-1]
            if tuple(t.shape) != want:
                raise FormatError(
                    f"{where}: {name!r} has shape {tuple(t.shape)}; PaddleFormers keeps the state "
                    f"of a Linear weight in Paddle's [in, out] layout, expected {want} (the weight "
                    f"is {shape})"
                )
            t = lazy.transpose(t, (1, 0))
        elif shape is not None and tuple(t.shape) != shape:
            raise FormatError(f"{where}: {name!r} has shape {tuple(t.shape)}, expected {shape}")
        out[name] = t
    return out


def state_to_paddle(
    weights: Mapping[str, LazyTensor], state: Mapping[str, LazyTensor], what: str
) -> dict[str, LazyTensor]:
    """The inverse of `state_to_hf`, for the writer: HF-layout state of the params `weights`
    (HF names) as PaddleFormers stores it."""
    missing = sorted(set(weights) - set(state))
    if missing:
        raise MappingError(f"write_unified: no {what} for {missing[:10]}")
    out = {}
    for name, w in weights.items():
        t = state[name]
        if tuple(t.shape) != tuple(w.shape):
            raise MappingError(
                f"write_unified: {what} of {name!r} has shape {tuple(t.shape)}, the param {tuple(w.shape)}"
            )
        out[name] = lazy.transpose(t, (1, 0)) if in_paddle_layout(name, tuple(w.shape)) else t
    return out


def _nlp_prefixes() -> tuple[str, ...]:
    return tuple(f"{f.prefix}." for f in families().values() if f.prefix != "model")


def has_paddlenlp_names(names) -> bool:
    """Some name carries a PaddleNLP `base_model_prefix` other than HF's `model`."""
    prefixes = _nlp_prefixes()
    return any(n.startswith(prefixes) for n in names)


def flavour(model: Mapping[str, LazyTensor], moments: Mapping[str, LazyTensor], cfg=None) -> str:
    """PADDLENLP or PADDLEFORMERS for a unified checkpoint with these model tensors, first
    moments (name -> tensor, as stored) and model config (see the module docstring)."""
    if has_paddlenlp_names(model):
        return PADDLENLP
    for name, m in moments.items():
        w = model.get(name)
        if w is None or not in_paddle_layout(name, tuple(w.shape)) or w.shape[0] == w.shape[1]:
            continue
        return PADDLENLP if tuple(m.shape) == tuple(w.shape) else PADDLEFORMERS
    inter, hidden = getattr(cfg, "intermediate_size", None), getattr(cfg, "hidden_size", None)
    gate = next((t for n, t in model.items() if n.endswith(".mlp.gate_proj.weight")), None)
    if gate is not None and inter and hidden and inter != hidden:
        return PADDLENLP if tuple(gate.shape) == (hidden, inter) else PADDLEFORMERS
    return PADDLEFORMERS


def retied(
    opt: Mapping[str, LazyTensor],
    master: Mapping[str, LazyTensor],
    embedding: str,
    head: str = "lm_head.weight",
) -> tuple[dict[str, LazyTensor], dict[str, LazyTensor]]:
    """A tied model's optimizer state (`<name>/<acc>_0` keys) and master weights with the
    embedding's state moved from `head` (the last structured name of the shared parameter) to
    `embedding`, where only `head` holds it."""
    names = {k.rpartition("/")[0] for k in opt}
    if head in names and embedding not in names:
        opt = {
            (embedding + k[len(head) :] if k.startswith(head + "/") else k): t
            for k, t in opt.items()
        }
    master = dict(master)
    if head in master and embedding not in master:
        master[embedding] = master.pop(head)
    return dict(opt), master


def weights_from_masters(masters: Mapping[str, LazyTensor]) -> dict[str, LazyTensor]:
    """PaddleFormers params of a save without model files: the fp32 masters (HF names, Linear
    ones `[in, out]`) in HF layout."""
    return {
        k: lazy.transpose(t, (1, 0)) if in_paddle_layout(k, tuple(t.shape)) else t
        for k, t in masters.items()
    }

"""The mapping language: declarative, invertible rules for every name and layout change.

A rules text has one statement per line; `#` starts a comment. `{var}` is replaced by a variable
(from the model config or the source's topology) before parsing.

Rename/layout rules, applied to a dict of global tensors::

    SOURCE[, SOURCE...] -> TARGET[, TARGET...] [: op, op, ...] [when [not] VAR]
    SOURCE -> _                                    # delete: consumed, not carried over

Patterns: `$X` captures a decimal number (a layer index); `*` captures any text. The captures of
the first source fill the other sources and the targets. A target may end with `[$X]`: the
matched tensors are stacked on a new leading axis in the order of `$X`, which must run 0..n-1.
Several indices stack on several leading axes in the order written: `experts.w[$L, $E]` is
`[layers, experts, ...]` (mixture-of-experts weights, one source key per layer and expert). An
index may be restricted to a list, `[$L in {moe_layers}]` with the variable expanding to
`1,3,5`: the tensor of layer 3 goes to position 1, and a layer not in the list does not match
the rule (so the dense and the MoE layers of one model stack into separate groups). Stacking is
lazy: each part stays its own view, read only for the boxes a device asks for. Inverted rules
have stacked sources: a stacked tensor is taken apart on its leading axes (`apply_unstack`) and
position i of a list index gives back the list's i-th value (`hybridckpt.rules.stacking`).

Ops, in order from source to target; each has an exact inverse, so an export is derived by
`RuleSet.invert()` and never written twice:

    transpose | transpose(p0, p1, ...)   axes permutation            <-> its inverse permutation
    unflatten(axis, s0, s1, ...)         split one axis (one -1 ok)  <-> flatten(axis, s0, s1, ...)
    split(axis, n) | split(axis, s0, s1, ...)   one -> many          <-> concat(axis, ...)
    split(axis)                          as the last op: one equal part per target
    fused_qkv(axis, heads, kv_heads)     one -> q, k, v; per kv group `[heads/kv_heads q | k | v]`
                                         head blocks along `axis`     <-> unfused_qkv(...)
    gated_qkv(axis, heads, kv_heads)     one -> q_proj, k, v; per kv group `[q heads | gate heads | k
                                         | v]` to HF's gated q_proj (per head `[q_h; gate_h]`)
                                                                      <-> ungated_qkv(...)
    interleave(axis, groups, s0, s1, ..) many -> one; `groups` blocks of `s_i` rows of each source,
                                         block by block (per key head) <-> deinterleave(...)
    shift(c)                             plus the int c (a zero-centred norm weight)  <-> shift(-c);
                                         an optimizer moment is not shifted
    rope_permute(heads)                  rows of `[heads*head_dim, ...]` from interleaved (Meta)
                                         pairs to half-split (HF)     <-> rope_unpermute(heads)
    trim(axis, size[, padded])           keep the first `size` (vocab padding) <-> pad with zeros
                                         to `padded` (an error without `padded`)
    cast(dtype[, from_dtype])            another dtype               <-> cast(from_dtype) or none

Tensor-parallel merge rules, used by per-rank formats to join the shards of one tensor::

    tp PATTERN : concat(axis) | halves(axis) | replicated [when [not] VAR]

`halves(axis)`: every shard holds `[first_r | second_r]` (SwiGLU fc1, fused gate_up): the result
is `[first_0 .. first_n | second_0 .. second_n]`. `replicated`: every shard holds the whole
tensor; shard 0 is used. The first matching `tp` rule wins.

Modules (each imports only those above it):
- `group_ops` the ops that regroup rows by heads (`interleave`, `gated_qkv`) and `shift`.
- `ops`       `Op` and the op implementations and inverses (`OPS`); `rope_permutation`.
- `tp`        `merge_tp`: the `concat | halves | replicated` merges of per-rank shards.
- `stacking`  stack indices `[$L, $E]` / `[$L in 1,3]`: positions, captures, `assemble`.
- `ruleset`   `Rule`, `TpRule`, `MappingResult`, `RuleSet` (`apply`, `invert`, `apply_unstack`).
- `parse`     `parse_rules` (a text) and `load_rules` (a file).
"""

from hybridckpt.rules.ops import OPS, Op, rope_permutation
from hybridckpt.rules.parse import load_rules, parse_rules
from hybridckpt.rules.ruleset import MappingResult, Rule, RuleSet, TpRule
from hybridckpt.rules.tp import merge_tp

__all__ = [
    "OPS",
    "MappingResult",
    "Op",
    "Rule",
    "RuleSet",
    "TpRule",
    "load_rules",
    "merge_tp",
    "parse_rules",
    "rope_permutation",
]

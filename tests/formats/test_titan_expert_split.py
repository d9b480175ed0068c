"""Opening a torchtitan DeepSeek V3 DCP source of many experts: the grouped experts split a group
at a time, and no cyclic-GC passes while it opens and `inspect` summarises (counted, not timed).

The source is a tiny DeepSeek V3 in torchtitan 0.3's keys (`benchmarks/scale_sources_moe.py`:
torch's own `Metadata` objects pickled by torch, 8 ranks, EP 4 x expert-FSDP 2, 8 experts, AdamW
moments and the flattened param groups), the layout of the 64-512-rank scale rows (docs/scale.md).

- `split_experts` (`RuleSet.apply_unstack` of `rules/torchtitan_moe_experts.rules`) gives the
  same names, order and views as `RuleSet.apply` on the expanded names `base[e]` (the general
  path), while building each view without its per-view box check (`lazy.index0_all`) and
  matching each grouped tensor's base once per rule, not each expanded name (on the 64-rank
  source: 133,632 views, 284k name matches before);
- the same for rule sets with a list index, a deleting rule, a rule that matches nothing, a key
  no rule takes, and the same error for a target made twice; a name holding `[` goes the general
  way;
- `dcp.open` and `jobs.inspect` run no collection of the cyclic GC (half the expert split's and
  the summary's CPU on the 64-rank source was those passes).
"""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import replace

import numpy as np
import pytest

from hybridckpt import jobs, lazy
from hybridckpt.errors import MappingError
from hybridckpt.formats import dcp
from hybridckpt.formats.dcp import torchtitan
from hybridckpt.formats.rules_files import load_rules
from hybridckpt.rules import parse_rules
from hybridckpt.rules.ruleset import _compile
from hybridckpt.rules.stacking import parse_stack, unstack, unstacked_name

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import scale_sources_moe  # noqa: E402

TINY = dict(scale_sources_moe.DSV3_671B, dim=16, dense_hidden_dim=24, moe_hidden_dim=8, n_layers=3,
            n_dense_layers=1, n_heads=2, num_experts=8, vocab_size=10, q_lora_rank=8, kv_lora_rank=4,
            qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)
EXPERTS, MOE_LAYERS, SLOTS = 8, 2, 3  # params, exp_avg, exp_avg_sq


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dsv3") / "ckpt")
    scale_sources_moe.write_fast(root, 8, 4, log=lambda s: None, config=TINY)
    return root


def _describe(t):
    """A view chain as plain data: each level's type and fields, down to the stored tensor's id."""
    out = []
    while isinstance(t, lazy.Reshape | lazy.Slice):
        out.append((type(t).__name__, t.shape, getattr(t, "region", None)))
        t = t.src
    return out, id(t)


def _expanded(rules, tensors) -> dict:
    """What `apply_unstack` hands `apply` the general way: each tensor a stacked source's base
    matches taken apart into `base[i]` views (`rules.stacking.unstack`), the others as they are."""
    bases = [(_compile(spec.base), len(spec.indices)) for r in rules.rules for s in r.sources
             if (spec := parse_stack(s)).stacked]
    out = {}
    for name, t in tensors.items():
        depth = next((d for rx, d in bases if rx.match(name)), 0)
        if depth:
            out.update((unstacked_name(name, pos), part) for pos, part in unstack(t, depth).items())
        else:
            out[name] = t
    return out


def _general(rules, tensors):
    return rules.apply(_expanded(rules, tensors), strict=False)


def _same(a, b):
    assert list(a.tensors) == list(b.tensors)  # names and order
    assert [_describe(t) for t in a.tensors.values()] == [_describe(t) for t in b.tensors.values()]
    assert a.unconsumed == b.unconsumed
    assert a.unused == b.unused


def test_expert_split_counts_no_view_checks_and_one_base_match_per_rule(source, monkeypatch):
    from hybridckpt.lazy import views
    from hybridckpt.rules import ruleset

    checks, splits, matches = [], [], []
    real_check, real_split, real_compile = views.check_box, ruleset.split_unstacked, ruleset._compile
    monkeypatch.setattr(views, "check_box", lambda *a: checks.append(1) or real_check(*a))
    monkeypatch.setattr(ruleset, "split_unstacked", lambda n: splits.append(n) or real_split(n))

    class Counted:
        def __init__(self, rx):
            self.rx = rx

        def match(self, name):
            if "[" in name:  # an expanded name (the grouped tensors' names hold none)
                matches.append(name)
            return self.rx.match(name)

    monkeypatch.setattr(ruleset, "_compile", lambda p: Counted(real_compile(p)))
    captured = {}
    real_moe = torchtitan.moe_tensors

    def moe(tensors, slots, cfg, what):
        captured["in"] = (dict(tensors), {s: dict(t) for s, t in slots.items()})
        checks.clear(), splits.clear(), matches.clear()
        out = real_moe(tensors, slots, cfg, what)
        captured["counts"] = (len(checks), len(splits), len(matches))
        return out

    monkeypatch.setattr(torchtitan, "moe_tensors", moe)
    src = dcp.open(source)
    views_made = EXPERTS * 3 * MOE_LAYERS * SLOTS  # w1, w2, w3 of each MoE layer, params and moments
    split = sum(".moe.experts." in n for tree in (src.tensors, *src.optimizer.slots.values()) for n in tree)
    assert split == views_made
    n_checks, n_splits, n_matches = captured["counts"]
    assert n_checks == 0  # before: one box check a view (views_made)
    assert n_splits == 0  # before: each expanded name split once per stacked rule it meets
    assert n_matches == 0  # expanded names `base[e]` matched against the rules (>= views_made before)
    tensors, slots = captured["in"]
    rules = load_rules("torchtitan_moe_experts.rules")
    monkeypatch.setattr(ruleset, "_compile", real_compile)
    monkeypatch.setattr(ruleset, "split_unstacked", real_split)
    monkeypatch.setattr(views, "check_box", real_check)
    for tree in (tensors, *slots.values()):  # the same result as the general path, view for view
        _same(rules.apply_unstack(tree, strict=False), _general(rules, tree))


def test_renames_a_group_at_a_time_equal_the_general_path():
    t = lazy.ArrayTensor(np.arange(4 * 3 * 2).reshape(4, 3, 2))
    tensors = {"a.0.w": t, "a.1.w": t, "b.w": t, "keep": t, "gone": t, "c.5.w": lazy.ArrayTensor(np.zeros((2, 2, 2)))}
    rules = parse_rules(
        "a.$L.w[$E in 1,3] -> x.$L.$E.odd\n"
        "a.$L.w[$E] -> x.$L.$E.all\n"
        "c.$L.w[$E, $F] -> y.$L.$E.$F\n"
        "b.w[$E] -> _\n"
        "gone -> _\n"
        "never.$L[$E] -> z.$L.$E\n"
    )
    got, want = rules.apply_unstack(tensors, strict=False), _general(rules, tensors)
    _same(got, want)
    assert list(got.tensors)[:4] == ["x.0.1.odd", "x.0.3.odd", "x.1.1.odd", "x.1.3.odd"]
    assert got.unconsumed == ("keep",) and [r.line for r in got.unused] == [6]
    with pytest.raises(MappingError) as e1:
        rules.apply_unstack(tensors)
    with pytest.raises(MappingError) as e2:
        rules.apply(_expanded(rules, tensors))
    assert str(e1.value) == str(e2.value)
    twice = parse_rules("a.$L.w[$E] -> x.$E\n")  # both layers make x.0 .. x.3
    with pytest.raises(MappingError) as e1:
        twice.apply_unstack({"a.0.w": t, "a.1.w": t}, strict=False)
    with pytest.raises(MappingError) as e2:
        twice.apply(_expanded(twice, {"a.0.w": t, "a.1.w": t}), strict=False)
    assert str(e1.value) == str(e2.value) and "produced twice" in str(e1.value)
    odd = {"a.0.w": t, "a.0.w[1]": t}  # a name holding `[`: the general path, as before
    _same(rules.apply_unstack(odd, strict=False), _general(rules, odd))


def test_open_and_inspect_run_no_cyclic_gc_pass(source, monkeypatch):
    """No collection while the metadata is parsed, the experts are split and `inspect` makes its
    rows (one may run once the collector is back on, and before)."""
    from hybridckpt.formats.dcp import reader

    summary = sys.modules["hybridckpt.jobs.inspect"]  # (`jobs.inspect` is the function)
    inside, passes = [], []

    def during(fn):
        def run(*a, **k):
            inside.append(fn.__name__)
            try:
                return fn(*a, **k)
            finally:
                inside.remove(fn.__name__)
        return run

    for mod, name in ((reader, "read_metadata"), (torchtitan, "moe_tensors"), (summary, "_tensors")):
        monkeypatch.setattr(mod, name, during(getattr(mod, name)))

    def count(phase, info):
        if phase == "start" and inside:
            passes.append(tuple(inside))

    threshold = gc.get_threshold()
    gc.callbacks.append(count)
    gc.set_threshold(50, 2, 2)  # (a pass every 50 new objects, were the collector on)
    try:
        src = dcp.open(source)
        info = jobs.inspect(source)
        assert gc.isenabled()  # on again after
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(count)
    assert passes == []  # before: a pass every 50 of the ~10^3 rows, views and summary rows made
    assert len(info["tensors"]) == len(src.tensors) > EXPERTS * 3 * MOE_LAYERS


def test_inspect_summary_imports_nothing_a_view(source, monkeypatch):
    """`inspect`'s piece count (`_pieces`, called for every view and down each view's chain)
    imports nothing per call (before: one `from hybridckpt import lazy` a call, 134k on the
    64-rank DeepSeek V3 source)."""
    import builtins

    summary = sys.modules["hybridckpt.jobs.inspect"]
    src = dcp.open(source)
    imports, real = [], builtins.__import__
    monkeypatch.setattr(builtins, "__import__",  # (numpy's dtype names import numpy's modules)
                        lambda *a, **k: (a[0].startswith("hybridckpt") and imports.append(a[0])) or real(*a, **k))
    rows = summary._tensors(src.tensors)
    monkeypatch.setattr(builtins, "__import__", real)
    assert imports == []
    assert len(rows) == len(src.tensors) > EXPERTS * 3 * MOE_LAYERS


def test_shape_check_asks_each_shape_tuple_once(source, monkeypatch):
    """`registry.check_shapes` checks each shape tuple once: the expert views of one grouped tensor
    share theirs (before: one `shape_problem` a tensor, 136k on the 64-rank source). A hostile
    shape is still refused, naming its tensor."""
    from hybridckpt.errors import FormatError
    from hybridckpt.formats import registry

    calls, real = [], registry.shape_problem
    monkeypatch.setattr(registry, "shape_problem", lambda s: calls.append(s) or real(s))
    src = registry.open_source(source, "dcp")
    trees = (src.tensors, *src.optimizer.slots.values(), src.optimizer.master)
    tensors = sum(len(t) for t in trees)
    grouped = 3 * MOE_LAYERS * SLOTS  # grouped tensors, each split into EXPERTS views of one shape tuple
    assert len(calls) <= tensors - (EXPERTS - 1) * grouped  # before: == tensors (one call a tensor)
    bad = dict(src.tensors)
    name = next(n for n in bad if ".moe.experts.1." in n)
    bad[name] = lazy.Reshape(bad[name].src, bad[name].shape)  # a new view of a checked tuple: skipped

    class Odd(lazy.ArrayTensor):
        @property
        def shape(self):
            return (True, 2)  # a bool dim equals 1 and hashes like it: refused all the same

    bad["hostile"] = Odd(np.zeros((1, 2)))
    with pytest.raises(FormatError, match="hostile"):
        registry.check_shapes(replace(src, tensors=bad))

"""torchtitan's flattened param groups: each distinct saved value is parsed once.

torchtitan 0.3 saves the optimizer flattened (`optimizer.param_groups.<fqn>.<key>`): 12 byte
items per param, 11.6k in a DeepSeek V3 671B run, where parsing each was a third of `inspect`
(docs/scale.md). The real torchtitan 0.3.0 Qwen3-MoE case holds 276 such items in 7 distinct
archives; the groups must come out exactly as parsing every item gives them.
"""

from __future__ import annotations

from collections import Counter

from cases import ckpt

from hybridckpt.containers.dcp_metadata import read_metadata
from hybridckpt.containers.pickle import torch_save
from hybridckpt.formats.dcp import storage, structure
from hybridckpt.io.byte_source import ByteSource

CASE = ("torchtitan_qwen3_moe", "step-3")
PRE = "optimizer.param_groups."


def test_flattened_param_groups_parse_each_distinct_item_once(monkeypatch):
    md = read_metadata(ckpt(*CASE))
    items = [f for f in md.bytes_items if f.startswith(PRE)]
    distinct = Counter(
        ByteSource(md.bytes_items[f].path).read(md.bytes_items[f].offset, md.bytes_items[f].length)
        for f in items
    )
    assert len(items) == 276 and len(distinct) == 7
    # the reference: every item parsed on its own, grouped by equal values, params in order
    each = {f: storage.load_item(md, f) for f in items}
    heads = {}
    for f, v in each.items():
        head, _, key = f[len(PRE):].rpartition(".")
        if key in structure._HYPER_KEYS:
            heads.setdefault(head, {})[key] = v

    parsed = []
    load = torch_save.load

    def counting(path, **kw):
        parsed.append(kw.get("base_offset"))
        return load(path, **kw)

    monkeypatch.setattr(torch_save, "load", counting)
    groups = structure.param_groups(md, "optimizer.")
    assert len(parsed) <= len(distinct)
    assert sorted(p for g in groups for p in g["params"]) == sorted(heads)
    for g in groups:
        for p in g["params"]:
            assert {k: v for k, v in g.items() if k != "params"} == heads[p]

"""Parameter tables: a family declares its params once, as rows; everything else is derived.

A family's `params.py` defines `TABLE = ParamTable(origin, dims, rows)`. A `Param` row says:

  path     where the param lives in the params tree: "layers.q.kernel" (nested dicts)
  shape    one dimension per entry: a symbol of the table's `dims(cfg)` ("E", "Q") or an int
  axes     the logical axis of each dim ("embed", "heads", None: replicated); `hybridckpt.mesh`
           maps them to mesh axes
  hf       the HF tensor name, with the captures of the rules language (`$L` a layer, `$E` an
           expert: `hybridckpt.rules`)
  op       the layout ops of the rules language from the HF tensor to the param, as a rule
           writes them after `:` ("transpose", "unflatten(1, 3, -1)"); "" for none
  when     "VAR" or "not VAR": the row exists only when the family's rule variable VAR
           (`Family.rule_variables`) is true (false); None: always
  stacked  the stack indices of the rule's target ("$L", "$L in {moe_layers}, $E"), one per
           leading dim stacked from several HF tensors; "" for a tensor taken whole
  init     how a fresh param starts: "normal" (std `models.common.INIT_STD`), "ones", "zeros"

A dimension made of equal groups (attention heads, experts) says so through the table's
`groups(cfg)`: dimension symbol -> `Groups(what, count)`, e.g. Llama's "Q" (heads * head_dim) is
`Groups("heads", num_heads)`, "KV" `Groups("kv_heads", num_kv_heads)`, an MoE's "X"
`Groups("experts", n)`. A mesh axis may split such a dimension only between groups
(`hybridckpt.mesh`: q_proj's `6 * 8` values on tp=4 are not cut into 1.5 heads a device). Every
dimension on a grouped logical axis (`GROUPED_AXES`: heads, kv_heads, experts) must name a
symbol the table's `groups` declares, whose size its count divides (checked by `specs`), so a
new table cannot leave its heads to be cut anywhere.

A `Drop(hf, when)` row names an HF tensor that is no param (a buffer, a tied head's copy): its
rule consumes it. `stack(prefix, rows, ...)` writes the rows of one layer (or one module) as
rows of a group stacked on a leading dim: under the group's path, with the group's stack index.

Derived from a table, with no JAX:
- the params of a config (`specs`): every row whose `when` holds, its shape resolved. A row with
  a dimension of size 0 is no param (a group with no layer: no dense layer, no MTP module); its
  rule stays and matches nothing (its index list is empty);
- the shape tree, the logical-axes tree and the groups tree (`shape_tree`, `axes_tree`,
  `groups_tree`);
- the rules text from HF names to the params tree (`rules_text`): line i is row i,
  `hf -> path[stacked] : op when VAR` or `hf -> _ when VAR`; the export direction is its inverse
  (`RuleSet.invert`), derived by the rules engine.
The Flax modules create every param from its row (`models.common.table_param`), and the plan
reads the shapes and axes from here (`hybridckpt.plan.for_model`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from hybridckpt.models.errors import ConfigError

Axes = tuple[str | None, ...]
INITS = ("normal", "ones", "zeros")
GROUPED_AXES = ("heads", "kv_heads", "experts")  # logical axes whose dims are made of groups
_WHEN = re.compile(r"^(not\s+)?([A-Za-z_]\w*)$")


@dataclass(frozen=True)
class Param:
    """One param of a family (fields in the module docstring)."""

    path: str
    shape: tuple[str | int, ...]
    axes: Axes
    hf: str
    op: str = ""
    when: str | None = None
    stacked: str = ""
    init: str = "normal"

    def line(self) -> str:
        """Its line of the rules text."""
        target = f"{self.path}[{self.stacked}]" if self.stacked else self.path
        text = f"{self.hf} -> {target}" + (f" : {self.op}" if self.op else "")
        return text + (f" when {self.when}" if self.when else "")


@dataclass(frozen=True)
class Drop:
    """An HF tensor that is no param (consumed by the rules, carried nowhere)."""

    hf: str
    when: str | None = None

    def line(self) -> str:
        return f"{self.hf} -> _" + (f" when {self.when}" if self.when else "")


Row = Param | Drop


class Groups(NamedTuple):
    """A dimension made of `count` equal groups named `what` ("heads", "kv_heads", "experts"):
    `count` heads of `size // count` values each, stored group-major."""

    what: str
    count: int


@dataclass(frozen=True)
class Spec:
    """A param of one config: its shape, logical axes (one per dim), init, and per dim the
    `Groups` it is made of (None: any split is whole values; () for a spec made by hand)."""

    shape: tuple[int, ...]
    axes: Axes
    init: str
    groups: tuple[Groups | None, ...] = ()


def stack(
    prefix: str, rows: Iterable[Row], *, dim: str = "L", axis: str | None = "layers",
    index: str = "$L",
) -> tuple[Row, ...]:
    """`rows` (paths, shapes and axes of one layer) stacked on a leading `[dim]` axis named
    `axis`: paths under `prefix`, the stack index `index` before the row's own. Drop rows are
    kept as they are."""
    out: list[Row] = []
    for r in rows:
        if isinstance(r, Param):
            stacked = ", ".join(s for s in (index, r.stacked) if s)
            r = replace(r, path=f"{prefix}.{r.path}", shape=(dim, *r.shape), axes=(axis, *r.axes), stacked=stacked)
        out.append(r)
    return tuple(out)


def under(prefix: str, rows: Iterable[Row]) -> tuple[Row, ...]:
    """`rows` with their paths under `prefix` (a group that is no stack: `moe.shared`)."""
    return tuple(replace(r, path=f"{prefix}.{r.path}") if isinstance(r, Param) else r for r in rows)


def nest(flat: Mapping[str, Any], error: type[Exception] = ConfigError, what: str = "param") -> dict:
    """`{"a.b": x}` -> `{"a": {"b": x}}`; a path that is also another's prefix raises `error`
    naming the `what` (the one nesting of dotted names: the tables' params, `naming`'s tensors)."""
    out: dict = {}
    for path, x in flat.items():
        node = out
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise error(f"{what} {path!r}: {p!r} is both a {what} and a prefix of another")
        if leaf in node:
            raise error(f"{what} {path!r} is both a {what} and a prefix of another")
        node[leaf] = x
    return out


@dataclass(frozen=True)
class ParamTable:
    """A family's params: `rows` (`Param` and `Drop`), `dims(cfg)` giving the size of each
    dimension symbol (None for one the config does not have, e.g. DeepSeek's `q_lora_rank`),
    `groups(cfg)` the `Groups` of the symbols made of heads or experts (module docstring),
    `origin` the module defining it (`__name__`), which error messages and rules name."""

    origin: str
    dims: Callable[[Any], Mapping[str, int | None]]
    rows: tuple[Row, ...] = field(default=())
    groups: Callable[[Any], Mapping[str, Groups]] = field(default=lambda cfg: {})  # none grouped
    # transformers' `named_parameters()` order of the HF model (its module definition order), as
    # HF names with every number `$` (`model.layers.$.self_attn.q_proj.weight`), where the rows'
    # order is not it; () derives it from the rows (`hf_order`); `hybridckpt.optim.param_order`
    # sorts a checkpoint's names by it
    named_parameters: tuple[str, ...] = ()
    # the params of `nn.LayerNorm` modules among those (same spelling), which the HF Trainer keeps
    # out of weight decay whatever their names (GPT-2's `transformer.h.$.ln_1.weight`)
    layernorms: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        where = self.source
        for i, r in enumerate(self.rows, 1):
            at = f"{where} row {i} ({getattr(r, 'path', r.hf)})"
            if r.when is not None and not _WHEN.match(r.when):
                raise ConfigError(f"{at}: when {r.when!r}; expected 'VAR' or 'not VAR'")
            if not isinstance(r, Param):
                continue
            if len(r.shape) != len(r.axes):
                raise ConfigError(f"{at}: {len(r.shape)} dims {r.shape} but axes {r.axes}")
            if r.init not in INITS:
                raise ConfigError(f"{at}: init {r.init!r}; expected one of {INITS}")
            if r.stacked and len(r.stacked.split("$")) - 1 > len(r.shape):
                raise ConfigError(f"{at}: stack [{r.stacked}] has more indices than dims {r.shape}")

    @property
    def source(self) -> str:
        """The defining module as a path: "models/llama/params.py" (".../__init__.py" for a
        package)."""
        name = self.origin.removeprefix("hybridckpt.").replace(".", "/")
        return f"{name}/__init__.py" if hasattr(sys.modules.get(self.origin), "__path__") else f"{name}.py"

    @property
    def rules_origin(self) -> str:
        """How rules errors and reports name the generated text ("models/llama/params.py
        table", then `:N`, N the row)."""
        return f"{self.source} table"

    def hf_order(self) -> tuple[str, ...]:
        """`named_parameters` when declared, else the rows' HF names in row order (every `$X`
        capture written `$`): the module-definition order of the HF model's params."""
        if self.named_parameters:
            return self.named_parameters
        out: list[str] = []
        for r in self.rows:
            name = re.sub(r"\$[A-Za-z_]\w*", "$", r.hf) if isinstance(r, Param) else None
            if name is not None and name not in out:
                out.append(name)
        return tuple(out)

    def rules_text(self) -> str:
        """The rules from HF names to the params tree: one line per row, in table order."""
        return "".join(r.line() + "\n" for r in self.rows)

    def specs(self, cfg: Any, variables: Mapping[str, Any]) -> dict[str, Spec]:
        """The params of `cfg` (flat paths, table order): rows whose `when` holds under the rule
        `variables`, without those with a dimension of size 0."""
        sizes, groups = self.dims(cfg), self.groups(cfg)
        out: dict[str, Spec] = {}
        for i, r in enumerate(self.rows, 1):
            if not isinstance(r, Param) or not self._holds(r, variables, i):
                continue
            shape = tuple(self._size(d, sizes, r, i) for d in r.shape)
            if 0 in shape:
                continue
            if r.path in out:
                raise ConfigError(f"{self.source} row {i}: param {r.path!r} is given twice")
            dim_groups = tuple(self._groups(d, n, a, groups, r, i) for d, n, a in zip(r.shape, shape, r.axes, strict=True))
            out[r.path] = Spec(shape, tuple(r.axes), r.init, dim_groups)
        return out

    def _groups(self, d: str | int, size: int, axis: str | None, groups: Mapping[str, Groups],
                r: Param, i: int) -> Groups | None:
        """The `Groups` of dimension `d` (size `size`, logical `axis`) of row `i`, or None."""
        g = groups.get(d) if isinstance(d, str) else None
        if g is None:
            if axis in GROUPED_AXES:
                raise ConfigError(f"{self.source} row {i} ({r.path}): dimension {d!r} on axis {axis!r} is "
                                  f"made of {axis} but the table's groups do not declare it")
            return None
        count = g.count
        if not isinstance(count, int) or isinstance(count, bool) or count < 1 or size % count:
            raise ConfigError(f"{self.source} row {i} ({r.path}): dimension {d!r} of size {size} is "
                              f"{count!r} {g.what}; expected a positive count dividing its size")
        return g

    def _holds(self, r: Row, variables: Mapping[str, Any], i: int) -> bool:
        if r.when is None:
            return True
        negate, var = _WHEN.match(r.when).groups()
        if var not in variables:
            raise ConfigError(
                f"{self.source} row {i}: when {r.when!r}: {var!r} is not a rule variable "
                f"(known: {sorted(variables)})"
            )
        return bool(variables[var]) != bool(negate)

    def _size(self, d: str | int, sizes: Mapping[str, int | None], r: Param, i: int) -> int:
        if isinstance(d, int) and not isinstance(d, bool):
            return d
        size = sizes.get(d)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ConfigError(
                f"{self.source} row {i} ({r.path}): dimension {d!r} is {size!r} for this config; "
                f"expected a size >= 0 (dims: {sorted(sizes)})"
            )
        return size


def shape_tree(specs: Mapping[str, Spec]) -> dict:
    """Nested dicts of the params' shape tuples (every param is fp32)."""
    return nest({p: s.shape for p, s in specs.items()})


def axes_tree(specs: Mapping[str, Spec]) -> dict:
    """Nested dicts (the `shape_tree` structure) of logical-axis tuples."""
    return nest({p: s.axes for p, s in specs.items()})


def groups_tree(specs: Mapping[str, Spec]) -> dict:
    """Nested dicts (the `shape_tree` structure) of per-dim `Groups` tuples (None where a dim is
    not made of groups)."""
    return nest({p: s.groups or (None,) * len(s.shape) for p, s in specs.items()})


def when(condition: str, rows: Iterable[Row]) -> tuple[Row, ...]:
    """`rows`, each existing only when `condition` ("VAR" or "not VAR") holds."""
    return tuple(replace(r, when=condition) for r in rows)

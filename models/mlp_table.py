"""Param-table rows shared by the families (`models.table`): SwiGLU MLPs and the router and
experts of a mixture of experts, as `models.moe` lays an MoE model out.

Dimension symbols: E hidden; the MLP width is the caller's (`M`, an expert's `MX`, ...); X the
number of routed experts. HF/torch Linear weights are `[out, in]`: transposed.
"""

from __future__ import annotations

from hybridckpt.models.table import Param, stack

SWIGLU_NAMES = ("gate_proj", "up_proj", "down_proj")


def swiglu(hf: str, width: str, names: tuple[str, str, str] = SWIGLU_NAMES) -> tuple[Param, ...]:
    """`{gate,up}.kernel [E, width]` (axes embed, mlp) and `down.kernel [width, E]` (mlp,
    embed) from HF `{hf}.{name}.weight` (names of gate, up, down)."""
    gate, up, down = names
    return (
        Param("gate.kernel", ("E", width), ("embed", "mlp"), f"{hf}.{gate}.weight", "transpose"),
        Param("up.kernel", ("E", width), ("embed", "mlp"), f"{hf}.{up}.weight", "transpose"),
        Param("down.kernel", (width, "E"), ("mlp", "embed"), f"{hf}.{down}.weight", "transpose"),
    )


def router(hf: str, *, bias: bool = False) -> tuple[Param, ...]:
    """`router.kernel [E, X]` (axes embed, None) from HF `{hf}.weight`; with `bias`, DeepSeek's
    `router.bias [X]` = `{hf}.e_score_correction_bias` (init 0)."""
    rows = (Param("router.kernel", ("E", "X"), ("embed", None), f"{hf}.weight", "transpose"),)
    if bias:
        rows += (Param("router.bias", ("X",), (None,), f"{hf}.e_score_correction_bias", init="zeros"),)
    return rows


def experts(hf: str, width: str, names: tuple[str, str, str] = SWIGLU_NAMES) -> tuple[Param, ...]:
    """Every expert's SwiGLU stacked on a leading `[X]` axis "experts" (`experts.gate.kernel
    [X, E, width]`, ...) from the Hub's per-expert names `{hf}.$E.{name}.weight`."""
    return stack("experts", swiglu(f"{hf}.$E", width, names), dim="X", axis="experts", index="$E")

"""Helpers of the family tests that check a family against transformers' own model: a tiny model
built by transformers with every parameter drawn at random (transformers initialises norms to 1
and biases to 0, which would hide a dropped one), saved by its `save_pretrained`; its logits; the
meshes the device count allows; our forward; the import -> restore -> export round trip compared
bit for bit with the source.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from e2e import roundtrip

from hybridckpt import jobs, models, naming
from hybridckpt.formats.registry import open_source

# the test-only frameworks: a module that imports this one is skipped at collection without them
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOKENS = np.array([[1, 5, 9, 3, 7, 2, 8, 4], [0, 11, 42, 17, 6, 5, 90, 3]], dtype=np.int32)
ATOL = 1e-4  # fp32 logits against transformers' fp32 forward


def pp_tp_mesh() -> str:
    """The mesh with pp=2 and tp=4 where 8 devices are present, else the largest of that form
    the devices allow (tp=2,pp=2 on 4, pp=2 on 2, one device)."""
    n = jax.device_count()
    return "tp=4,pp=2" if n >= 8 else "tp=2,pp=2" if n >= 4 else "pp=2" if n >= 2 else "dp=1"


def other_mesh() -> str:
    """A second mesh laid out unlike `pp_tp_mesh` (a restore onto it is a real reshard)."""
    n = jax.device_count()
    return (
        "fsdp=2,tp=2,pp=2"
        if n >= 8
        else "fsdp=2,tp=2"
        if n >= 4
        else "fsdp=2"
        if n >= 2
        else "dp=1"
    )


def build(model_cls: str, config_cls: str, kwargs: dict, seed: int, dtype=torch.float32):
    """transformers' `model_cls` of `config_cls(**kwargs)` (eager attention), every parameter
    random: norm weights around 1, the rest around 0."""
    cfg = getattr(transformers, config_cls)(**kwargs, attn_implementation="eager")
    m = getattr(transformers, model_cls)(cfg).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            centre = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.normal_(centre, 0.15 if p.ndim > 1 else 0.3)
    return m.to(dtype)


def torch_logits(m: torch.nn.Module, tokens: np.ndarray = TOKENS) -> np.ndarray:
    with torch.no_grad():
        return m.float()(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def read_params(folder: str) -> tuple[object, dict]:
    """(config, params tree as numpy fp32) read through the library from an HF folder."""
    opened = jobs.open_checkpoint(folder)
    tree = naming.hf_to_tree(opened.named, opened.config).params
    flat = {k: np.asarray(v.materialize(), np.float32) for k, v in tree.items()}
    return opened.config, naming.nest(flat)


def forward(cfg, params: dict, tokens: np.ndarray = TOKENS) -> np.ndarray:
    """Our logits on one device, jitted (cfg is read when traced)."""
    return np.asarray(jax.jit(lambda p: models.forward(cfg, p, tokens))(params))


def assert_logits(folder: str, want: np.ndarray, mesh: str | None = None) -> None:
    """Our logits of `folder` on `mesh` (default `pp_tp_mesh()`) equal `want` within ATOL."""
    got = jobs.logits(folder, TOKENS, mesh=mesh or pp_tp_mesh())
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def assert_far(got: np.ndarray, want: np.ndarray) -> None:
    """`got` differs from `want` far beyond the tolerance (a part that matters was turned off)."""
    diff = np.abs(got - want).max()
    assert diff > 100 * ATOL, diff


def roundtrip_bitwise(folder: str, tmp_path) -> str:
    """Import `folder` onto `pp_tp_mesh()`, restore onto `other_mesh()`, export: every source
    tensor comes back under its name, dtype and shape, bit for bit. Returns the export folder."""
    params, *_ = roundtrip(
        folder, tmp_path, mesh_a=pp_tp_mesh(), mesh_b=other_mesh(), optimizer=False
    )
    source = {k: v.materialize() for k, v in open_source(folder).tensors.items()}
    assert sorted(params) == sorted(source)
    for k, want in source.items():
        assert params[k].dtype == want.dtype and params[k].shape == want.shape, k
        assert np.array_equal(params[k].view(np.uint8), want.view(np.uint8)), k
    return str(tmp_path / "exported")


def load_fp32(folder, **overrides) -> torch.nn.Module:
    """transformers' own model of `folder`, computing in fp32 with eager attention; `overrides`
    replace config keys (what the export's config.json leaves to transformers' defaults)."""
    kw = {"dtype": torch.float32, "attn_implementation": "eager", **overrides}
    return transformers.AutoModelForCausalLM.from_pretrained(folder, **kw).eval()

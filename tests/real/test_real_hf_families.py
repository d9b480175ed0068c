"""The families of issue 26 as transformers 4.57's `save_pretrained` wrote them
(`generators/hf_families.py`): Gemma3ForConditionalGeneration with the hub's names
(`language_model.model.*`, `vision_tower.vision_model.*`, `multi_modal_projector.*`), Phi-3 with
v4's `rope_scaling` type longrope and a top-level `partial_rotary_factor`, OLMo 2, Granite.

Params bit for bit from the reader and after import on a mesh, restore on another and export (the
vision tower and projector under the names read); logits against transformers' own forward
(fp32, atol 1e-4) on a mesh with pp=2 and tp=4 where the devices allow. transformers 5.24 (this
session's) is the oracle of tests/families; these pin what 4.57 wrote.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from cases import ckpt, reference
from roundtrip_real import bitwise_equal, import_export

from hybridckpt import jobs
from hybridckpt.formats.registry import open_source

CASES = ["hf457_gemma3_mm", "hf457_phi3_longrope", "hf457_olmo2", "hf457_granite"]
FAMILIES = {"hf457_gemma3_mm": "gemma3_mm", "hf457_phi3_longrope": "phi3", "hf457_olmo2": "olmo2",
            "hf457_granite": "granite"}  # fmt: skip
LOGITS_ATOL = 1e-4


def _weights(ref: dict) -> dict:
    return {k: v for k, v in ref.items() if k not in ("logits", "tokens")}


def _mesh() -> str:
    n = jax.device_count()
    return "tp=4,pp=2" if n >= 8 else "tp=2,pp=2" if n >= 4 else "pp=2" if n >= 2 else "dp=1"


@pytest.mark.parametrize("case", CASES)
def test_reader_gives_the_tensors_bit_for_bit(case):
    src = open_source(ckpt(case))
    want = _weights(reference(case))
    assert sorted(src.tensors) == sorted(want)
    for k, v in want.items():
        assert bitwise_equal(src.tensors[k].materialize(), v), k


@pytest.mark.parametrize("case", CASES)
def test_config_is_read_as_the_family(case):
    cfg = jobs.open_checkpoint(ckpt(case)).config
    assert cfg.family == FAMILIES[case]
    if case == "hf457_phi3_longrope":  # v4: rope_scaling type longrope, partial_rotary_factor top-level
        assert (cfg.rotary_dim, cfg.original_max_position_embeddings, cfg.sliding_window) == (4, 4, 5)
        assert dict(cfg.longrope) == {"short_factor": (1.0, 2.5), "long_factor": (3.0, 7.0)}
    if case == "hf457_gemma3_mm":  # the hub's names
        assert (cfg.text_prefix, cfg.vision_prefix, cfg.projector_prefix) == (
            "language_model.model.", "vision_tower.vision_model.", "multi_modal_projector.")
        assert cfg.final_logit_softcapping == 30.0 and not cfg.vision_use_head


@pytest.mark.parametrize("case", CASES)
def test_import_restore_export_bitwise(case, tmp_path):
    params, _, _, _ = import_export(ckpt(case), tmp_path, optimizer=False)
    want = _weights(reference(case))
    assert sorted(params) == sorted(want)
    for k, v in want.items():
        assert bitwise_equal(params[k], v), k


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers(case):
    ref = reference(case)
    got = jobs.logits(ckpt(case), ref["tokens"], mesh=_mesh())
    np.testing.assert_allclose(got, ref["logits"], rtol=0, atol=LOGITS_ATOL)

"""Llama 4 (text) as Megatron itself writes it: a Llama-4-like GPTModel trained and saved by
Megatron-LM / megatron-core 0.19.2 (tests/real/generators/megatron_core.py, run `llama4`: tp2 pp2
on gloo CPU ranks, model only, torch_dist), read through Llama 4's megatron dialect
(models/llama4/dialects/megatron.*).

What the save holds: MoE every other layer (`--moe-layer-freq [0,1,0,1]`), a top-1 sigmoid router
whose score scales the expert INPUT (`--moe-apply-probs-on-input`), one shared expert, NoPE on every
2nd layer (`--no-rope-freq 2`), complex-pair RoPE (`--rotary-interleaved`). Megatron has no chunked
attention and no attention temperature tuning, so the config read says so (`attention_chunk_size`
None, `attn_temperature_tuning` False); the weightless L2 q/k norm is refused with NoPE layers
(Megatron's stock spec puts it on every layer, HF on RoPE layers only).
Checked: the config; every param bitwise against the params a tp = pp = 1 Megatron model holds
after loading the save, through import on a tp/pp mesh, restore on another, export (the experts
fused into HF's `gate_up_proj` / `down_proj`, [in, out]); the logits against GPTModel's own eval
forward (fp32, atol 2e-5).
"""

from __future__ import annotations

import cases
import pytest
from megatron_reference import (
    assert_bitwise,
    assert_logits_equal_megatron,
    llama4_to_hf,
    tp_pp_mesh,
)

CASE = "megatron_core_llama4_torch_dist"
DIMS = {"vocab": 60, "heads": 4, "groups": 2}


def test_config_from_megatron_args():
    from hybridckpt.formats.registry import open_source
    from hybridckpt.models.llama4.config import Llama4Config

    cfg = open_source(cases.ckpt(CASE)).config
    assert isinstance(cfg, Llama4Config), type(cfg)
    got = {k: getattr(cfg, k) for k in (
        "vocab_size", "num_layers", "intermediate_size", "intermediate_size_mlp", "num_experts",
        "num_experts_per_tok", "moe_layers", "no_rope_layers", "attention_chunk_size",
        "attn_temperature_tuning", "use_qk_norm", "tie_word_embeddings")}  # fmt: skip
    assert got == {
        "vocab_size": 60, "num_layers": 4, "intermediate_size": 8, "intermediate_size_mlp": 24,
        "num_experts": 4, "num_experts_per_tok": 1, "moe_layers": (1, 3), "no_rope_layers": (1, 0, 1, 0),
        "attention_chunk_size": None, "attn_temperature_tuning": False, "use_qk_norm": False,
        "tie_word_embeddings": False,
    }  # fmt: skip


def test_params_bitwise_through_import_restore_export(tmp_path):
    from e2e import roundtrip

    params, _, _, _ = roundtrip(cases.ckpt(CASE), str(tmp_path), mesh_a="fsdp=2,tp=2,pp=2",
                                mesh_b="dp=2,tp=2,pp=2", optimizer=False)  # fmt: skip
    want = llama4_to_hf(cases.reference(CASE), **DIMS)
    assert want["model.layers.1.feed_forward.experts.gate_up_proj"].shape == (4, 16, 16)
    assert_bitwise(params, want)


def test_logits_equal_megatron_forward():
    assert_logits_equal_megatron(cases.ckpt(CASE), cases.reference(CASE), DIMS["vocab"], tp_pp_mesh())


def _args():
    """The args Megatron saved in the case's common state (an argparse.Namespace), fresh."""
    import glob
    import os

    from hybridckpt.containers.dcp_metadata import read_metadata
    from hybridckpt.formats.megatron_dist.common import read_common

    (folder,) = glob.glob(os.path.join(cases.ckpt(CASE), "iter_*"))
    return read_common(folder, read_metadata(folder)).state["args"]


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(qk_l2_norm=True), r"qk_l2_norm with NoPE layers \[1, 3\]"),
        (dict(moe_shared_expert_intermediate_size=16), "moe_shared_expert_intermediate_size=16"),
        (dict(moe_router_topk_scaling_factor=2.5), "top-k scaling factor"),
        (dict(no_rope_freq=3), "no_rope_freq=3"),
        (dict(no_rope_freq=[1, "x", 0, 1]), "no_rope_freq="),  # hostile values: one line
        (dict(moe_ffn_hidden_size=0, ffn_hidden_size=None), "moe_ffn_hidden_size=None"),
        # Megatron's half-split RoPE on a Llama 4 is no HF Llama 4
        (dict(rotary_interleaved=False), "neither"),
    ],
)
def test_what_llama4_cannot_express_is_refused(change, match):
    from hybridckpt.errors import FormatError
    from hybridckpt.formats.megatron.config import hf_config

    args = _args()
    assert hf_config(args, None, "f")["architectures"] == ["Llama4ForCausalLM"]
    for k, v in change.items():
        setattr(args, k, v)
    with pytest.raises(FormatError, match=match):
        hf_config(args, None, "f")


def test_interleaved_rope_stays_refused_for_families_without_it():
    """`--rotary-interleaved` is read only for a family rotating pairs (Llama 4); on a Llama run
    it is refused in one line, not dropped."""
    from hybridckpt.errors import FormatError
    from hybridckpt.formats.megatron.config import architecture
    from hybridckpt.formats.megatron.model import Reader

    args = Reader(cases.ckpt("megatron_lm_dense_torch"), None).args
    args.rotary_interleaved = True
    with pytest.raises(FormatError, match=r"rotary_interleaved=True .* not supported for Llama \(.*llama4"):
        architecture(args, "f")

"""Mistral's native checkpoints (`params.json` + `consolidated.safetensors`) from mistral-inference's
own `Transformer`, loaded back by its own `Transformer.from_folder` for the logits.

    python tests/real/make.py mistral

Cases:
- `mistral_swa`: a dense Mistral with GQA, `head_dim` apart from dim / n_heads (as Mistral NeMo),
  and a `sliding_window` shorter than the token sequence (as Mistral 7B v0.1), so the logits
  check the window;
- `mixtral_moe`: Mixtral, `params.json`'s `moe` block (`num_experts`, `num_experts_per_tok`),
  every layer's feed_forward a `MoeLayer` (router `gate`, `experts.E.w1/w2/w3`).

mistral-inference writes no checkpoint itself (Mistral's releases come from its training code):
the generator builds `Transformer(TransformerArgs.from_dict(params))`, moves every weight off its
init (seeded normal), saves `safetensors.torch.save_file(model.state_dict())` next to the
params.json, and then the tool's own loader `Transformer.from_folder` (strict load) reads the
folder back; the logits are that model's `forward` with a `BufferCache` (the prefill of
`generate`: causal, and local within `sliding_window`).

Shim: xformers' `memory_efficient_attention` has no CPU kernel ("No operator found ...
device=cpu"); mistral-inference's attention calls it with xformers' own mask objects, so the shim
computes the dense formula softmax(q k^T / sqrt(head_dim) + mask) v with the mask from xformers'
own `attn_bias.materialize`.

References: the weights in HF names as transformers' convert_mistral_weights_to_hf.py maps them
(STATE_DICT_MAPPING, `permute_for_rope` on q/k; Mixtral's `feed_forward.{gate,experts}` ->
`block_sparse_moe.*` as convert_mixtral_weights_to_hf.py), the logits, the tokens. As a check of
that mapping, transformers' MistralForCausalLM / MixtralForCausalLM (fp32, eager attention) built
from the HF-named weights must agree with mistral-inference's logits (the manifest records the gap).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np
import tools
import torch

STD = 0.15
TOKENS = np.random.default_rng(11).integers(0, 128, size=(2, 12)).astype(np.int64)

CASES = {
    "mistral_swa": {
        "dim": 32, "n_layers": 2, "head_dim": 16, "hidden_dim": 64, "n_heads": 4, "n_kv_heads": 2,
        "norm_eps": 1e-05, "vocab_size": 128, "rope_theta": 10000.0, "sliding_window": 5,
    },
    "mixtral_moe": {
        "dim": 32, "n_layers": 2, "head_dim": 8, "hidden_dim": 32, "n_heads": 4, "n_kv_heads": 2,
        "norm_eps": 1e-05, "vocab_size": 128, "rope_theta": 1000000.0,
        "moe": {"num_experts": 4, "num_experts_per_tok": 2},
    },
}  # fmt: skip

SHIMS = [
    "xformers.ops.fmha.memory_efficient_attention (no CPU kernel) replaced in "
    "mistral_inference.transformer_layers by the dense softmax(q k^T * head_dim**-0.5 + bias) v, "
    "bias = xformers' own attn_bias.materialize((q_len, k_len)); everything else is mistral-inference's",
    "weights set after construction: N(0, 0.15) for every linear/embedding weight, N(0, 1) for MoE "
    "routers (clear top-k choices), 1 + 0.2 * N(0, 1) for RMSNorm weights, seeded by parameter name",
    "fp32 on CPU (from_folder(device='cpu', dtype=torch.float32))",
]


def _dense_attention(query, key, value, attn_bias=None, p=0.0, scale=None):
    """memory_efficient_attention's contract ([B, M, H, K] inputs) computed densely."""
    assert p == 0.0
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = (t.transpose(1, 2).float() for t in (query, key, value))  # [B, H, M, K]
    s = q @ k.transpose(-1, -2) * scale
    if attn_bias is not None:
        s = s + attn_bias.materialize((q.shape[-2], k.shape[-2]), dtype=s.dtype, device=s.device)
    return (s.softmax(-1) @ v).transpose(1, 2).contiguous().to(query.dtype)


def _install_shim():
    import mistral_inference.transformer_layers as tl

    tl.memory_efficient_attention = _dense_attention


def _seed(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))


def _randomize(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = _seed(name)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("feed_forward.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(STD * torch.randn(p.shape, generator=g))


def _logits(model) -> np.ndarray:
    from mistral_inference.cache import BufferCache

    b, s = TOKENS.shape
    a = model.args
    cache = BufferCache(model.n_local_layers, a.max_batch_size, s, a.n_kv_heads, a.head_dim, a.sliding_window)
    cache.to(device=model.device, dtype=model.dtype)
    cache.reset()
    with torch.inference_mode():
        out = model.forward(torch.from_numpy(TOKENS.reshape(-1)), seqlens=[s] * b, cache=cache)
    return out.float().reshape(b, s, -1).numpy()


def _permute_for_rope(t, n_heads, dim1, dim2):
    """transformers convert_mistral_weights_to_hf.py `permute_for_rope`."""
    return t.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def _to_hf(sd: dict, params: dict) -> dict:
    """convert_mistral_weights_to_hf.py `convert_state_dict` (names, q/k permute) and, for the
    experts, convert_mixtral_weights_to_hf.py's `block_sparse_moe` names."""
    import re

    mapping = [  # STATE_DICT_MAPPING, then the Mixtral converter's MoE keys
        (r"^output.weight", r"lm_head.weight"),
        (r"^norm.weight", r"model.norm.weight"),
        (r"^tok_embeddings.weight", r"model.embed_tokens.weight"),
        (r"^layers.(\d+).attention_norm.weight", r"model.layers.\1.input_layernorm.weight"),
        (r"^layers.(\d+).ffn_norm.weight", r"model.layers.\1.post_attention_layernorm.weight"),
        (r"^layers.(\d+).attention.w(q|k|v|o).weight", r"model.layers.\1.self_attn.\2_proj.weight"),
        (r"^layers.(\d+).feed_forward.w1.weight", r"model.layers.\1.mlp.gate_proj.weight"),
        (r"^layers.(\d+).feed_forward.w2.weight", r"model.layers.\1.mlp.down_proj.weight"),
        (r"^layers.(\d+).feed_forward.w3.weight", r"model.layers.\1.mlp.up_proj.weight"),
        (r"^layers.(\d+).feed_forward.gate.weight", r"model.layers.\1.block_sparse_moe.gate.weight"),
        (r"^layers.(\d+).feed_forward.experts.(\d+).(w[123]).weight",
         r"model.layers.\1.block_sparse_moe.experts.\2.\3.weight"),
    ]  # fmt: skip
    heads, kv, hd, dim = params["n_heads"], params["n_kv_heads"], params["head_dim"], params["dim"]
    out = {}
    for old, t in sd.items():
        for pat, rep in mapping:
            new, n = re.subn(pat, rep, old)
            if n:
                break
        else:
            raise ValueError(f"unmapped key {old}")
        if "q_proj" in new:
            t = _permute_for_rope(t.view(heads, hd, dim).reshape(heads * hd, dim), heads, heads * hd, dim)
        elif "k_proj" in new:
            t = _permute_for_rope(t.view(kv, hd, dim).reshape(kv * hd, dim), kv, kv * hd, dim)
        out[new] = t.contiguous()
    return out


def _hf_config(params: dict) -> dict:
    """convert_mistral_weights_to_hf.py `convert_config` (+ Mixtral's expert keys)."""
    cfg = {
        "hidden_size": params["dim"], "num_hidden_layers": params["n_layers"],
        "intermediate_size": params["hidden_dim"], "num_attention_heads": params["n_heads"],
        "rms_norm_eps": params["norm_eps"], "head_dim": params["head_dim"], "vocab_size": params["vocab_size"],
        "sliding_window": params.get("sliding_window"), "num_key_value_heads": params["n_kv_heads"],
        "rope_theta": params.get("rope_theta", 10000.0), "max_position_embeddings": 32768,
    }  # fmt: skip
    if params.get("moe"):
        cfg |= {"num_local_experts": params["moe"]["num_experts"],
                "num_experts_per_tok": params["moe"]["num_experts_per_tok"]}  # fmt: skip
    return cfg


def _hf_logits(hf: dict, cfg: dict) -> np.ndarray:
    import transformers

    cls, conf = (
        (transformers.MixtralForCausalLM, transformers.MixtralConfig)
        if "num_local_experts" in cfg
        else (transformers.MistralForCausalLM, transformers.MistralConfig)
    )
    c = conf(**cfg)
    c._attn_implementation = "eager"
    model = cls(c).float().eval()
    model.load_state_dict(hf, strict=True)
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS)).logits.float().numpy()


def main(argv=None) -> int:
    from mistral_inference.args import TransformerArgs
    from mistral_inference.transformer import Transformer
    from safetensors.torch import save_file

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    _install_shim()
    for case, params in CASES.items():
        d = tools.fresh_case(a.out, case)
        ckpt = os.path.join(d, "ckpt")
        os.makedirs(ckpt)
        with open(os.path.join(ckpt, "params.json"), "w") as f:
            json.dump(params, f, indent=2)
        built = Transformer(TransformerArgs.from_dict(params))
        _randomize(built)
        sd = {k: v.contiguous() for k, v in built.state_dict().items()}
        save_file(sd, os.path.join(ckpt, "consolidated.safetensors"))
        model = Transformer.from_folder(ckpt, max_batch_size=TOKENS.shape[0], device="cpu", dtype=torch.float32)
        logits = _logits(model)
        hf, cfg = _to_hf(sd, params), _hf_config(params)
        hf_gap = float(np.abs(_hf_logits(hf, cfg) - logits).max())
        assert hf_gap < 1e-4, f"{case}: transformers disagrees with mistral-inference by {hf_gap}"
        windowed = params.get("sliding_window") is not None
        tools.write_reference(d, {k: v.numpy() for k, v in hf.items()} | {"logits": logits, "tokens": TOKENS})
        notes = SHIMS + [f"transformers (eager attention, HF config below) vs mistral-inference logits: max abs gap {hf_gap:.3g}"]
        if windowed:
            cfg_no_window = dict(cfg, sliding_window=None)
            wgap = float(np.abs(_hf_logits(hf, cfg_no_window) - logits).max())
            notes.append(f"the same weights without the sliding window: logits move by {wgap:.3g} (the window matters)")
        tools.record_manifest(
            d,
            tool="mistral-inference Transformer (from_folder, forward with BufferCache)",
            dists=["torch", "mistral-inference", "xformers", "mistral-common", "simple-parsing", "transformers",
                   "numpy", "safetensors"],
            command="python tests/real/make.py mistral",
            references={
                "model.* / lm_head.weight": "the weights in HF names (convert_mistral_weights_to_hf.py "
                "STATE_DICT_MAPPING + permute_for_rope; Mixtral experts as block_sparse_moe.*), fp32",
                "logits": "mistral-inference Transformer.from_folder(...).forward(tokens, seqlens, cache=BufferCache) "
                "fp32 [batch, seq, vocab]",
                "tokens": "the token ids [batch, seq]",
            },
            notes=notes,
            params_json=params,
            hf_config=cfg,
        )
        print(f"wrote {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

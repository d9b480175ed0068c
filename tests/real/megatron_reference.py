"""The megatron_core cases' references (megatron-core parameter names) under HF names.

Written against Megatron's own layouts, not with the library's rules: a tp = pp = 1 megatron-core
GPTModel's parameters (what the reference run loaded) are
- `self_attention.linear_qkv.weight` `[groups * (heads/groups + 2) * head_dim, hidden]`: per query
  group its q heads, then one k head, then one v head (megatron/core/transformer/attention.py
  `SelfAttention.get_query_key_value_tensors`);
- `mlp.linear_fc1.weight` `[2 * ffn, hidden]`: gate rows, then up rows (transformer/mlp.py:
  `torch.chunk(x, 2, -1)`, `act(x[0]) * x[1]`); `linear_fc2` is down;
- MoE: `mlp.router.weight` `[E, hidden]`, experts `mlp.experts.local_experts.{e}.linear_fc1/fc2`,
  `e` the global expert (the reference run renames an ep rank's local experts)
  (SequentialMLP), each an MLP as above;
- embedding and output layer with the padded vocabulary (rows past `vocab` dropped here).
And the checks the megatron cases' tests share against those references: params bitwise
(`assert_bitwise`), our logits against GPTModel's own eval forward (`assert_logits_equal_megatron`).
"""

from __future__ import annotations

import re

import numpy as np

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def to_hf(ref: dict[str, np.ndarray], prefix: str, *, vocab: int, heads: int, groups: int) -> dict[str, np.ndarray]:
    """`ref`'s `prefix/<megatron name>` arrays under HF Llama / Mixtral names."""
    out: dict[str, np.ndarray] = {}
    for key, a in ref.items():
        if not key.startswith(prefix + "/"):
            continue
        name = key[len(prefix) + 1 :]
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = a[:vocab]
        elif name == "output_layer.weight":
            out["lm_head.weight"] = a[:vocab]
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = a
        else:
            m = _LAYER.match(name)
            assert m, name
            out.update(_layer(f"model.layers.{m[1]}.", m[2], a, heads, groups))
    return out


def _layer(at: str, rest: str, a: np.ndarray, heads: int, groups: int) -> dict[str, np.ndarray]:
    if rest == "input_layernorm.weight":
        return {at + "input_layernorm.weight": a}
    if rest == "pre_mlp_layernorm.weight":
        return {at + "post_attention_layernorm.weight": a}
    if rest == "self_attention.linear_proj.weight":
        return {at + "self_attn.o_proj.weight": a}
    if rest == "self_attention.linear_qkv.weight":
        per = heads // groups
        g = a.reshape(groups, per + 2, -1, a.shape[-1])
        hd = g.shape[2]
        return {
            at + "self_attn.q_proj.weight": np.ascontiguousarray(g[:, :per].reshape(heads * hd, -1)),
            at + "self_attn.k_proj.weight": np.ascontiguousarray(g[:, per].reshape(groups * hd, -1)),
            at + "self_attn.v_proj.weight": np.ascontiguousarray(g[:, per + 1].reshape(groups * hd, -1)),
        }
    if rest == "mlp.linear_fc1.weight":
        f = a.shape[0] // 2
        return {at + "mlp.gate_proj.weight": a[:f], at + "mlp.up_proj.weight": a[f:]}
    if rest == "mlp.linear_fc2.weight":
        return {at + "mlp.down_proj.weight": a}
    if rest == "mlp.router.weight":
        return {at + "block_sparse_moe.gate.weight": a}
    m = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$", rest)
    assert m, rest
    e = f"{at}block_sparse_moe.experts.{m[1]}."
    if m[2] == "2":
        return {e + "w2.weight": a}
    f = a.shape[0] // 2
    return {e + "w1.weight": a[:f], e + "w3.weight": a[f:]}


_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(?:transformer_layer|mtp_model_layer)\.(.+)$")
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
            "final_layernorm.weight": "shared_head.norm.weight"}  # fmt: skip


def glm45_to_hf(ref: dict[str, np.ndarray], *, vocab: int, heads: int, groups: int, layers: int) -> dict[str, np.ndarray]:
    """A GLM-4.5-like reference (`param/<name>`, `buffer/<name>`) under HF Glm4MoeForCausalLM's
    per-expert names: the layouts above, plus `linear_qkv.bias` split per query group like the
    weight's rows, `q_layernorm` / `k_layernorm` (HF q_norm / k_norm), the shared expert's fc1
    [gate; up] / fc2, the router's `expert_bias` buffer (HF `e_score_correction_bias`), and MTP
    layer i (`mtp.layers.{i}.*`, its decoder layer `transformer_layer`) as HF's
    `model.layers.{layers + i}.*` with its own copies of the embedding and the output layer
    (`embed_tokens`, `shared_head.head`; DeepSeek V3's layout)."""
    out: dict[str, np.ndarray] = {}
    for key, a in ref.items():
        kind, _, name = key.partition("/")
        if kind not in ("param", "buffer"):
            continue
        mtp = _MTP_LAYER.match(name)
        if mtp:
            name = f"decoder.layers.{layers + int(mtp[1])}.{mtp[2]}"
        own = re.match(r"^mtp\.layers\.(\d+)\.(.+)$", name)
        if own:
            at = f"model.layers.{layers + int(own[1])}."
            out[at + _MTP_OWN[own[2]]] = a
            out[at + "embed_tokens.weight"] = ref["param/embedding.word_embeddings.weight"][:vocab]
            out[at + "shared_head.head.weight"] = ref["param/output_layer.weight"][:vocab]
            continue
        m = _LAYER.match(name)
        if m is None:
            out.update(to_hf({key: a}, kind, vocab=vocab, heads=heads, groups=groups))
            continue
        at, rest = f"model.layers.{m[1]}.", m[2]
        per = heads // groups
        if rest == "self_attention.linear_qkv.bias":
            g = a.reshape(groups, per + 2, -1)
            out[at + "self_attn.q_proj.bias"] = np.ascontiguousarray(g[:, :per].reshape(-1))
            out[at + "self_attn.k_proj.bias"] = np.ascontiguousarray(g[:, per].reshape(-1))
            out[at + "self_attn.v_proj.bias"] = np.ascontiguousarray(g[:, per + 1].reshape(-1))
        elif rest in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
            out[f"{at}self_attn.{rest.split('.')[1][0]}_norm.weight"] = a
        elif rest == "mlp.router.weight":
            out[at + "mlp.gate.weight"] = a
        elif rest == "mlp.router.expert_bias":
            out[at + "mlp.gate.e_score_correction_bias"] = a
        elif rest.startswith(("mlp.shared_experts.", "mlp.experts.")):
            e = re.match(r"^mlp\.(shared_experts|experts\.local_experts\.(\d+))\.linear_fc([12])\.weight$", rest)
            assert e, rest
            base = at + ("mlp.shared_experts." if e[2] is None else f"mlp.experts.{e[2]}.")
            if e[3] == "2":
                out[base + "down_proj.weight"] = a
            else:
                f = a.shape[0] // 2
                out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = a[:f], a[f:]
        else:
            out.update(_layer(at, rest, a, heads, groups))
    return out


def llama4_to_hf(ref: dict[str, np.ndarray], *, vocab: int, heads: int, groups: int) -> dict[str, np.ndarray]:
    """A Llama-4-like reference (`param/<name>`) under HF Llama4ForCausalLM's names: the layouts
    above under `feed_forward.*`, the router `[E, hidden]`, the shared expert's fc1 [gate; up] /
    fc2, and each MoE layer's experts fused as HF stores them, [in, out]: `gate_up_proj`
    `[E, hidden, 2 I]` (expert e's fc1 transposed) and `down_proj` `[E, I, hidden]` (fc2
    transposed)."""
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for key, a in ref.items():
        kind, _, name = key.partition("/")
        if kind != "param":
            continue
        m = _LAYER.match(name)
        if m is None:
            out.update(to_hf({key: a}, kind, vocab=vocab, heads=heads, groups=groups))
            continue
        at, rest = f"model.layers.{m[1]}.", m[2]
        e = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$", rest)
        if e:
            proj = "gate_up_proj" if e[2] == "1" else "down_proj"
            experts.setdefault((at, proj), {})[int(e[1])] = a.T
            continue
        if rest.startswith("mlp.shared_experts."):
            fc = rest.split(".")[2]
            base = at + "feed_forward.shared_expert."
            if fc == "linear_fc2":
                out[base + "down_proj.weight"] = a
            else:
                f = a.shape[0] // 2
                out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = a[:f], a[f:]
        elif rest == "mlp.router.weight":
            out[at + "feed_forward.router.weight"] = a
        else:
            for k, v in _layer(at, rest, a, heads, groups).items():
                out[k.replace(".mlp.", ".feed_forward.")] = v
    for (at, proj), per in experts.items():
        assert sorted(per) == list(range(len(per))), (at, sorted(per))
        out[f"{at}feed_forward.experts.{proj}"] = np.ascontiguousarray(np.stack([per[i] for i in range(len(per))]))
    return out


def tp_pp_mesh() -> str:
    """A tp x pp mesh over the devices present (the tiny models: kv heads 2, so tp <= 2)."""
    import jax

    n = jax.device_count()
    return "tp=2,pp=2" if n >= 4 else "tp=2" if n >= 2 else "dp=1"


def assert_bitwise(got: dict, want: dict[str, np.ndarray], what: str = "") -> None:
    """`got` (arrays by HF name) holds exactly `want`'s names, each fp32 of `want`'s shape and bits
    (`what` names the comparison in a failure)."""
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want))[:6])
    for k, w in want.items():
        g = np.asarray(got[k])
        assert g.dtype == np.float32 and g.shape == w.shape, (what, k, g.dtype, g.shape, w.shape)
        assert np.array_equal(g.view(np.uint32), np.ascontiguousarray(w).view(np.uint32)), (what, k)


def assert_logits_equal_megatron(ckpt: str, ref: dict[str, np.ndarray], vocab: int, mesh: str) -> None:
    """Our forward of the checkpoint `ckpt` (on `mesh`) on the reference's `tokens` is GPTModel's
    own eval forward `ref["logits"]` (its padded vocabulary cut to `vocab`): fp32 both sides, a
    tiny model, different reduction orders, so atol 2e-5; and logits that say something."""
    from hybridckpt import jobs

    want = ref["logits"][..., :vocab]
    got = jobs.logits(ckpt, ref["tokens"], mesh=mesh)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    assert np.abs(want).max() > 0.1

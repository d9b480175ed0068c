"""Meta Llama reference checkpoints written by Meta's own `Transformer` under fairscale model parallel.

    python tests/real/make.py meta_llama --llama-repo GIT_DIR

GIT_DIR is a bare clone (or snapshot) of github.com/meta-llama/llama holding commit `LLAMA2_COMMIT`:
its `llama/model.py` (the Llama 2 reference model, on no package index) is read from there at run
time, never copied into this repository. Llama 3.x is `llama_models.llama3.model` from the pinned
`llama-models` package.

Each case is one model-parallel world (1 or 2 gloo CPU ranks, spawned here): every rank builds the
model from `params.json` exactly as `Llama.build` does (`ModelArgs(max_seq_len=..,
max_batch_size=.., **params)`; Llama 2 then sets `vocab_size` to the tokenizer's size), moves the
weights off their init, `torch.save(model.state_dict(), "consolidated.{rank:02d}.pth")` (the
layout of a Meta release), and runs Meta's `forward(tokens, start_pos=0)` for the logits.

Weights: Meta's layers pass `init_method=lambda x: x` (weights are loaded, not initialised), so a
shim wraps fairscale's `_initialize_affine_weight` to give it a seeded normal init instead. fairscale
still builds the full master weight on every rank and keeps this rank's slice, so the shards are
fairscale's own split, and the master weights are the same for every world size (the generator
checks that the 1-rank model's logits equal the 2-rank model's). RMSNorm weights (ones at init) get
seeded values, the same on every rank.

References (`reference.safetensors`): the whole model in HF names (the 1-rank state dict renamed as
transformers' convert_llama_weights_to_hf.py does, q/k rows through its `permute`), `logits`
[batch, seq, vocab] from Meta's forward on this world, and `tokens`. As a check of that mapping,
transformers' LlamaForCausalLM (fp32) is built from the HF-named weights with the config the
conversion script writes, and its logits must agree with Meta's (the manifest records the gap).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile

import numpy as np
import tools
import torch

LLAMA2_COMMIT = "689c7f261b9c5514636ecc3c5fefefcbb3e6eed7"  # meta-llama/llama main, llama/model.py
SEED = 1234
STD = 0.15  # weights ~ N(0, STD): activations and logits of order one at dim 32
MAX_SEQ_LEN = 32
TOKENS = np.random.default_rng(7).integers(0, 128, size=(2, 12)).astype(np.int64)

# params.json as Meta's releases spell them (Llama 2 70B: n_kv_heads, vocab_size -1; Llama 3.1 8B:
# ffn_dim_multiplier, rope_theta, use_scaled_rope, the real vocab), shrunk
MODELS = {
    "meta_llama2_gqa": {
        "code": "llama2",
        "n_words": 128,  # Llama 2's params.json says -1: Llama.build takes the tokenizer's size
        "params": {"dim": 32, "multiple_of": 16, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2,
                   "norm_eps": 1e-05, "vocab_size": -1},
        "hf": {"llama_version": "2"},
    },
    "meta_llama31": {
        "code": "llama3",
        "params": {"dim": 32, "ffn_dim_multiplier": 1.3, "multiple_of": 16, "n_heads": 4, "n_kv_heads": 2,
                   "n_layers": 2, "norm_eps": 1e-05, "rope_theta": 500000.0, "use_scaled_rope": True,
                   "vocab_size": 256},
        "hf": {"llama_version": "3.1"},
    },
}
WORLDS = (1, 2)

SHIMS = [
    "fairscale.nn.model_parallel.layers._initialize_affine_weight is wrapped to pass a seeded "
    "normal init (N(0, 0.15) from one torch.Generator, the same draws on every rank and world size) "
    "instead of Meta's `init_method=lambda x: x`; fairscale's own master-weight split is unchanged",
    "RMSNorm weights (torch.ones at init) are set to 1 + 0.2 * N(0, 1), seeded by parameter name",
    "fp32 throughout on CPU (Llama.build sets bf16 as the default dtype on CUDA)",
    "gloo process group on 127.0.0.1 (Llama.build picks gloo itself when the device is not CUDA)",
]
LLAMA2_SHIMS = [
    "meta-llama/llama model.py Attention allocates its KV cache with .cuda(): torch.Tensor.cuda "
    "returns the tensor itself while the model is built (CPU run)",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _install_seeded_init():
    import fairscale.nn.model_parallel.layers as layers

    gen = torch.Generator().manual_seed(SEED)
    orig = layers._initialize_affine_weight

    def normal(w):
        with torch.no_grad():
            w.copy_(torch.randn(w.shape, generator=gen) * STD)
        return w

    def seeded(weight, out_features, in_features, per_partition_size, partition_dim, init_method, *a, **k):
        return orig(weight, out_features, in_features, per_partition_size, partition_dim, normal, *a, **k)

    layers._initialize_affine_weight = seeded


def _build(code: str, params: dict, n_words: int | None, llama2_py: str | None):
    """Meta's Transformer from params.json as `Llama.build` does it."""
    if code == "llama2":
        mod = _load_module(llama2_py, "meta_llama2_model")
        args = mod.ModelArgs(max_seq_len=MAX_SEQ_LEN, max_batch_size=TOKENS.shape[0], **params)
        args.vocab_size = n_words  # generation.py: model_args.vocab_size = tokenizer.n_words
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self  # shim: the KV cache's .cuda()
        try:
            return mod.Transformer(args)
        finally:
            torch.Tensor.cuda = cuda
    from llama_models.llama3.args import ModelArgs
    from llama_models.llama3.model import Transformer

    return Transformer(ModelArgs(max_seq_len=MAX_SEQ_LEN, max_batch_size=TOKENS.shape[0], **params))


def _worker(rank: int, world: int, port: int, spec: dict, ckpt: str, out: str, llama2_py: str | None):
    import fairscale.nn.model_parallel.initialize as fs_init
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    fs_init.initialize_model_parallel(world)
    torch.manual_seed(1)  # Llama.build: "seed must be the same in all processes"
    _install_seeded_init()
    with open(os.path.join(ckpt, "params.json")) as f:
        params = json.load(f)
    model = _build(spec["code"], params, spec.get("n_words"), llama2_py)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                g = torch.Generator().manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    torch.save(model.state_dict(), os.path.join(ckpt, f"consolidated.{rank:02d}.pth"))
    logits = model.forward(torch.from_numpy(TOKENS), 0)
    if rank == 0:
        torch.save({"logits": logits.clone()}, out)
    dist.barrier()
    dist.destroy_process_group()


def _permute(w, n_heads, dim1, dim2):
    """transformers convert_llama_weights_to_hf.py `write_model.permute` (Meta's interleaved RoPE
    pairs per head -> HF's half-split rows)."""
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def _to_hf(sd: dict, params: dict) -> dict:
    """The single-rank (num_shards == 1) branch of convert_llama_weights_to_hf.py `write_model`:
    its names and its permute, fp32 kept (the script itself saves bf16)."""
    dim, heads = params["dim"], params["n_heads"]
    kv = params.get("n_kv_heads") or heads
    kv_dim = dim // heads * kv
    out = {}
    for i in range(params["n_layers"]):
        p, m = f"layers.{i}.", f"model.layers.{i}."
        out[m + "self_attn.q_proj.weight"] = _permute(sd[p + "attention.wq.weight"], heads, dim, dim)
        out[m + "self_attn.k_proj.weight"] = _permute(sd[p + "attention.wk.weight"], kv, kv_dim, dim)
        out[m + "self_attn.v_proj.weight"] = sd[p + "attention.wv.weight"]
        out[m + "self_attn.o_proj.weight"] = sd[p + "attention.wo.weight"]
        out[m + "mlp.gate_proj.weight"] = sd[p + "feed_forward.w1.weight"]
        out[m + "mlp.down_proj.weight"] = sd[p + "feed_forward.w2.weight"]
        out[m + "mlp.up_proj.weight"] = sd[p + "feed_forward.w3.weight"]
        out[m + "input_layernorm.weight"] = sd[p + "attention_norm.weight"]
        out[m + "post_attention_layernorm.weight"] = sd[p + "ffn_norm.weight"]
    out["model.embed_tokens.weight"] = sd["tok_embeddings.weight"]
    out["model.norm.weight"] = sd["norm.weight"]
    out["lm_head.weight"] = sd["output.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def _hf_config(params: dict, vocab: int, llama_version: str) -> dict:
    """The LlamaConfig convert_llama_weights_to_hf.py `write_model` builds for this params.json."""
    dim = params["dim"]
    mult, multiple_of = params.get("ffn_dim_multiplier", 1), params.get("multiple_of", 256)
    inter = multiple_of * ((int(mult * int(8 * dim / 3)) + multiple_of - 1) // multiple_of)
    scaling = None
    if llama_version in ("3.1", "3.2"):
        scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    return {
        "hidden_size": dim, "intermediate_size": inter, "num_attention_heads": params["n_heads"],
        "num_hidden_layers": params["n_layers"], "rms_norm_eps": params["norm_eps"],
        "num_key_value_heads": params.get("n_kv_heads") or params["n_heads"], "vocab_size": vocab,
        "rope_theta": params.get("rope_theta", 10000.0), "rope_scaling": scaling,
        "max_position_embeddings": {"2": 4096, "3.1": 131072}[llama_version], "tie_word_embeddings": False,
    }


def _hf_logits(hf: dict, config: dict) -> np.ndarray:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**config)).float().eval()
    missing, unexpected = model.load_state_dict(hf, strict=False)
    assert not unexpected and all("rotary_emb" in k for k in missing), (missing, unexpected)
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS)).logits.float().numpy()


def _llama2_source(repo: str, tmp: str) -> tuple[str, str]:
    text = subprocess.run(
        ["git", f"--git-dir={repo}", "show", f"{LLAMA2_COMMIT}:llama/model.py"],
        check=True, capture_output=True,
    ).stdout
    path = os.path.join(tmp, "meta_llama2_model.py")
    with open(path, "wb") as f:
        f.write(text)
    return path, hashlib.sha256(text).hexdigest()


def run_world(spec: dict, world: int, ckpt: str, tmp: str, llama2_py: str | None) -> np.ndarray:
    import torch.multiprocessing as mp

    os.makedirs(ckpt)
    with open(os.path.join(ckpt, "params.json"), "w") as f:
        json.dump(spec["params"], f, indent=4)
    out = os.path.join(tmp, f"logits-{world}.pt")
    mp.spawn(_worker, args=(world, _free_port(), spec, ckpt, out, llama2_py), nprocs=world, join=True)
    return torch.load(out)["logits"].numpy()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--llama-repo", required=True, help=f"git dir of meta-llama/llama with {LLAMA2_COMMIT}")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        llama2_py, llama2_sha = _llama2_source(a.llama_repo, tmp)
        for base, spec in MODELS.items():
            logits_of, full = {}, None
            for world in WORLDS:
                case = f"{base}_mp{world}"
                d = tools.fresh_case(a.out, case)
                ckpt = os.path.join(d, "ckpt")
                logits_of[world] = run_world(spec, world, ckpt, tmp, llama2_py)
                if world == 1:
                    full = torch.load(os.path.join(ckpt, "consolidated.00.pth"))
            gap = float(np.abs(logits_of[1] - logits_of[2]).max())
            assert gap < 1e-5, f"{base}: 1-rank and 2-rank logits differ by {gap}"
            params = spec["params"]
            vocab = spec.get("n_words") or params["vocab_size"]
            hf = _to_hf(full, params)
            config = _hf_config(params, vocab, spec["hf"]["llama_version"])
            hf_gap = float(np.abs(_hf_logits(hf, config) - logits_of[1]).max())
            assert hf_gap < 1e-4, f"{base}: transformers' LlamaForCausalLM disagrees with Meta's forward by {hf_gap}"
            for world in WORLDS:
                case = f"{base}_mp{world}"
                d = os.path.join(a.out, case)
                refs = {k: v.numpy() for k, v in hf.items()}
                refs |= {"logits": logits_of[world], "tokens": TOKENS}
                tools.write_reference(d, refs)
                model_code = (
                    f"meta-llama/llama@{LLAMA2_COMMIT} llama/model.py (sha256 {llama2_sha})"
                    if spec["code"] == "llama2"
                    else "llama-models llama_models/llama3/model.py Transformer"
                )
                tools.record_manifest(
                    d,
                    tool="meta-llama reference Transformer + fairscale model parallel",
                    dists=["torch", "fairscale", "llama-models", "transformers", "numpy", "safetensors"],
                    command="python tests/real/make.py meta_llama --llama-repo <git dir of meta-llama/llama>",
                    references={
                        "model.* / lm_head.weight": "the whole model in HF names: the 1-rank state dict through "
                        "convert_llama_weights_to_hf.py's names and permute (q: n_heads, k: n_kv_heads), fp32",
                        "logits": f"Meta's Transformer.forward(tokens, start_pos=0) on {world} model-parallel "
                        "rank(s), fp32 [batch, seq, vocab]",
                        "tokens": "the token ids [batch, seq]",
                    },
                    notes=SHIMS + (LLAMA2_SHIMS if spec["code"] == "llama2" else []) + [
                        f"model code: {model_code}",
                        f"1-rank vs 2-rank logits: max abs gap {gap:.3g}",
                        f"transformers LlamaForCausalLM (fp32, HF config below) vs Meta's logits: max abs gap {hf_gap:.3g}",
                    ],
                    model_parallel=world,
                    params_json=params,
                    hf_config=config,
                    vocab_size=vocab,
                )
                print(f"wrote {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

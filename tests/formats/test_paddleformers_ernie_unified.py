"""A PaddleFormers 1.2 unified checkpoint of ERNIE 4.5 (`save_checkpoint_format=
"unified_checkpoint"`) holds the model's own names, fused `qkv_proj` / `up_gate_proj` left in
Paddle's `[in, out]` (not in the model's `transpose_weight_keys`) beside Linears transposed to
HF's, moments all `[in, out]` (seen on PaddleFormers 1.2's own save of the
paddleformers_ernie4_5_moe run). It is refused in one line that names the fused tensor and
points to the FlexCheckpoint, which is read (tests/real/test_real_paddle_ernie.py); nothing is
written. Built here with safetensors in those names and shapes."""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file

from hybridckpt.cli import main

CONFIG = {"model_type": "ernie4_5", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 12,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
          "rms_norm_eps": 1e-5, "rope_theta": 10000, "tie_word_embeddings": True, "use_bias": False}
SHAPES = {  # as PaddleFormers 1.2 saves them: fused ones [in, out], down/o transposed to HF's
    "model.embed_tokens.weight": (16, 8), "lm_head.weight": (16, 8),
    "model.layers.0.self_attn.qkv_proj.weight": (8, 16), "model.layers.0.self_attn.o_proj.weight": (8, 8),
    "model.layers.0.mlp.up_gate_proj.weight": (8, 24), "model.layers.0.mlp.down_proj.weight": (8, 12),
    "model.layers.0.input_layernorm.weight": (8,), "model.layers.0.post_attention_layernorm.weight": (8,),
    "model.norm.weight": (8,),
}


def write(folder: str) -> None:
    os.makedirs(folder)
    rng = np.random.default_rng(0)
    weights = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    moments = {f"{k}/{m}_0": (rng.normal(size=s[::-1] if k.endswith(("o_proj.weight", "down_proj.weight")) else s)
                              .astype(np.float32)) for k, s in SHAPES.items() if k != "lm_head.weight"
               for m in ("moment1", "moment2")}
    moments |= {f"{k}/{b}_pow_acc_0": np.array([0.9 ** 4], np.float32) for k in SHAPES if k != "lm_head.weight"
                for b in ("beta1",)}
    moments |= {f"{k}/beta2_pow_acc_0": np.array([0.95 ** 4], np.float32) for k in SHAPES if k != "lm_head.weight"}
    for name, index, d in (("model", "model.safetensors.index.json", weights),
                           ("optimizer", "optimizer.safetensors.index.json", moments)):
        save_file(d, os.path.join(folder, f"{name}-00001-of-00001.safetensors"))
        with open(os.path.join(folder, index), "w") as f:
            json.dump({"metadata": {}, "weight_map": {k: f"{name}-00001-of-00001.safetensors" for k in d}}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CONFIG, f)


def test_unified_ernie_refused_in_one_line(tmp_path, capsys):
    src, out = str(tmp_path / "checkpoint-3"), str(tmp_path / "out")
    write(src)
    before = sorted(os.listdir(src))
    assert main(["import", src, out, "--mesh", "dp=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "PaddleFormers unified checkpoint of ernie4_5" in err and ("qkv_proj" in err or "up_gate_proj" in err)
    assert "FlexCheckpoint" in err
    assert not os.path.exists(out) and sorted(os.listdir(src)) == before

"""Write hybridckpt/samples/tiny-llama: the demo's tiny Llama in the single-card HF layout, with
Adam moments (`optimizer.safetensors`) and step 12. Deterministic: re-running gives the same bytes.

    python examples/make_sample.py
"""

import os
import shutil

import numpy as np

from hybridckpt import models, naming
from hybridckpt.formats.hf.write import write_hf
from hybridckpt.lazy import ArrayTensor

OUT = os.path.join(os.path.dirname(__file__), "..", "hybridckpt", "samples", "tiny-llama")

cfg = models.LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=128,
)
rng = np.random.default_rng(20261122)
shapes = naming.flatten(models.param_shapes(cfg))


def draw(scale: float) -> dict:
    return {k: ArrayTensor((rng.standard_normal(s.shape) * scale).astype(np.float32)) for k, s in shapes.items()}


params = draw(0.05)
for k in params:
    if k.endswith("scale"):
        params[k] = ArrayTensor((1 + rng.standard_normal(shapes[k].shape) * 0.01).astype(np.float32))
mu = draw(1e-3)
nu = {k: ArrayTensor(np.abs(v.materialize()) ** 2) for k, v in draw(1e-3).items()}
inv = naming.model_rules(cfg).invert()
shutil.rmtree(OUT, ignore_errors=True)
write_hf(
    OUT, inv.apply_unstack(params).tensors, models.config_to_hf(cfg),
    slots={"exp_avg": inv.apply_unstack(mu).tensors, "exp_avg_sq": inv.apply_unstack(nu).tensors},
    step=12, trainer={"step": 12, "note": "synthetic sample"},
)
print(sorted(os.listdir(OUT)))

"""Megatron-LM's `common_state` object at other sizes, without megatron: the real save's pickle
with megatron's classes (its enums: `ModelType`, `AttnBackend`, `RerunMode`, ...) unpickled as
stand-ins that pickle back under their own module and name (`(cls, args, state)`, as an Enum
reduces), the sizes the run states changed in `args`, and `torch.save`d again. The content is
the real one but for those sizes; the bytes differ (pickle's memo sharing of the interned
argument names), so `scale_torch_dist` keeps the real bytes where nothing changes.
"""

from __future__ import annotations

import contextlib
import io
import sys


class _Stand:
    """A stand-in for a megatron class in the common state: rebuilt from its pickled arguments
    and state, pickled back the same way under the same name."""

    def __reduce_ex__(self, _proto):
        return (type(self), self._args, getattr(self, "_state", None))

    def __setstate__(self, state):
        self._state = state


def _stand_in(module: str, name: str):
    import types

    parts = module.split(".")
    for i in range(1, len(parts) + 1):  # the package chain pickle's import walks
        name_i = ".".join(parts[:i])
        if name_i not in sys.modules:
            m = types.ModuleType(name_i)
            m._stand_in = True
            sys.modules[name_i] = m
    mod = sys.modules[module]
    if not getattr(mod, "_stand_in", False):
        raise RuntimeError(f"{module} is a real module here: no stand-in")
    cls = getattr(mod, name, None)
    if cls is None:
        def new(c, *args):
            o = object.__new__(c)
            o._args = args
            return o
        cls = type(name, (_Stand,), {"__new__": new, "__module__": module, "__qualname__": name})
        setattr(mod, name, cls)
    return cls


def common_state(blob: bytes, m: dict, tp: int, pp: int, dp: int) -> bytes:
    """The real `common_state` with the sizes this run states: `torch.save` of the same dict."""
    import pickle

    import torch

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if module.startswith("megatron"):
                return _stand_in(module, name)
            return super().find_class(module, name)

    pm = type("pm", (), {"Unpickler": Unpickler, "load": pickle.load, "__name__": "pickle"})
    with _own_megatron_modules():
        return _resized(torch.load(io.BytesIO(blob), weights_only=False, pickle_module=pm), m, tp, pp, dp)


@contextlib.contextmanager
def _own_megatron_modules():
    """Our stand-in `megatron.*` modules for the duration, whatever runtime modules of that name
    another caller made (a test fixture's `megatron.core.enums`): those are put back after. A
    real megatron install is refused (its classes would be the real ones)."""
    names = [k for k in sys.modules if k == "megatron" or k.startswith("megatron.")]
    real = [k for k in names if getattr(sys.modules[k], "__file__", None) is not None]
    if real:
        raise RuntimeError(f"{real[0]} is a real module here: no stand-in")
    saved = {k: sys.modules.pop(k) for k in names}
    try:
        yield
    finally:
        for k in [k for k in sys.modules if k == "megatron" or k.startswith("megatron.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def _resized(state, m: dict, tp: int, pp: int, dp: int) -> bytes:
    """`torch.save` of the unpickled common `state` with this run's sizes in its `args`."""
    import torch

    a = state[0]["args"]  # a ShardedObject's value is saved as a one-item list
    kv = m["hidden_size"] // m["num_attention_heads"]
    changes = {"num_layers": m["num_layers"], "hidden_size": m["hidden_size"], "ffn_hidden_size": m["ffn_hidden_size"],
               "num_attention_heads": m["num_attention_heads"], "num_query_groups": m["num_query_groups"],
               "kv_channels": kv, "padded_vocab_size": m["padded_vocab_size"], "vocab_size": m["vocab_size"],
               "seq_length": m["seq_length"], "max_position_embeddings": m["seq_length"],
               "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "data_parallel_size": dp,
               "world_size": tp * pp * dp, "overlap_grad_reduce": m["overlap_grad_reduce"]}
    if m["bf16"]:
        changes.update(bf16=True, fp16=False, params_dtype=torch.bfloat16)
    for k, v in changes.items():
        if hasattr(a, k):
            setattr(a, k, v)
    sink = io.BytesIO()
    torch.save(state, sink)
    return sink.getvalue()

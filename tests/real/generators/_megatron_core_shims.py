"""What megatron-core 0.19.2 / Megatron-LM need to run on gloo CPU ranks in a Python 3.11 venv.

Every shim here is listed in `NOTES`, which the generator copies into each case's manifest:
- `typing.override` (Python 3.12) for megatron/training/models/hybrid.py, as typing_extensions';
- `megatron.core.transformer.moe.ops.paged_stash` (Triton kernels, imported by experts.py even
  when `moe_paged_stash` is off) replaced by a module whose kernels raise if ever launched;
- CUDA-only calls redirected to the CPU: a TorchFunctionMode rewrites `device="cuda"` / an int
  CUDA index in tensor factories and `.to()` to "cpu"; `Tensor.cuda` / `Module.cuda` keep the
  CPU; `torch.cuda.current_device` answers 0 (then rewritten), `torch.cuda.synchronize`,
  `torch.cuda.set_device`, `torch.cuda.empty_cache` do nothing; the device
  capability argument checks ask for is answered 9.0 (no CUDA-only feature is enabled by it here). `torch.cuda.is_available()`
  stays False and `device_count()` 0, so megatron takes its CPU paths where it has them.
"""

from __future__ import annotations

import contextlib
import sys
import types

NOTES = [
    "Python 3.11 venv: megatron-core 0.19.2's cp312 wheel installed with pip --target "
    "--python-version 3.12 (its only binary, datasets/helpers_cpp, is not used); "
    "typing.override (3.12) provided as typing_extensions.override",
    "megatron.core.transformer.moe.ops.paged_stash (Triton kernels; moe_paged_stash is off) "
    "replaced by a stub module whose kernels raise if launched: triton is not installed",
    "reference runs only (loading a save back): DistributedOptimizer._set_main_param_and_optimizer_states "
    "keeps the inner torch.optim.AdamW's `step` tensor (set from the param groups by load_state_dict) "
    "instead of failing with KeyError 'step' (megatron-core 0.19.2 without Apex/TE); the optimizer "
    "states are first created with Megatron's own _init_optimizer_states_with_dummy_values "
    "(overwritten by the load); and DistributedOptimizer.load_state_dict's one `step` tensor shared "
    "by every parameter's AdamW state (incremented in place once per parameter by the next step) "
    "is split into one tensor per parameter",
    "megatron.core.transformer.torch_norm.WrappedTorchNorm (the norm without Apex/TE) accepts "
    "--sequence-parallel (needed by MoE with TP) and marks its parameters sequence_parallel, as "
    "Apex's and TE's norms do; the parameters are unchanged",
    "CUDA-only calls redirected to the CPU (tests/real/generators/_megatron_core_shims.py): "
    "device='cuda'/CUDA indices in tensor factories and .to() become 'cpu', Tensor.cuda/Module.cuda "
    "keep the CPU, torch.cuda.current_device() -> 0, synchronize/set_device/empty_cache no-ops, Tensor.type() names CPU tensors "
    "as torch.cuda.* (the optimizers dispatch on that string), torch.cuda.get_rng_state() an empty uint8 tensor "
    "(so the checkpoints' rng_state holds that as cuda_rng_state), set_rng_state a no-op, "
    "torch.cuda.Stream/stream()/current_stream() "
    "synchronous stand-ins (waits are no-ops), device capability answered 9.0 (for argument checks); "
    "torch.cuda.is_available() stays False; gloo process groups; torch.cuda.device_count() answers 1 "
    "only inside megatron/training/initialize.py _initialize_distributed and _set_random_seed "
    "(which create the model-parallel groups and the CUDA RNG tracker states only when CUDA "
    "devices exist), 0 elsewhere; the CUDA RNG calls (manual_seed, set_rng_state, "
    "tensor_parallel.random._set_cuda_rng_state) are no-ops (dropout is 0: nothing random is drawn); megatron.core.datasets.utils.compile_helpers (make of the dataset index "
    "helpers; no dataset is read, tokens are synthetic) does nothing",
]


def _paged_stash() -> None:
    m = types.ModuleType("megatron.core.transformer.moe.ops.paged_stash")
    m.GLOBAL_BLOCK_SIZE = 1024

    def _no(*a, **k):
        raise RuntimeError("paged stash Triton kernel: shimmed out (no triton on this CPU venv)")

    m.paged_stash_copy_kernel = m.paged_stash_pop_kernel = _no
    m.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    sys.modules[m.__name__] = m


def _is_cuda(dev) -> bool:
    import torch

    if isinstance(dev, int):
        return True
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return False


class _Stream:
    """A CUDA stream on the CPU: work is synchronous, so waiting is a no-op."""

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a, **k):
        return None


def _cpu_everywhere() -> None:
    import torch
    from torch.overrides import TorchFunctionMode

    class _CpuMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs and _is_cuda(kwargs["device"]):
                kwargs["device"] = "cpu"
            if func in (torch.Tensor.to,) and args:
                args = tuple("cpu" if (i > 0 and _is_cuda(a)) else a for i, a in enumerate(args))
            return func(*args, **kwargs)

    torch.Tensor.cuda = lambda self, *a, **k: self
    cpu_type = torch.Tensor.type

    def tensor_type(self, *a, **k):  # the optimizers test `param.type() == 'torch.cuda.FloatTensor'`
        t = cpu_type(self, *a, **k)
        if not a and not k and isinstance(t, str) and t.startswith("torch.") and ".cuda." not in t:
            return "torch.cuda." + t[len("torch.") :]
        return t

    torch.Tensor.type = tensor_type
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(major=9, minor=0, name="cpu")
    torch.cuda.get_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.set_rng_state = lambda *a, **k: None
    torch.cuda.manual_seed = lambda *a, **k: None
    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.default_stream = lambda *a, **k: _Stream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    _CpuMode().__enter__()  # for the life of the process


def model_parallel_init_without_cuda() -> None:
    """megatron/training/initialize.py `_initialize_distributed` sets up the model-parallel groups
    only when `torch.cuda.device_count() > 0`: it is told 1 while that function runs (its
    `torch.cuda.set_device` is a no-op here), and `_set_random_seed` registers its CUDA RNG
    tracker states only then: both are told 1 while they run, 0 again afterwards. The CUDA RNG
    states are stand-ins (dropout is 0 in these cases: no CUDA randomness is drawn)."""
    import torch
    from megatron.training import initialize

    def with_one_device(orig):
        def wrapped(*a, **k):
            count = torch.cuda.device_count
            torch.cuda.device_count = lambda: 1
            try:
                return orig(*a, **k)
            finally:
                torch.cuda.device_count = count

        return wrapped

    initialize._initialize_distributed = with_one_device(initialize._initialize_distributed)
    initialize._set_random_seed = with_one_device(initialize._set_random_seed)
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._set_cuda_rng_state = lambda *a, **k: None
    # `_compile_dependencies` builds the dataset index helpers with make (the wheel ships no
    # Makefile; no dataset is read here: tokens are synthetic)
    from megatron.core.datasets import utils as dataset_utils

    dataset_utils.compile_helpers = lambda: None


def torch_adam_load_fix() -> None:
    """DistributedOptimizer `_set_main_param_and_optimizer_states` (megatron-core 0.19.2) copies
    every tensor of the inner optimizer's state from the loaded one, but a torch.optim.AdamW (used
    when neither Apex nor Transformer Engine is installed) keeps `step` as a tensor there, which
    `load_parameter_state_from_fully_reshardable` leaves out (`step` comes from the param groups,
    set by `load_state_dict` just before): a KeyError. Keys the loaded state lacks are skipped."""
    from megatron.core.optimizer import distrib_optimizer as dopt

    orig = dopt.DistributedOptimizer._set_main_param_and_optimizer_states

    def patched(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        missing = [k for k, v in state.items() if hasattr(v, "copy_") and k not in tensors]
        if missing and set(missing) <= {"step"}:
            tensors = {**tensors, "step": state["step"]}  # the value load_state_dict set
        return orig(self, model_param, tensors)

    dopt.DistributedOptimizer._set_main_param_and_optimizer_states = patched


def torch_norm_sequence_parallel() -> None:
    """MoE with tensor parallelism trains only with sequence parallelism (moe_layer.py refuses
    otherwise), which megatron-core's torch norm (`WrappedTorchNorm`, used without Apex / TE)
    refuses. As Apex's FusedLayerNorm and TE's norms do, the norm is built the same and its
    parameters are marked `sequence_parallel` (so finalize_model_grads all-reduces their grads
    over the tensor-parallel group). Parameters and their names are unchanged."""
    import copy

    from megatron.core.transformer import torch_norm

    orig = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, *a, **k):
        if not getattr(config, "sequence_parallel", False):
            return orig(cls, config, *a, **k)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = orig(cls, plain, *a, **k)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


def unshare_adam_steps(optimizers) -> None:
    """DistributedOptimizer.load_state_dict (megatron-core 0.19.2, torch.optim.AdamW: no Apex /
    TE) gives every parameter's state the SAME `step` tensor (`s["step"] = step` for all), which
    torch.optim.AdamW then increments in place once per parameter: the next step would use step
    counts 4, 5, 6, ... One tensor per parameter, as a fresh torch AdamW has."""
    for opt in optimizers:
        for st in opt.optimizer.state.values():
            if "step" in st:
                st["step"] = st["step"].clone()


def install() -> None:
    import os
    import typing

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as Megatron-LM's launch scripts set

    import typing_extensions

    if not hasattr(typing, "override"):
        typing.override = typing_extensions.override
    _paged_stash()
    _cpu_everywhere()
    torch_norm_sequence_parallel()

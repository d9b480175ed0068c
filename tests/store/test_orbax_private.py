"""What our store still takes from Orbax's private `_src` modules, pinned: a newer Orbax that
changes any of it fails here, loudly, naming the symbol, instead of writing a checkpoint that
Orbax itself would read differently. Everything else (reading arrays, contexts, process
indices, the pytree handler) is on TensorStore's and Orbax's public API; the read spec that
replaced Orbax's own (`containers.orbax.ts_spec`) is compared with it here."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

STORE = Path(__file__).resolve().parents[2] / "hybridckpt"

# symbol -> the parameters our call passes (a renamed or removed one breaks the save)
PRIVATE = {
    ("orbax.checkpoint._src.serialization.jax_array_handlers", "_async_serialize_shardings"):
        ("shardings", "infos", "primary_host"),
    ("orbax.checkpoint._src.serialization.tensorstore_utils", "build_array_write_spec"):
        ("info", "arg", "global_shape", "local_shape", "dtype", "use_ocdbt", "process_index", "metadata_key"),
    # (`store.stream_orbax._Validator` overrides it: a multi-process save into a bucket, each process's spool apart)
    ("orbax.checkpoint._src.metadata.array_metadata_store", "Validator.validate_all_array_metadatas"):
        ("self", "array_metadatas"),
}


@pytest.mark.parametrize("module, name", list(PRIVATE))
def test_each_private_symbol_is_there_with_the_parameters_we_pass(module, name):
    fn = importlib.import_module(module)
    for part in name.split("."):  # (a class's method: "Class.method")
        fn = getattr(fn, part, None)
    assert fn is not None, f"Orbax no longer has {module}.{name}: hybridckpt/store/stream_orbax.py needs a new way"
    params = inspect.signature(fn).parameters
    missing = [p for p in PRIVATE[(module, name)] if p not in params]
    assert not missing, f"{module}.{name} no longer takes {missing}"


def test_the_chunk_rule_a_plan_uses_is_the_one_build_array_write_spec_uses():
    """`store.stream.chunk_shape` (an import's plan) calls the chunk rule of the pinned module."""
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    params = inspect.signature(ts_utils.subchunking.choose_chunk_shape).parameters
    assert [p for p in ("global_shape", "write_shape", "dtype", "target_byte_size", "shard_axes") if p not in params] == []


def test_no_other_private_import_and_each_says_why():
    """Every `orbax.checkpoint._src` import in the library is one of the pinned ones, with a
    comment line above it saying why."""
    found = []
    for path in STORE.rglob("*.py"):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"\s*from (orbax\.checkpoint\._src\.[\w.]+) import (\w+)", line)
            if m:
                found.append((path.name, m.group(1), m.group(2)))
                assert lines[i - 1].lstrip().startswith("#"), f"{path}:{i + 1}: a private import without a reason"
    assert {f"{mod}.{name}" for _, mod, name in found} == {
        "orbax.checkpoint._src.serialization.jax_array_handlers", "orbax.checkpoint._src.serialization.tensorstore_utils",
        "orbax.checkpoint._src.metadata.array_metadata_store",
    }, found


@pytest.mark.parametrize("use_ocdbt", [False, True])
def test_our_read_spec_is_orbaxs(tmp_path, use_ocdbt):
    from etils import epath
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
    from orbax.checkpoint._src.serialization import types as ts_types

    from hybridckpt.containers.orbax import ts_spec

    info = ts_types.ParamInfo(name="layers.q.kernel", parent_dir=epath.Path(tmp_path), is_ocdbt_checkpoint=use_ocdbt,
                              use_zarr3=False)
    theirs = ts_utils.build_array_read_spec(info, use_ocdbt=use_ocdbt).json
    ours = ts_spec.read_spec(str(tmp_path), "layers.q.kernel", use_ocdbt=use_ocdbt)
    assert ours == theirs


# private attributes of Orbax's public classes that the subclasses in store/stream_orbax.py read
# or set: (class, attribute, what it must be) — a renamed one would make the streaming save fall
# back to, or silently bypass, Orbax's own behaviour
PRIVATE_ATTRIBUTES = [
    ("StandardCheckpointHandler", "_supported_types", tuple),
    ("StandardCheckpointHandler", "_impl", "PyTreeCheckpointHandler"),
    ("ArrayHandler", "_primary_host", None),
    ("ArrayHandler", "_metadata_key", None),
    ("ArrayHandler", "_array_metadata_store", None),
]


@pytest.mark.parametrize("cls, attr, kind", PRIVATE_ATTRIBUTES)
def test_each_private_attribute_of_a_subclassed_orbax_class_is_there(cls, attr, kind):
    import jax
    import orbax.checkpoint as ocp

    obj = ocp.StandardCheckpointHandler() if cls == "StandardCheckpointHandler" else (
        ocp.type_handlers.get_type_handler(jax.Array))
    assert type(obj).__name__ == cls
    assert hasattr(obj, attr), f"Orbax's {cls} no longer has {attr}: hybridckpt/store/stream_orbax.py needs a new way"
    value = getattr(obj, attr)
    if isinstance(kind, type):
        assert isinstance(value, kind), (attr, type(value))
    elif isinstance(kind, str):
        assert type(value).__name__ == kind, (attr, type(value))


def test_standard_handler_saves_through_the_impl_we_swap():
    """`StreamingCheckpointHandler.async_save` picks the OCDBT or per-chunk handler by setting
    `self._impl`: Orbax's own `async_save` and `finalize` must still go through that attribute,
    and its type check through `_supported_types`."""
    import orbax.checkpoint as ocp

    cls = ocp.StandardCheckpointHandler
    for method in ("async_save", "finalize"):
        assert "self._impl" in inspect.getsource(getattr(cls, method)), method
    assert "self._supported_types" in inspect.getsource(cls)


def test_every_private_attribute_stream_orbax_uses_is_pinned():
    """The `self._x` attributes stream_orbax.py touches are the ones pinned above or its own
    (new in its subclasses: not an attribute of the Orbax class it extends)."""
    import jax
    import orbax.checkpoint as ocp

    src = (STORE / "store" / "stream_orbax.py").read_text()
    used = set(re.findall(r"self\.(_[a-z]\w*)", src)) | set(re.findall(r'"(_[a-z]\w*)"', src))
    parents = (ocp.StandardCheckpointHandler(), ocp.type_handlers.get_type_handler(jax.Array))
    orbax_owned = {a for a in used if any(hasattr(p, a) for p in parents)}
    assert orbax_owned == {a for _, a, _ in PRIVATE_ATTRIBUTES}, sorted(orbax_owned)

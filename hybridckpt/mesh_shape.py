"""The sizes of a mesh's four axes, parsed from text like `dp=1,fsdp=2,tp=2,pp=2`, without JAX.

Kept apart from `hybridckpt.mesh` (which builds meshes and shardings, so imports JAX) so that a
mesh typed wrong is said before JAX is loaded: the command line's `import SRC DST --mesh tp=0`
ends in its one-line error in a fraction of the second JAX's import takes. `hybridckpt.mesh`
re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridckpt.errors import MeshError

MESH_AXES = ("dp", "fsdp", "tp", "pp")
AXIS_RULES_ENV = "HYBRIDCKPT_AXIS_RULES"


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the four mesh axes; their product is the device count."""

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def size(self) -> int:
        return self.dp * self.fsdp * self.tp * self.pp

    def as_dict(self) -> dict[str, int]:
        return {"dp": self.dp, "fsdp": self.fsdp, "tp": self.tp, "pp": self.pp}

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.as_dict().items())

    @classmethod
    def parse(cls, text: str) -> MeshShape:
        """Parse `dp=1,fsdp=2,tp=2,pp=2` (missing axes are 1); each axis at most once, sizes
        positive integers."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = (x.strip() for x in part.partition("="))
            if not eq or not key:
                raise MeshError(
                    f"bad mesh {text!r}: {part!r} is not axis=size; expected comma-separated "
                    f"axis=size with axes {', '.join(MESH_AXES)}"
                )
            if key not in MESH_AXES:
                hint = (" (expert parallelism is not an axis of its own: experts are sharded over dp, "
                        f"or as ${AXIS_RULES_ENV} says, e.g. experts=fsdp)") if key in ("ep", "expert", "experts") else ""
                raise MeshError(f"bad mesh {text!r}: unknown axis {key!r}; the axes are {', '.join(MESH_AXES)}{hint}")
            if key in sizes:
                raise MeshError(f"bad mesh {text!r}: axis {key} is given twice")
            try:
                size = int(value)
            except ValueError:
                raise MeshError(f"bad mesh {text!r}: {key}={value!r} is not an integer size") from None
            if size < 1:
                raise MeshError(f"bad mesh {text!r}: sizes must be positive, found {key}={size}")
            sizes[key] = size
        return cls(**sizes)

    @classmethod
    def of(cls, mesh: Any) -> MeshShape:
        """The sizes of a `jax.sharding.Mesh` (read from its `shape`)."""
        return cls(**{k: int(mesh.shape[k]) for k in MESH_AXES if k in mesh.shape})

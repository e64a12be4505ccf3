"""Device mesh ``('data', 'fsdp', 'tensor')`` and the logical-axis rules that place arrays on it.

The batch is split over ``data`` and ``fsdp``; parameters are split over ``fsdp`` on their
``embed`` axis and over ``tensor`` on their ``heads`` / ``mlp`` / ``vocab`` axes; the layer
axis of the scanned stack and the norm gains are replicated.
"""

from collections.abc import Sequence

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("layers", None),
    ("norm", None),
)


def mesh_shape(mesh_cfg: ml_collections.ConfigDict, device_count: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes; ``data = -1`` takes every device left by fsdp and tensor."""
    fsdp, tensor = mesh_cfg.fsdp, mesh_cfg.tensor
    if mesh_cfg.data == -1 and device_count % (fsdp * tensor):
        raise ValueError(
            f"mesh.fsdp={fsdp} x mesh.tensor={tensor} = {fsdp * tensor} must divide the "
            f"{device_count} devices available (mesh.data=-1 takes the rest)")
    data = mesh_cfg.data if mesh_cfg.data != -1 else device_count // (fsdp * tensor)
    if data * fsdp * tensor != device_count:
        raise ValueError(
            f"mesh.data={mesh_cfg.data}, mesh.fsdp={fsdp}, mesh.tensor={tensor} give "
            f"{data * fsdp * tensor} devices but {device_count} are available; the product "
            "must equal the device count (set mesh.data=-1 to fill it)")
    return data, fsdp, tensor


def make_mesh(mesh_cfg: ml_collections.ConfigDict,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over ``devices`` (all devices of all processes by default)."""
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(mesh_cfg, len(devices))
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def logical_sharding(mesh: Mesh, logical_axes: Sequence[str | None]) -> NamedSharding:
    """The NamedSharding of an array with the given logical axis names."""
    spec = nn.logical_to_mesh_axes(tuple(logical_axes), LOGICAL_RULES)
    return NamedSharding(mesh, spec)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token batches ``[B, L]``: B split over data x fsdp."""
    return logical_sharding(mesh, ("batch", "length"))


def tree_shardings(mesh: Mesh, abstract_tree):
    """Shardings for a tree whose leaves may be ``nn.Partitioned`` boxes (else replicated)."""
    specs = nn.get_partition_spec(abstract_tree)
    mesh_specs = nn.logical_to_mesh(specs, LOGICAL_RULES)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), mesh_specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))

"""Content checksums of a pytree of arrays, computed on device, independent of sharding.

orbax restores a checkpoint whose array data was garbled on disk without any error, so the
checkpointer stores these checksums with each step and compares them after a restore.

Each leaf's checksum is ``sum_i (2i + 1) * bits_i  (mod 2^32)`` over its elements' bit
patterns in row-major order: one changed element always changes it (the weights are odd,
hence invertible mod 2^32), and integer sums do not depend on the reduction order, so the
result is the same on any mesh.
"""

import jax
import jax.numpy as jnp
import numpy as np

_UINT_OF_SIZE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """The leaf's weighted bit sum; the row-major index comes from iotas, not a reshape, so a
    sharded leaf is never gathered."""
    bits = jax.lax.bitcast_convert_type(x, _UINT_OF_SIZE[x.dtype.itemsize]).astype(jnp.uint32)
    index = jnp.zeros(x.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(x.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= x.shape[axis]
    return jnp.sum(bits * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)


_checksums = jax.jit(lambda tree: jax.tree.map(_leaf_checksum, tree))


def tree_checksums(tree) -> dict[str, int]:
    """``{key path: checksum}`` of every array leaf of ``tree`` (fetched to the host)."""
    values = jax.device_get(_checksums(tree))
    flat, _ = jax.tree_util.tree_flatten_with_path(values)
    return {jax.tree_util.keystr(path): int(np.asarray(v)) for path, v in flat}

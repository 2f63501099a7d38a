"""Devices and ranks: which accelerator a rank should use (one GPU per rank on each node),
and communicators whose ranks are the devices of a `shard_map` (`device_comm`)."""

from __future__ import annotations

import jax
from mpi4py import MPI

from . import _jax_compat as jc


def node_local_rank(comm: MPI.Intracomm | None = None) -> int:
    """This rank's index among the ranks of `comm` on its node.

    Collective over `comm` (MPI `Split_type(COMM_TYPE_SHARED)`): call it on every rank.

    Args:
        comm (MPI.Intracomm | None): the communicator (None: `MPI.COMM_WORLD`).

    Returns:
        (int): This rank's rank among the ranks of `comm` that share its node (0 for the
            first).

    Raises:
        AttributeError: when `comm` is not an mpi4py communicator (it has no
            `Split_type`).
        MPI.Exception: when MPI reports an error in the split.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        return node.rank
    finally:
        node.Free()


def local_device(backend: str = "gpu", comm: MPI.Intracomm | None = None):
    """The device of `backend` this rank should use: local rank modulo devices per node.

    Use it as `jax.config.update("jax_default_device", vjpmpi.local_device())` once at
    start-up, or set `CUDA_VISIBLE_DEVICES` from `node_local_rank()` before JAX starts.
    Collective over `comm` (it calls `node_local_rank`): call it on every rank.

    Args:
        backend (str): the JAX backend whose devices to choose from (`"gpu"`, `"cpu"`,
            ...).
        comm (MPI.Intracomm | None): the communicator whose ranks share the node's
            devices (None: `MPI.COMM_WORLD`).

    Returns:
        (jax.Device): One of `jax.local_devices(backend=backend)`: number
            `node_local_rank(comm)` modulo their count.

    Raises:
        RuntimeError: when JAX has no such backend (e.g. `"gpu"` on a machine without
            one), from `jax.local_devices`.
        AttributeError: when `comm` is not an mpi4py communicator.
        MPI.Exception: when MPI reports an error in the split.
    """
    devices = jax.local_devices(backend=backend)
    return devices[node_local_rank(comm) % len(devices)]


class DeviceComm:
    """A communicator whose ranks are devices: made by `device_comm`, passed as `comm=`.

    Inside a `jax.shard_map` body over a mesh with axis `axis_name` (`D` devices along it
    in each process), its ranks are those devices in every process of the process
    communicator `comm`: `size` (`comm.Get_size() * D`) of them, a device's `rank`
    `comm.Get_rank() * D + jax.lax.axis_index(axis_name)`, an int32 scalar traced in the
    shard_map body (each device's own).

    Attributes:
        axis_name (str): the mesh axis whose devices are the ranks.
        comm (MPI.Intracomm | None): the process communicator (None: vjpmpi's default).
        local_size (int): the devices per process along the axis, `D`.
    """

    def __init__(self, axis_name: str, comm, local_size: int):
        from ._mpi import DeviceCommRef, as_comm

        self._device_ref = DeviceCommRef(as_comm(comm, "device_comm"), axis_name, local_size)

    @property
    def axis_name(self) -> str:
        return self._device_ref.axis

    @property
    def comm(self):
        return self._device_ref.comm

    @property
    def local_size(self) -> int:
        return self._device_ref.local

    @property
    def size(self) -> int:
        return self._device_ref.size

    @property
    def rank(self):
        return self._device_ref.rank

    def Get_size(self) -> int:  # noqa: N802 (mpi4py's name)
        """The number of ranks, as mpi4py's communicators name it.

        Returns:
            (int): `size`, the devices along the axis in every process.
        """
        return self.size

    def Get_rank(self):  # noqa: N802 (mpi4py's name)
        """This device's rank, as mpi4py's communicators name it.

        Returns:
            (jax.Array): `rank`, an int32 scalar traced in the shard_map body.
        """
        return self.rank

    def __repr__(self) -> str:
        return (f"DeviceComm(axis_name={self.axis_name!r}, size={self.size}, "
                f"local_size={self.local_size})")


def device_comm(axis_name: str, comm: MPI.Intracomm | None = None) -> DeviceComm:
    """A communicator whose ranks are the devices along a mesh axis, in every process.

    Call it inside a `jax.shard_map` body over a mesh of this process's devices with an
    axis `axis_name` of `D` devices: the communicator's ranks are those devices in each
    process of `comm` (size `comm.Get_size() * D`; a device's rank
    `comm.Get_rank() * D + axis_index(axis_name)`). Every vjpmpi op and `vjpmpi.nn` layer
    takes it as `comm=`: a program written per rank runs as P processes of D devices as it
    runs as P * D processes of one. Devices of one process exchange through memory, devices
    of different processes through MPI; each group of devices along the axis (one per
    combination of the mesh's other axes) is a communicator of its own. Ranks that name
    peers (`root`, `dest`, `source`) may be traced values (each device's own, computed
    from its `rank`). On a device communicator, `gather` gives every device the stacked
    shape (zeros off the root) and `scatter` takes it on every device.

    The axis name is extended across processes for the rest of the process: JAX's implicit
    sums over it (the transposes of `pvary`) sum over every process's devices, as
    `vjpmpi.lax.psum` does.

    Args:
        axis_name (str): a mesh axis of the `shard_map` being traced.
        comm (MPI.Intracomm | None): the process communicator (None: vjpmpi's default
            communicator).

    Returns:
        (DeviceComm): The device communicator.

    Raises:
        ValueError: outside a `jax.shard_map` body, or when the mesh there has no axis
            `axis_name` (or JAX does not map it manually).
        TypeError: when `axis_name` is not a string, or `comm` is not an mpi4py
            intracommunicator or None.

    Example:
        ```python
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, PartitionSpec as P
        from mpi4py import MPI
        import vjpmpi

        mesh = Mesh(np.array(jax.local_devices()), ("d",))
        def body(x):
            comm = vjpmpi.device_comm("d")
            return vjpmpi.allreduce(x * comm.rank, MPI.SUM, comm=comm)
        n = len(mesh.devices)
        y = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(
            jnp.ones(n))
        size = MPI.COMM_WORLD.Get_size() * n
        assert (y == size * (size - 1) / 2).all()  # the sum of every device's rank
        ```
    """
    if not isinstance(axis_name, str):
        raise TypeError(f"vjpmpi.device_comm: argument 'axis_name' must be a mesh axis name "
                        f"(a str), got {type(axis_name).__name__}")
    local = jc.manual_axis_size(axis_name)
    if local is None:
        raise ValueError(
            f"vjpmpi.device_comm: no mesh axis '{axis_name}' of a jax.shard_map here (its "
            "ranks are a shard_map's devices: call it inside the shard_map body, with an "
            "axis of its mesh)")
    made = DeviceComm(axis_name, comm, local)
    EXTENDED_AXES[axis_name] = made._device_ref.base.size
    return made


# Mesh axes that device communicators (and vjpmpi.lax) extend across processes, and over
# how many processes (the last communicator's).
EXTENDED_AXES: dict[str, int] = {}

"""Hierarchical collectives over a :class:`~semzo.topology.Topology` (Horovod's design).

allreduce: reduce inside the node -> reduce across the node leaders of a switch -> allreduce
across switch leaders -> broadcast back down. Only one rank per switch talks across switches,
and only one per node across nodes. Integers give the flat ``MPI_Allreduce`` result bit for
bit; floating-point sums differ from it by rounding only (a different summation order).

All functions are collective over ``topo.world``: every rank must call them with buffers of
the same shape and dtype. GPU (CuPy) buffers are synchronized before MPI touches them and are
staged through host memory unless ``SEMZO_CUDA_AWARE_MPI=1``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from ..backend import array_module, cuda_aware_mpi, is_device_array, synchronize

if TYPE_CHECKING:
    from .comms import Topology


def _staged(fn):
    """Run ``fn(topo, host_buf, ...)`` on a host copy of a GPU buffer, then copy back. Under
    CUDA-aware MPI ``fn`` gets the device buffer itself. Either way the result is an array of
    the input's module (CuPy in, CuPy out)."""

    def wrapper(topo: Topology, buf, *args, **kwargs):
        if not is_device_array(buf):
            return fn(topo, buf, *args, **kwargs)
        synchronize(buf)
        if cuda_aware_mpi():
            return fn(topo, buf, *args, **kwargs)
        host = buf.get()
        out = fn(topo, host, *args, **kwargs)
        if out is host:
            buf.set(host)
            return buf
        import cupy  # a device buffer: cupy is loaded

        return cupy.asarray(out)

    wrapper.__doc__ = fn.__doc__
    wrapper.__name__ = fn.__name__
    return wrapper


def _check(buf) -> None:
    if not (isinstance(buf, np.ndarray) or is_device_array(buf)):
        raise TypeError(f"expected a numpy/cupy array, got {type(buf).__name__}")
    if not buf.flags.c_contiguous:
        raise ValueError("collective buffers must be C-contiguous")


@_staged
def allreduce(topo: Topology, buf, op: MPI.Op = MPI.SUM):
    """Reduce ``buf`` over all ranks, in place; return ``buf``. Collective over the world."""
    _check(buf)
    if not topo.hierarchical or topo.size == 1:
        topo.world.Allreduce(MPI.IN_PLACE, buf, op=op)
        return buf
    node_leader = topo.is_node_leader
    if topo.node.Get_size() > 1:
        topo.node.Reduce(MPI.IN_PLACE if node_leader else buf, buf if node_leader else None,
                         op=op, root=0)
    if node_leader:
        nl = topo.node_leaders
        if nl.Get_size() > 1:
            sl = topo.is_switch_leader
            nl.Reduce(MPI.IN_PLACE if sl else buf, buf if sl else None, op=op, root=0)
        if topo.is_switch_leader and topo.switch_leaders.Get_size() > 1:
            topo.switch_leaders.Allreduce(MPI.IN_PLACE, buf, op=op)
        if nl.Get_size() > 1:
            nl.Bcast(buf, root=0)
    if topo.node.Get_size() > 1:
        topo.node.Bcast(buf, root=0)
    return buf


@_staged
def allgather(topo: Topology, sendbuf):
    """Gather every rank's ``sendbuf`` (same shape everywhere) into ``(P, *shape)``, in world
    rank order, on every rank: an array of ``sendbuf``'s module (a device buffer under
    CUDA-aware MPI gathers into a device array, as the staged path returns one). Collective
    over the world."""
    _check(sendbuf)
    xp = array_module(sendbuf)
    out = xp.empty((topo.size, *sendbuf.shape), dtype=sendbuf.dtype)
    if not topo.hierarchical or topo.size == 1:
        topo.world.Allgather(sendbuf, out)
        return out
    item = sendbuf.size
    gathered = xp.empty_like(out)            # ranks in hierarchy order, see Topology.gather_order
    flat = gathered.reshape(topo.size, item)
    # 1. inside the node, onto the node leader: slot [node_offset, node_offset + local_size)
    lo = topo.node_offset
    node_part = flat[lo:lo + topo.local_size]
    topo.node.Gather(sendbuf.reshape(item), node_part if topo.is_node_leader else None, root=0)
    if topo.is_node_leader:
        nl = topo.node_leaders
        # 2. node leaders of a switch, onto the switch leader (nodes may differ in size)
        s_lo = topo.switch_offset
        s_counts = topo.switch_node_sizes * item
        s_part = flat[s_lo:s_lo + topo.switch_size]
        if nl.Get_size() > 1:
            displ = np.concatenate(([0], np.cumsum(s_counts)[:-1]))
            nl.Gatherv(node_part.copy(), [s_part, s_counts, displ, _mpitype(flat)] if
                       topo.is_switch_leader else None, root=0)
        # 3. switch leaders exchange their switches' blocks
        if topo.is_switch_leader and topo.switch_leaders.Get_size() > 1:
            counts = topo.switch_sizes * item
            displ = np.concatenate(([0], np.cumsum(counts)[:-1]))
            topo.switch_leaders.Allgatherv(s_part.copy(), [flat, counts, displ, _mpitype(flat)])
        if nl.Get_size() > 1:
            nl.Bcast(flat, root=0)
    if topo.node.Get_size() > 1:
        topo.node.Bcast(flat, root=0)
    out[xp.asarray(topo.gather_order)] = gathered
    return out


def _mpitype(a: np.ndarray) -> MPI.Datatype:
    return MPI._typedict[a.dtype.char]


@_staged
def bcast(topo: Topology, buf, root: int = 0):
    """Broadcast ``buf`` from world rank ``root`` to every rank, in place; return ``buf``.
    Collective over the world."""
    _check(buf)
    if not topo.hierarchical or topo.size == 1:
        topo.world.Bcast(buf, root=root)
        return buf
    r_node = int(topo.rank_node[root])
    r_switch = int(topo.node_switch[r_node])
    node_leader_rank = int(topo.node_leader_of[r_node])
    switch_leader_rank = int(topo.switch_leader_of[r_switch])
    # carry the data up to the root's switch leader by point-to-point, if needed
    if root != node_leader_rank and topo.node_id == r_node:
        if topo.rank == root:
            topo.node.Send(buf, dest=0, tag=77)
        elif topo.is_node_leader:
            topo.node.Recv(buf, source=topo.node_local_rank_of(root), tag=77)
    if node_leader_rank != switch_leader_rank and topo.switch_id == r_switch and \
            topo.is_node_leader:
        if topo.rank == node_leader_rank:
            topo.node_leaders.Send(buf, dest=0, tag=78)
        elif topo.is_switch_leader:
            topo.node_leaders.Recv(buf, source=topo.node_leader_index(r_node), tag=78)
    if topo.is_switch_leader and topo.switch_leaders.Get_size() > 1:
        topo.switch_leaders.Bcast(buf, root=r_switch)
    if topo.is_node_leader and topo.node_leaders.Get_size() > 1:
        topo.node_leaders.Bcast(buf, root=0)
    if topo.node.Get_size() > 1:
        topo.node.Bcast(buf, root=0)
    return buf

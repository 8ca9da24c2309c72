"""ParallelMesh: the named dp / pp / cp / tp process groups of one resolved plan, built once from a DeviceMesh.

The ranks are laid out as a (pp, dp, cp, tp) grid, tp innermost: tensor-parallel peers are neighbouring ranks,
which on real hardware means the same node and the fastest links (four all-reduces per block and microbatch); then
context parallel, whose ring passes every layer's keys and values to the neighbour (the next-heaviest traffic,
overlapped with attention, so it wants the links just outside tp's); then dp, which reduces gradients once a step;
pipeline stages are the outermost axis, since they only exchange activations between neighbours. The gradients of a
cp group's ranks are averaged as dp's are, so data parallel and ZeRO run over `data`, the dp x cp ranks of one
(pp, tp) coordinate. Launchers number ranks node by node (torchrun, SLURM,
Lightning's), so tp stays inside a node whenever it divides the ranks per node; when it does not, the mesh
says so (a warning naming the tp group that crosses nodes). Every piece receives the `Axis` it uses as an
argument; there are no module-level process groups.
"""

from __future__ import annotations

import os
import socket
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from strategies import comm
from strategies.comm import Axis, CommStats
from strategies.plan import ParallelPlan

AXES = ("pp", "dp", "cp", "tp")


class ParallelMesh:
    """The process's view of the mesh: one `Axis` per name, plus `world`, all counting into one CommStats."""

    def __init__(self, plan: ParallelPlan, device_type: str, stats: CommStats | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh needs an initialized default process group (dist.init_process_group)")
        world_size = dist.get_world_size()
        self.plan = plan.resolve(world_size)
        self.stats = stats or CommStats()
        shape = (self.plan.pp, self.plan.dp, self.plan.cp, self.plan.tp)
        self.world = Axis.of_group("world", dist.group.WORLD, self.stats)
        self.device_mesh: DeviceMesh | None = None
        self._made: list[Any] = []  # the sub-groups this mesh created (`release`)
        if sum(size > 1 for size in shape) <= 1:
            # One axis spans every rank (or there is one rank): it is the world group, the others are
            # single-rank no-ops. No sub-groups to create: set-up costs nothing extra.
            self.axes = {name: Axis.of_group(name, dist.group.WORLD, self.stats) if size > 1 else
                         Axis.solo(name, self.stats) for name, size in zip(AXES, shape)}
        else:
            self.device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=AXES)
            self._made += self.device_mesh.get_all_groups()
            self.axes = {name: Axis.of_group(name, self.device_mesh.get_group(name), self.stats) for name in AXES}
        self.data = self._data_axis()
        self.ep, self.edp = self._expert_axes(device_type, world_size)
        comm.register_peers(self.world)  # to name a rank that dies later
        self.nodes = _node_indices(comm.all_gather_object(_node_key(), self.world))  # each rank's node
        advice = tp_across_nodes(self.nodes, self.plan.tp)
        if advice and dist.get_rank() == 0:
            warnings.warn(advice, stacklevel=2)
        expected = self.plan.coordinates(dist.get_rank())
        actual = {name: axis.index for name, axis in self.axes.items()}
        if expected != actual:  # the layout every other piece assumes (samplers, stage ownership)
            raise RuntimeError(f"mesh layout mismatch on rank {dist.get_rank()}: {actual} != {expected}")

    def release(self) -> None:
        """Destroy the gloo sub-groups this mesh created (`comm.leave_groups`), so that a fit leaves none of its own
        threads and sockets to the interpreter's exit (a script of several fits kept every fit's: one rank in 20 runs
        aborted there, docs/limits.md). Each rank calls it at the end of a fit that succeeded."""
        made, self._made = self._made, []
        comm.leave_groups(made)

    @property
    def dp(self) -> Axis:
        return self.axes["dp"]

    def _data_axis(self) -> Axis:
        """The ranks whose gradients are averaged: dp x cp, named by `ParallelPlan.data_axis` (dp itself without cp,
        cp itself with one dp rank, else the two flattened)."""
        name = self.plan.data_axis
        if name in self.axes:
            return self.axes[name]
        assert self.device_mesh is not None  # dp and cp both > 1: the grid was built
        group = self.device_mesh["dp", "cp"]._flatten(name).get_group()
        self._made.append(group)
        return Axis.of_group(name, group, self.stats)

    def _expert_axes(self, device_type: str, world_size: int) -> tuple[Axis, Axis]:
        """Expert parallel's two axes, carved out of the data ranks (dp x cp, numbered d = dp_i * cp + cp_i): ``ep``,
        ep consecutive data ranks that split the experts (and send tokens to each other by all-to-all); ``edp``, the
        data ranks that hold the same experts (d mod ep alike), whose expert gradients are averaged. Rank =
        (pp_i * dp x cp + d) * tp + tp_i, so the grid is the world's ranks as (pp, edp, ep, tp)."""
        plan = self.plan
        if plan.ep == 1:
            return Axis.solo("ep", self.stats), self.data
        shape = (plan.pp, plan.expert_data_ranks, plan.ep, plan.tp)
        names = ("pp", "edp", "ep", "tp")
        grid = DeviceMesh(device_type, torch.arange(world_size).reshape(shape), mesh_dim_names=names)
        self._made += grid.get_all_groups()
        return tuple(Axis.of_group(name, grid.get_group(name), self.stats) if size > 1 else Axis.solo(name, self.stats)
                     for name, size in (("ep", plan.ep), ("edp", plan.expert_data_ranks)))  # type: ignore[return-value]

    @property
    def cp(self) -> Axis:
        return self.axes["cp"]

    @property
    def tp(self) -> Axis:
        return self.axes["tp"]

    @property
    def pp(self) -> Axis:
        return self.axes["pp"]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{name}={axis.size}" for name, axis in self.axes.items())
        return f"ParallelMesh({sizes}, plan='{self.plan}')"


def _node_key() -> str:
    """This process's node: the host, and the node rank a launcher gives (two torchrun agents on one host are
    two nodes to NCCL's topology only by this number)."""
    for name in ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID"):
        if name in os.environ:
            return f"{socket.gethostname()}/{os.environ[name]}"
    return socket.gethostname()


def _node_indices(keys: list[str]) -> list[int]:
    """Each rank's node, numbered in order of first appearance."""
    order: dict[str, int] = {}
    return [order.setdefault(key, len(order)) for key in keys]


def tp_across_nodes(nodes: list[int], tp: int) -> str | None:
    """What to tell the user when a tensor-parallel group, ``tp`` consecutive ranks, spans nodes (its all-reduces,
    four per block per microbatch, then cross the network instead of NVLink); None when every group is inside
    one node. ``nodes``: each rank's node."""
    crossing = [list(range(start, start + tp)) for start in range(0, len(nodes), tp)
                if len(set(nodes[start : start + tp])) > 1]
    if tp == 1 or not crossing:
        return None
    per_node = min(nodes.count(n) for n in set(nodes))
    return (f"tp{tp} spans nodes: the tensor-parallel group of ranks {crossing[0]} is on "
            f"{len({nodes[r] for r in crossing[0]})} nodes, so its all-reduces cross the network. With {per_node} "
            f"ranks per node, use a tp that divides {per_node} (the mesh keeps tp innermost: each group is then "
            "inside one node)")

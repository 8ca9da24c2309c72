"""`ParallelMesh.release`: a fit's teardown destroys the sub-groups its mesh made (the grid's, the flattened data
axis', expert parallel's), so a script of several fits leaves none of them to the interpreter's exit
(docs/limits.md), and the next mesh builds and communicates as the first did."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from strategies import comm
from strategies.mesh import ParallelMesh
from strategies.plan import ParallelPlan
from strategies.testing import run_ranks


def _groups_rank(rank: int, world: int, plan_text: str) -> list[int]:
    counts = [len(distributed_c10d._world.pg_map)]  # the world group alone
    for _ in range(2):  # two fits' meshes, one after the other
        mesh = ParallelMesh(ParallelPlan.parse(plan_text), "cpu")
        counts.append(len(distributed_c10d._world.pg_map))
        total = torch.ones(1)
        comm.all_reduce(total, mesh.data)  # the second mesh's groups work after the first's were destroyed
        assert total.item() == mesh.data.size
        mesh.release()
        counts.append(len(distributed_c10d._world.pg_map))
    assert dist.is_initialized()  # the world group stays
    return counts


@pytest.mark.parametrize("plan", ["dp2_cp2", "ep2_tp2"])
def test_a_mesh_leaves_only_the_world_group_once_released(plan: str):
    for counts in run_ranks(_groups_rank, 4, plan):
        before, made, after = counts[0], counts[1], counts[2]
        assert made > before and after == before and counts[3] == made and counts[4] == before, counts

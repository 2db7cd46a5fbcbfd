"""One device mesh for every engine: the world's ranks laid out on named dimensions, built from the flags.

    layout = MeshLayout.from_sizes(world_size, pp=1, dp_replicate=2, tp=2)   # dp_shard: the rest (2 at 8)
    mesh = build_device_mesh(layout, "cuda")       # dims ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    mesh["tp"], dp_mesh(mesh), mesh["pp"]          # the sub-meshes the engines take

Dimensions, outermost first (rank = (((pp * R + r) * S + s) * C + c) * T + t): pipeline stages, data-parallel
replicas (HSDP: whole copies, gradients all-reduced between them), data-parallel shards (FSDP2 shards
parameters, gradients and optimizer state within a replica), context parallel (each sequence split over
these ranks, keys/values passed around them: model/ring_attention.py; as in torchtitan, between the data
and the tensor dimensions), tensor parallel (the model's matmuls split over these ranks). Tensor parallel is innermost, so its ranks are neighbours (one node, NVLink), as in
Megatron-LM and torchtitan. Every dimension is present, size 1 when unused, so `mesh["tp"]` always works.

Expert parallel (ep > 1): as in torchtitan, ep ranks are data-parallel shard ranks (they read different batches),
so ep splits dp_shard: the mesh is built with ("pp", "dp_replicate", "efsdp", "ep", "cp", "tp"), dp_shard =
efsdp x ep, and "dp_shard" is their flattened dimension (everything that shards over dp_shard is unchanged);
experts are sharded over "ep" (parallel/transforms/expert_parallel.py) and FSDP-sharded over "efsdp".

Owns: the layout arithmetic and its one-line error (`layout_problem`), the mesh, the data-parallel
coordinates of a rank (which slice of the global batch it reads: ranks that differ only in pp or tp read
the same one), and the start-up description.
Must never: start a process group (utils/dist.py does), or hold engine logic (engines take sub-meshes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EP_DIMS = ("efsdp", "ep")  # dp_shard's split where ep > 1: FSDP of the experts x expert parallel
# the dimensions whose ranks read the same batch (they split the model, not the data): a rank counts in the
# sums over the data only when it is the first of them (context-parallel ranks read the same batch and each keeps
# its part of every sequence: the model's loss is already summed over them)
SAME_BATCH_DIMS = ("pp", "cp", "tp")


@dataclass(frozen=True)
class MeshLayout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallel: a split of dp_shard (dp_shard = efsdp x ep), not a factor of the world

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: how many slices the global batch is split into."""
        return self.dp_replicate * self.dp_shard

    def sizes(self) -> tuple[int, ...]:
        """The sizes in MESH_DIMS order."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @classmethod
    def from_sizes(cls, world_size: int, *, pp: int = 1, dp_replicate: int = 1, tp: int = 1,
                   cp: int = 1, ep: int = 1) -> "MeshLayout":
        """The layout with dp_shard = world / (pp x dp_replicate x cp x tp); ValueError (one line) when that
        is not a whole number >= 1, or when ep does not divide it."""
        problem = layout_problem(world_size, pp=pp, dp_replicate=dp_replicate, tp=tp, cp=cp, ep=ep)
        if problem:
            raise ValueError(problem)
        return cls(pp, dp_replicate, world_size // (pp * dp_replicate * cp * tp), tp, cp, ep)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index on every dimension (the layout `build_device_mesh` gives torch)."""
        out = {}
        for name, size in reversed(list(zip(MESH_DIMS, self.sizes()))):
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in MESH_DIMS}

    def counts_in_sums(self, rank: int) -> bool:
        """Whether `rank` is the first of the ranks that read its batch (index 0 on every SAME_BATCH_DIMS
        dimension): the others add zeros to the sums over the data (Engine.sum_over_data)."""
        c = self.coordinates(rank)
        return all(c[d] == 0 for d in SAME_BATCH_DIMS)

    def dp_coordinates(self, rank: int) -> tuple[int, int]:
        """(data-parallel rank, data-parallel size) of a global rank: which slice of the global batch it reads."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"], self.dp

    def describe(self) -> str:
        dp = f"data-parallel {self.dp}"
        if self.dp_replicate > 1:
            dp += f" (replicate {self.dp_replicate} x shard {self.dp_shard})"
        if self.ep > 1:
            dp += f" (experts over {self.ep} of them)"
        cp = f" x context {self.cp}" if self.cp > 1 else ""
        return f"world {self.world_size} = pipeline {self.pp} x {dp}{cp} x tensor {self.tp}"


def layout_problem(world_size: int, *, pp: int = 1, dp_replicate: int = 1, tp: int = 1,
                   cp: int = 1, ep: int = 1) -> Optional[str]:
    """Why these sizes do not lay out `world_size` ranks (one line naming the product), or None."""
    for name, v in (("pipeline_parallel_size", pp), ("dp_replicate_size", dp_replicate),
                    ("tensor_parallel_size", tp), ("context_parallel_size", cp), ("expert_parallel_size", ep)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return f"--{name}={v!r}: must be an integer >= 1"
    fixed = pp * dp_replicate * cp * tp
    if world_size % fixed:
        ctx = f"context {cp} x " if cp > 1 else ""
        return (f"world size {world_size} is not a multiple of pipeline {pp} x dp_replicate {dp_replicate} x "
                f"{ctx}tensor {tp} = {fixed} (the data-parallel shard dimension is world / {fixed}; launch a multiple "
                f"of {fixed} processes)")
    shard = world_size // fixed
    if shard % ep:
        return (f"--expert_parallel_size={ep} does not divide the data-parallel shard dimension {shard} (world "
                f"{world_size} / {fixed}): expert-parallel ranks are data-parallel shard ranks")
    return None


def build_device_mesh(layout: MeshLayout, device_type: str) -> Any:
    """The torch DeviceMesh over the whole world with the five named dimensions (collective: every rank
    calls it). The world size must equal the layout's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size()
    if world != layout.world_size:
        raise ValueError(f"the mesh {layout.describe()} needs {layout.world_size} processes, the world has {world}")
    sizes, names = layout.sizes(), MESH_DIMS
    if layout.ep > 1:  # dp_shard as efsdp x ep, flattened back below (rank order unchanged: efsdp x ep + ep index)
        sizes = (layout.pp, layout.dp_replicate, layout.dp_shard // layout.ep, layout.ep, layout.cp, layout.tp)
        names = ("pp", "dp_replicate") + EP_DIMS + ("cp", "tp")
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
    if layout.ep > 1:
        mesh[EP_DIMS]._flatten("dp_shard")
    return mesh


def counts_in_sums(mesh: Any) -> bool:
    """MeshLayout.counts_in_sums for this rank of a built mesh."""
    return all(mesh.get_local_rank(d) == 0 for d in SAME_BATCH_DIMS)


def dp_coordinates(mesh: Any) -> tuple[int, int]:
    """MeshLayout.dp_coordinates for this rank of a built mesh: (data-parallel rank, size) over dp_replicate x
    dp_shard."""
    shard = mesh["dp_shard"].size()
    return (mesh.get_local_rank("dp_replicate") * shard + mesh.get_local_rank("dp_shard"),
            mesh["dp_replicate"].size() * shard)


def _flattened(mesh: Any, dims: tuple[str, ...]) -> Any:
    """The sub-mesh of `dims` flattened into one dimension named "_".join(dims), made once per mesh."""
    name = "_".join(dims)
    try:
        return mesh[name]
    except (KeyError, RuntimeError, ValueError):
        return mesh[dims]._flatten(name)


def expert_dp_mesh(mesh: Any) -> Any:
    """The ranks that hold the same experts under expert parallelism and reduce (FSDP2: shard) them together:
    "efsdp", with context parallelism "efsdp" x "cp" flattened ("efsdp_cp": each cp rank's tokens reach the experts
    too), with replicas "dp_replicate" in front (HSDP)."""
    inner = _flattened(mesh, ("efsdp", "cp")) if mesh["cp"].size() > 1 else mesh["efsdp"]
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "efsdp_cp" if mesh["cp"].size() > 1 else "efsdp"]
    return inner


def token_group(mesh: Any) -> Any:
    """The ranks of one data-parallel replica whose tokens together are its sequences, each running an MoE layer on
    its own share (model/moe.py sequence_group): the context-parallel ranks, the tensor-parallel ones, or both
    flattened ("cp_tp"); None when neither splits the tokens."""
    dims = tuple(d for d in ("cp", "tp") if mesh[d].size() > 1)
    if not dims:
        return None
    return (mesh[dims[0]] if len(dims) == 1 else _flattened(mesh, dims)).get_group()


def dp_mesh(mesh: Any) -> Any:
    """The data-parallel sub-mesh FSDP2 shards over: ("dp_replicate", "dp_shard") when replicas exist
    (HSDP: sharded within a replica, replicated across), else the 1-D ("dp_shard"). With context parallelism
    the shard dimension is dp_shard x cp flattened ("dp_shard_cp", as in torchtitan): parameters are the same
    on the cp ranks, so FSDP2 shards them and reduces their gradients over those ranks too."""
    shard = "dp_shard"
    if mesh["cp"].size() > 1:
        shard = "dp_shard_cp"
        _flattened(mesh, ("dp_shard", "cp"))
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", shard]
    return mesh[shard]

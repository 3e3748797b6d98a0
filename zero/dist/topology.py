"""Parallel layout: `ParallelDims(dp, tp, pp, sp, ep, cp)` validated against the world size.

It builds one DeviceMesh over the world and exposes every process group the layers need. Expert
parallelism borrows its ranks from the dense data x sequence region: ep divides dp * sp, and the
remaining factor of that region is the expert-data-parallel group over which expert gradients reduce.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from zero.config import ConfigError, key_namer
from zero.dist import comm
from zero.dist.comm import group_rank, group_size  # noqa: F401  (re-exported: the groups' queries)

_AXES = ("dp", "tp", "pp", "sp", "ep", "cp")


class LayoutError(ConfigError):
    """A parallel layout that cannot be built on the given world (a ConfigError: the degrees are configuration)."""


@dataclass
class ParallelDims:
    """Degrees of each parallelism; their product (dp * tp * pp * sp * cp) must equal the world size.

    `dp` left unset takes the rest of the world: `ParallelDims()` on N processes is dp=N.

    Rank order, outermost to innermost: pp, dp, cp, sp, tp. Tensor parallel ranks are the closest
    neighbours (they talk most), pipeline stages the farthest; Ulysses (sp) sits inside the ring (cp), so its
    all-to-all stays among near ranks. The ep ranks are the innermost `ep` ranks of the flattened dp x cp x sp
    region ("dp_sp": every rank that holds the same dense weights, cp included).
    """

    dp: int | None = None  # None: whatever the other degrees leave of the world (pure data parallel)
    tp: int = 1
    pp: int = 1
    sp: int = 1
    ep: int = 1
    cp: int = 1  # ring attention (context parallelism): the sequence split over cp x sp ranks
    world_size: int | None = None
    device_type: str = "cpu"
    _mesh: object = field(default=None, init=False, repr=False)
    # Twin process groups for gradient reductions, keyed by (name, rank partition): built once.
    _twins: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in _AXES:
            value = getattr(self, name)
            if name == "dp" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"parallel.{name}={value!r} is invalid: every degree must be an int >= 1")
        if self.world_size is None:
            self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.dp = fill_data_parallel(self.dp, self.world_size, self.tp, self.pp, self.sp, self.cp)
        if self.dp_sp % self.ep != 0:
            raise LayoutError(
                f"parallel.ep={self.ep} must divide dp * {'cp * ' if self.cp > 1 else ''}sp = {self.dp_sp}: expert "
                f"parallel ranks are borrowed from the data x sequence parallel region; use an ep that divides "
                f"{self.dp_sp}"
            )

    # ---------------------------------------------------------------- sizes
    @property
    def dp_sp(self) -> int:
        """Ranks holding the same dense weights: data x context x sequence parallel."""
        return self.dp * self.cp * self.sp

    @property
    def _dense_axes(self) -> tuple[str, ...]:
        # The cp mesh dimension exists only when cp > 1: layouts without it build the mesh they always did.
        return ("dp", "cp", "sp") if self.cp > 1 else ("dp", "sp")

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: replicas of each expert."""
        return self.dp_sp // self.ep

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def world_group(self) -> ProcessGroup | None:
        """Every rank of this layout (None for one rank): the world (zero.optim.diloco.ReplicaDims: its replica)."""
        return dist.group.WORLD if self.distributed else None

    # ---------------------------------------------------------------- mesh
    @property
    def mesh(self):
        """The world DeviceMesh with dims (pp, dp, [cp,] sp, tp), built on first use (None for world size 1)."""
        if self._mesh is None and self.distributed:
            if not dist.is_initialized():
                raise LayoutError(
                    f"world size {self.world_size} needs torch.distributed to be initialised "
                    "(launch with torchrun)"
                )
            from torch.distributed.device_mesh import init_device_mesh

            cp = (self.cp,) if self.cp > 1 else ()
            mesh = init_device_mesh(
                self.device_type,
                (self.pp, self.dp, *cp, self.sp, self.tp),
                mesh_dim_names=("pp", "dp", *(("cp",) if cp else ()), "sp", "tp"),
            )
            dp_sp = mesh[self._dense_axes]._flatten("dp_sp")
            if cp:
                mesh["cp", "sp"]._flatten("cp_sp")
            # The expert view of the same ranks: dp x sp re-factored as (edp, ep), ep innermost.
            dp_sp._unflatten(0, (self.edp, self.ep), ("edp", "ep"))
            self._mesh = mesh
        return self._mesh

    def _group(self, name: str) -> ProcessGroup | None:
        """The process group of one mesh axis, or None where it has a single rank (no communication)."""
        size = {
            "dp": self.dp, "sp": self.sp, "tp": self.tp, "pp": self.pp,
            "dp_sp": self.dp_sp, "ep": self.ep, "edp": self.edp, "cp": self.cp, "cp_sp": self.cp * self.sp,
        }[name]
        if size == 1:
            return None
        mesh = self.mesh
        if name in ("dp", "sp", "tp", "pp", "cp"):
            return mesh[name].get_group()
        if name == "cp_sp":
            return mesh["cp", "sp"]._flatten("cp_sp").get_group() if self.cp > 1 else mesh["sp"].get_group()
        if name == "dp_sp":
            return mesh[self._dense_axes]._flatten("dp_sp").get_group()
        sub = mesh[self._dense_axes]._flatten("dp_sp")._unflatten(0, (self.edp, self.ep), ("edp", "ep"))
        return sub[name].get_group()

    @property
    def dp_group(self) -> ProcessGroup | None:
        return self._group("dp")

    @property
    def sp_group(self) -> ProcessGroup | None:
        return self._group("sp")

    @property
    def cp_group(self) -> ProcessGroup | None:
        """The ring of ring attention: ranks at the same Ulysses place in each of the cp sequence slices."""
        return self._group("cp")

    @property
    def sequence_group(self) -> ProcessGroup | None:
        """Every rank holding a shard of the same sequences (cp x sp): where a loss or a router's statistics sum
        over the sequence. The sp group itself when cp = 1."""
        return self._group("cp_sp") if self.cp > 1 else self.sp_group

    @property
    def tp_group(self) -> ProcessGroup | None:
        return self._group("tp")

    @property
    def pp_group(self) -> ProcessGroup | None:
        return self._group("pp")

    @property
    def dp_sp_group(self) -> ProcessGroup | None:
        """Dense-parameter gradient reduction group (data x sequence parallel ranks)."""
        return self._group("dp_sp")

    @property
    def ep_group(self) -> ProcessGroup | None:
        return self._group("ep")

    @property
    def expert_data_parallel_group(self) -> ProcessGroup | None:
        """Expert-parameter gradient reduction group (replicas of the same experts)."""
        return self._group("edp")

    def group_of(self, partition: list[list[int]], tag: str = "partition") -> ProcessGroup | None:
        """The process group of this rank among `partition` (disjoint lists of global ranks; None if this
        rank is in none). Every group of the partition is created once per (tag, partition) and
        ParallelDims and reused; another tag gets groups of its own over the same ranks. Collective the
        first time: every rank calls it with the same partition."""
        key = (tag, tuple(tuple(ranks) for ranks in partition))
        if key not in self._twins:
            mine = None
            for ranks in partition:  # every rank creates every group, in the same order (torch requires it)
                created = dist.new_group(list(ranks))
                if dist.get_rank() in ranks:
                    mine = created
            self._twins[key] = mine
        return self._twins[key]

    def twin_groups(self, groups: dict[str, ProcessGroup | None]) -> dict[str, ProcessGroup | None]:
        """For each named group, a second process group over the same ranks (None stays None).

        Gradient reductions run on twins so their order can never interleave differently across ranks
        with other collectives on the original group (e.g. the parameter all-gathers of ZeRO-3, whose
        order depends only on the forward). Each twin is created once per ParallelDims and reused by
        every later engine. Collective: every rank calls it with the same names in the same order.
        """
        if not self.distributed:
            return dict(groups)
        mine = {name: None if g is None else dist.get_process_group_ranks(g) for name, g in groups.items()}
        everyone = comm.all_gather_object(mine, dist.group.WORLD)
        out: dict[str, ProcessGroup | None] = {}
        for name, group in groups.items():
            partition = sorted({tuple(ranks[name]) for ranks in everyone if ranks[name] is not None})
            twin = self.group_of([list(ranks) for ranks in partition], tag=f"twin:{name}")
            out[name] = None if group is None else twin
        return out

    def secondary_groups(self, groups: dict[str, ProcessGroup | None],
                         node_size: int) -> dict[str, ProcessGroup | None]:
        """For each named group, its ranks on this rank's node, a node being `node_size` consecutive global ranks:
        the group of the hpZ secondary partition. None where a secondary partition would not help: a None group,
        a group whose ranks are all on one node (its secondary group would be itself), or one with a single rank
        per node (it would keep whole copies). Collective: every rank calls it with the same names in the same
        order."""
        if not self.distributed or node_size == 1:
            return {name: None for name in groups}
        check_node_size(node_size, self.world_size)
        mine = {name: None if g is None else dist.get_process_group_ranks(g) for name, g in groups.items()}
        everyone = comm.all_gather_object(mine, dist.group.WORLD)
        out: dict[str, ProcessGroup | None] = {}
        for name, group in groups.items():
            partition = [part for ranks in sorted({tuple(ranks[name]) for ranks in everyone if ranks[name] is not None})
                         for part in node_partition(list(ranks), node_size, name)]
            created = self.group_of(partition, tag=f"hpz:{name}") if partition else None
            out[name] = None if group is None else created
        return out

    # ---------------------------------------------------------------- coordinates
    def group_members(self, rank: int, axes: tuple[str, ...]) -> list[int]:
        """The global ranks that share `rank`'s coordinates along `axes` (e.g. ("pp", "tp"): its data x sequence
        parallel group), in rank order."""
        me = self.coordinate(rank)
        return [r for r in range(self.world_size)
                if all(self.coordinate(r)[a] == me[a] for a in axes)]

    def coordinate(self, rank: int | None = None) -> dict[str, int]:
        """This rank's index along each axis (pp, dp, sp, tp, ep, edp; cp too when cp > 1)."""
        if rank is None:
            rank = dist.get_rank() if self.distributed else 0
        tp_i = rank % self.tp
        sp_i = (rank // self.tp) % self.sp
        cp_i = (rank // (self.tp * self.sp)) % self.cp
        dp_i = (rank // (self.tp * self.sp * self.cp)) % self.dp
        pp_i = rank // (self.tp * self.sp * self.cp * self.dp)
        dp_sp_i = (dp_i * self.cp + cp_i) * self.sp + sp_i
        out = {"pp": pp_i, "dp": dp_i, "sp": sp_i, "tp": tp_i, "ep": dp_sp_i % self.ep, "edp": dp_sp_i // self.ep}
        return {**out, "cp": cp_i} if self.cp > 1 else out

    @property
    def dp_rank(self) -> int:
        return self.coordinate()["dp"]

    @property
    def sp_rank(self) -> int:
        return self.coordinate()["sp"]

    @property
    def ep_rank(self) -> int:
        return self.coordinate()["ep"]

    def __str__(self) -> str:
        cp = f", cp={self.cp}" if self.cp > 1 else ""
        return (f"ParallelDims(dp={self.dp}, tp={self.tp}, pp={self.pp}, sp={self.sp}{cp}, ep={self.ep}, "
                f"world={self.world_size})")


def fill_data_parallel(dp: int | None, world: int, tp: int = 1, pp: int = 1, sp: int = 1, cp: int = 1,
                       keys: Mapping[str, str] | None = None) -> int:
    """The data-parallel degree of `world` processes: `dp`, or with dp None (auto, as DeepSpeed and FSDP do) the
    ranks no other axis claims. LayoutError in one line where the degrees do not fill the processes; `keys` names
    dp (zero.config.key_name)."""
    k = key_namer(keys, "ParallelDims")
    others = tp * pp * sp * cp
    degrees = f"tp={tp} x pp={pp} x sp={sp}{f' x cp={cp}' if cp > 1 else ''}"
    if dp is None:
        if world % others:
            raise LayoutError(f"{k('dp')}=auto: {degrees} = {others} does not divide the {world} process(es), so no "
                              f"data-parallel degree fills them: start a multiple of {others} processes or choose "
                              f"degrees whose product divides {world}")
        return world // others
    if dp * others != world:
        fix = f"leave {k('dp')}=auto (here dp={world // others}) or " if world % others == 0 else ""
        raise LayoutError(f"{k('dp')}={dp} on {world} process(es): dp={dp} x {degrees} = {dp * others} does not "
                          f"match the world size {world}; {fix}start {dp * others} processes")
    return dp


def check_node_size(node_size: int, world: int, keys: Mapping[str, str] | None = None) -> None:
    """LayoutError unless nodes of `node_size` consecutive ranks (ZeroConfig.hpz_partition_size: the devices per
    node) tile the `world` processes; `keys` names the value (zero.config.key_name)."""
    if node_size > 1 and world % node_size:
        k = key_namer(keys, "ZeroConfig")
        raise LayoutError(f"{k('hpz_partition_size')}={node_size} does not divide the {world} process(es): set it to "
                          "the devices per node")


def node_partition(ranks: list[int], node_size: int, name: str = "parameter") -> list[list[int]]:
    """A group's ranks split by node (blocks of `node_size` consecutive global ranks): the hpZ secondary groups, or
    [] where a secondary partition would not help (all on one node, or one rank per node). LayoutError when the
    nodes hold different numbers of the group's ranks."""
    nodes: dict[int, list[int]] = {}
    for r in ranks:
        nodes.setdefault(r // node_size, []).append(r)
    sizes = sorted({len(on_node) for on_node in nodes.values()})
    if len(sizes) > 1:
        raise LayoutError(f"zero.hpz_partition_size={node_size}: the {len(ranks)}-rank {name!r} parameter group has "
                          f"{' or '.join(map(str, sizes))} ranks on different nodes; hpZ needs the same number on each")
    return list(nodes.values()) if len(nodes) > 1 and sizes != [1] else []


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing holds, for a process group's store (MASTER_PORT), picked below the
    kernel's ephemeral range where there is room: a port of that range (bound to port 0 and released) is free only
    until the store binds it, and any connection opened meanwhile on the machine (gloo opens many) may be given it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    pick = random.SystemRandom()
    for _ in range(64 if ephemeral > 11024 else 0):
        port = pick.randrange(10000, ephemeral)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def release_free_host_memory() -> bool:
    """Return the memory the C allocator holds free to the operating system (glibc's malloc_trim(0)); False where
    the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def peak_rss_bytes() -> int:
    """This process's own peak resident memory: VmHWM where /proc exists. (getrusage's ru_maxrss also counts
    the high-water mark of the process this one was forked from, e.g. a large test runner or launcher.)"""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

import pytest
import torch.distributed as dist

from tests.multirank import MultiRankError, run_multirank
from zero.dist.topology import LayoutError, ParallelDims


def _members(group):
    return None if group is None else sorted(dist.get_process_group_ranks(group))


def _groups(dp, tp, pp, sp, ep):
    dims = ParallelDims(dp=dp, tp=tp, pp=pp, sp=sp, ep=ep)
    return {
        "coord": dims.coordinate(),
        "dp": _members(dims.dp_group), "sp": _members(dims.sp_group), "tp": _members(dims.tp_group),
        "pp": _members(dims.pp_group), "dp_sp": _members(dims.dp_sp_group), "ep": _members(dims.ep_group),
        "edp": _members(dims.expert_data_parallel_group),
    }


def test_layout_validation_world_1():
    dims = ParallelDims()
    assert dims.world_size == 1 and dims.dp_group is None and dims.ep_group is None
    with pytest.raises(LayoutError, match="does not match the world size 1"):
        ParallelDims(dp=2)
    with pytest.raises(LayoutError, match="must divide dp \\* sp"):
        ParallelDims(dp=2, ep=3, world_size=2)
    with pytest.raises(LayoutError, match="int >= 1"):
        ParallelDims(dp=0)


_LAYOUTS = {  # (dp, tp, pp, sp, ep)
    "dp2_sp2_ep4": (2, 1, 1, 2, 4),
    "dp4_ep2": (4, 1, 1, 1, 2),
    "pp2_tp2": (1, 2, 2, 1, 1),
    "dp2_sp2_ep2": (2, 1, 1, 2, 2),
}


def _all_layouts():
    return {name: _groups(*layout) for name, layout in _LAYOUTS.items()}


@pytest.fixture(scope="module")
def four_rank_groups():
    """Group membership of every layout above, seen from each of 4 ranks (one spawn for all)."""
    return run_multirank(_all_layouts, 4)


def test_groups_dp2_sp2_ep4(four_rank_groups):
    for r, res in enumerate(four_rank_groups):
        g = res["dp2_sp2_ep4"]
        assert g["sp"] == ([0, 1] if r < 2 else [2, 3])
        assert g["dp"] == ([0, 2] if r % 2 == 0 else [1, 3])
        assert g["dp_sp"] == [0, 1, 2, 3]
        assert g["ep"] == [0, 1, 2, 3]
        assert g["edp"] is None and g["tp"] is None and g["pp"] is None
        assert g["coord"]["ep"] == r


def test_groups_dp4_ep2(four_rank_groups):
    for r, res in enumerate(four_rank_groups):
        g = res["dp4_ep2"]
        assert g["dp"] == [0, 1, 2, 3]
        assert g["ep"] == ([0, 1] if r < 2 else [2, 3])
        assert g["edp"] == ([0, 2] if r % 2 == 0 else [1, 3])
        assert g["coord"] == {"pp": 0, "dp": r, "sp": 0, "tp": 0, "ep": r % 2, "edp": r // 2}


def test_groups_pp2_tp2(four_rank_groups):
    for r, res in enumerate(four_rank_groups):
        g = res["pp2_tp2"]
        assert g["tp"] == ([0, 1] if r < 2 else [2, 3])
        assert g["pp"] == ([0, 2] if r % 2 == 0 else [1, 3])
        assert g["dp"] is None and g["dp_sp"] is None


def test_groups_dp2_sp2_ep2(four_rank_groups):
    for r, res in enumerate(four_rank_groups):
        g = res["dp2_sp2_ep2"]
        assert g["ep"] == ([0, 1] if r < 2 else [2, 3])
        assert g["edp"] == ([0, 2] if r % 2 == 0 else [1, 3])


def test_bad_layout_under_distributed_reports_rank():
    with pytest.raises(MultiRankError, match="does not match the world size 2"):
        run_multirank(_groups, 2, 1, 1, 1, 1, 1)


def _default_degrees_and_twins():
    import torch.distributed as dist

    created = []
    original = dist.new_group

    def counting_new_group(*args, **kwargs):
        created.append(args[0] if args else kwargs.get("ranks"))
        return original(*args, **kwargs)

    dist.new_group = counting_new_group
    try:
        plain, with_sp = ParallelDims(), ParallelDims(sp=2)
        first = plain.twin_groups({"dense": plain.dp_sp_group, "none": None})
        made_by_first = len(created)
        again = plain.twin_groups({"dense": plain.dp_sp_group, "none": None})
    finally:
        dist.new_group = original
    return {
        "plain": (plain.dp, plain.sp), "with_sp": (with_sp.dp, with_sp.sp),
        "twin_ranks": _members(first["dense"]), "twin_is_new": first["dense"] is not plain.dp_sp_group,
        "none": first["none"], "made_by_first": made_by_first, "made_by_second": len(created) - made_by_first,
        "reused": again["dense"] is first["dense"],
    }


def test_default_degrees_are_data_parallel_and_twins_are_built_once():
    for res in run_multirank(_default_degrees_and_twins, 4):
        assert res["plain"] == (4, 1) and res["with_sp"] == (2, 2)
        assert res["twin_ranks"] == [0, 1, 2, 3] and res["twin_is_new"] and res["none"] is None
        assert res["made_by_first"] == 1 and res["made_by_second"] == 0 and res["reused"]
    with pytest.raises(LayoutError, match=r"dp=auto: tp=3 x pp=1 x sp=1 = 3 does not divide the 4 process\(es\)"):
        ParallelDims(tp=3, world_size=4)


def test_free_port_is_below_the_ephemeral_range_and_free():
    """A store's port from outside the range the kernel hands to connections (which another process's connect
    could take between the pick and the store's bind), free when picked."""
    import socket

    from zero.dist.topology import free_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    if ephemeral <= 11024:
        pytest.skip(f"no room below this machine's ephemeral range (from {ephemeral})")
    ports = {free_port() for _ in range(20)}
    assert all(10000 <= p < ephemeral for p in ports), ports
    assert len(ports) > 1  # (picked at random: two processes do not race for one port)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))

"""`ParallelDims` and the world mesh: every spelling of the sizes resolves to the same named axes,
every bad combination is one clear error before any process group, and the mesh tpkit builds
(or a user's) answers `get_mesh` by axis name."""

from __future__ import annotations

import pytest
import torch

from tests.harness import RankGroup
from tpkit.parallel.dims import ParallelDims, sizes_of
from tpkit.parallel.mesh import DistEnv


def dims(world: int, **kwargs) -> ParallelDims:
    return ParallelDims.resolve(env=DistEnv(0, world, 0), **kwargs)


def axes(d: ParallelDims) -> tuple[int, ...]:
    return (d.dp_replicate, d.dp_shard, d.cp, d.tp, d.ep)


def test_default_is_tp_over_the_world():
    assert axes(dims(4)) == (1, 1, 1, 4, 1)


def test_dp_size_alone_is_the_fsdp_axis_and_replicas_when_not_sharded():
    assert axes(dims(4, tp_size=2, dp_size=2)) == (1, 2, 1, 2, 1)
    assert axes(dims(4, tp_size=2, dp_size=2, sharded=False)) == (2, 1, 1, 2, 1)
    assert axes(dims(4, dp_size=2)) == (1, 2, 1, 2, 1)  # tp takes what dp leaves


def test_dp_shard_takes_what_the_others_leave():
    assert axes(dims(8, dp_replicate_size=2, tp_size=2)) == (2, 2, 1, 2, 1)
    assert axes(dims(8, cp_size=2, tp_size=2)) == (1, 2, 2, 2, 1)
    d = dims(8, dp_replicate_size=2, dp_shard_size=2, tp_size=2)
    assert d.dp == 4 and d.dp_replicate_enabled and d.dp_shard_enabled and d.tp_enabled
    assert not d.cp_enabled and not d.ep_enabled


def test_transformers_and_accelerate_configs_read_as_sizes():
    from accelerate.parallelism_config import ParallelismConfig
    from transformers.distributed import DistributedConfig

    hf = DistributedConfig(tp_size=2, fsdp_size=2, dp_replicate_size=2)
    assert sizes_of(hf) == {"tp_size": 2, "dp_replicate_size": 2, "dp_shard_size": 2}
    assert axes(dims(8, distributed_config=hf)) == (2, 2, 1, 2, 1)
    pc = ParallelismConfig(dp_shard_size=2, tp_size=2)
    assert axes(dims(4, distributed_config=pc)) == (1, 2, 1, 2, 1)
    with pytest.raises(ValueError, match="tp_size=4 disagrees with DistributedConfig's tp_size=2"):
        dims(8, tp_size=4, distributed_config=hf)


def test_pipeline_stages_are_refused_by_name():
    from transformers.distributed import DistributedConfig

    with pytest.raises(ValueError, match="pp_size=2.*no pipeline"):
        sizes_of(DistributedConfig(tp_size=2, pp_size=2))


@pytest.mark.parametrize(
    ("world", "kwargs", "message"),
    [
        (4, {"tp_size": 3}, "tp_size=3 does not divide the world size 4"),
        (8, {"tp_size": 2, "dp_shard_size": 3}, "= 6 ranks, but the world size is 8"),
        (8, {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 4}, "= 16 ranks"),
        (4, {"tp_size": 2, "ep_size": 3}, "ep_size=3 must be a multiple of tp_size=2"),
        (4, {"tp_size": 2, "dp_size": 2, "ep_size": 8}, "divide dp_shard_size x tp_size = 4"),
        (4, {"dp_size": 2, "dp_shard_size": 2, "dp_replicate_size": 2}, "dp_size=2 is"),
        (4, {"cp_size": 0}, "cp_size must be >= 1"),
    ],
)
def test_sizes_that_cannot_make_the_world_are_one_clear_error(world, kwargs, message):
    with pytest.raises(ValueError, match=message):
        dims(world, **kwargs)


def test_one_process_asking_for_ranks_shows_the_launch_command():
    with pytest.raises(ValueError, match="(?s)needs 4 processes.*torchrun --nproc-per-node 4"):
        dims(1, tp_size=2, dp_replicate_size=2)


def test_ill_typed_sizes_name_the_fix():
    with pytest.raises(
        TypeError, match="dp_shard_size must be an int or None.*pass dp_shard_size=2"
    ):
        dims(4, dp_shard_size=2.0)


def test_pool_world_counts_every_axis():
    from tpkit.pool.entry import pool_world
    from tpkit.state import TPOptions

    assert pool_world(None, TPOptions(tp_size=2, dp_replicate_size=2, dp_shard_size=2)) == 8
    assert pool_world(["cpu"] * 4, TPOptions(tp_size=2)) == 4
    with pytest.raises(ValueError, match="device_ids names 2 devices"):
        pool_world(["cpu"] * 2, TPOptions(tp_size=2, dp_size=2))


# --- meshes, on ranks ------------------------------------------------------------------------


def check_world_mesh(kwargs: dict) -> dict:
    import torch.distributed as dist

    from tpkit.parallel.mesh import build_mesh, get_mesh, tp_submesh

    mesh = build_mesh(**kwargs)
    rank = dist.get_rank()

    def ranks(names):
        sub = get_mesh(mesh, *names)
        return None if sub is None else sorted(sub.mesh.flatten().tolist())

    return {
        "names": mesh.mesh_dim_names,
        "tp": sorted(tp_submesh(mesh).mesh.flatten().tolist()),
        "dp": ranks(("dp",)),
        "dp_replicate": ranks(("dp_replicate",)),
        "dp_shard": ranks(("dp_shard",)),
        "data": ranks(("dp_replicate", "dp_shard")),
        "cp": ranks(("cp",)),
        "same": build_mesh(**kwargs) is mesh,
        "rank": rank,
    }


def check_user_mesh(names: tuple[str, ...]) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from tpkit.parallel.dims import ParallelDims

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    try:
        d = ParallelDims.resolve(mesh=mesh)
    except ValueError as exc:
        return f"ValueError: {exc}"
    return str((d.dp_replicate, d.dp_shard, d.cp, d.tp))


@pytest.fixture(scope="module")
def ranks8():
    group = RankGroup(8)
    yield group
    group.close()


def test_hsdp_world_mesh_has_every_axis_and_tp_innermost(ranks8):
    out = ranks8.run(
        check_world_mesh, {"tp_size": 2, "dp_size": 2, "dp_replicate_size": 2}, timeout=120
    )
    r0, r5 = out[0], out[5]
    assert r0["names"] == ("dp_replicate", "dp_shard", "tp") and r0["same"]
    assert r0["tp"] == [0, 1] and r5["tp"] == [4, 5]
    assert r0["dp_shard"] == [0, 2] and r0["dp_replicate"] == [0, 4]
    assert r0["dp"] == [0, 2, 4, 6] and r0["data"] == [0, 2, 4, 6]
    assert r5["dp"] == [1, 3, 5, 7] and r0["cp"] is None


def test_user_meshes_are_read_by_axis_name(ranks4):
    assert ranks4.run(check_user_mesh, ("dp", "tp"))[0] == "(1, 2, 1, 2)"
    assert ranks4.run(check_user_mesh, ("dp_replicate", "tp"))[0] == "(2, 1, 1, 2)"
    msg = ranks4.run(check_user_mesh, ("pipeline", "tp"))
    assert all("the mesh's dimensions ('pipeline', 'tp') are not tpkit's" in m for m in msg), msg
    msg = ranks4.run(check_user_mesh, ("tp", "dp"))[0]
    assert "'tp' dimension must be the innermost" in msg, msg


def test_single_axis_mesh_on_two_ranks(ranks2):
    out = ranks2.run(check_world_mesh, {"tp_size": 1, "dp_size": 2})
    assert out[0]["names"] == ("dp_shard", "tp") and out[0]["dp"] == [0, 1]
    assert out[1]["tp"] == [1] and out[0]["dp_replicate"] is None


def test_device_is_cpu_here():
    assert dims(2).device == torch.device("cpu")

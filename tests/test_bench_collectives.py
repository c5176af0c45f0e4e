"""`python -m jaxtrain.bench collectives`: each collective does what it says over each mesh axis
and axis group (against numpy on the global array), the bandwidth columns follow the
nccl-tests conventions, and the CLI runs on 16 simulated devices and across two processes."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.cli import bench_collectives as bc
from jaxtrain.meshes.mesh import MeshConfig, build_mesh
from ports import reserved_port
from processes import child_env

pytestmark = [pytest.mark.fast]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = MeshConfig(data=4, tensor=4)


def reference(op: str, blocks: np.ndarray, group_dims: tuple[int, ...]) -> np.ndarray:
    """blocks [*mesh shape, e]: each device's block; the collective over `group_dims` in numpy,
    devices of a group ordered as the mesh orders them (row-major over the group's dims)."""
    mesh_dims = blocks.ndim - 1
    others = [d for d in range(mesh_dims) if d not in group_dims]
    moved = np.moveaxis(blocks, list(group_dims) + others, range(mesh_dims))
    n = int(np.prod([blocks.shape[d] for d in group_dims]))
    grouped = moved.reshape((n,) + moved.shape[len(group_dims):])  # [n, *others, e]
    if op == "all_reduce":
        out = np.broadcast_to(grouped.sum(0), grouped.shape)
    elif op == "all_gather":
        gathered = np.concatenate(list(grouped), axis=-1)
        out = np.broadcast_to(gathered, (n,) + gathered.shape)
    elif op == "reduce_scatter":
        total = grouped.sum(0)
        out = np.stack(np.split(total, n, axis=-1))
    elif op == "all_to_all":
        pieces = np.stack(np.split(grouped, n, axis=-1), axis=1)  # [from, to, *others, e/n]
        out = np.stack([np.concatenate([pieces[src, dst] for src in range(n)], axis=-1) for dst in range(n)])
    elif op == "collective_permute":  # device i sends to i + 1: device j holds j - 1's block
        out = np.roll(grouped, 1, axis=0)
    out = out.reshape(tuple(blocks.shape[d] for d in group_dims) + out.shape[1:])
    return np.moveaxis(out, range(mesh_dims), list(group_dims) + others)


@pytest.mark.parametrize("axes", [("data",), ("tensor",), ("data", "tensor")], ids=lambda a: "+".join(a))
@pytest.mark.parametrize("op", bc.COLLECTIVES)
def test_collective_matches_numpy(op, axes):
    mesh = build_mesh(MESH)
    n = int(np.prod([mesh.shape[a] for a in axes]))
    collective = bc._collectives()[op]
    elems = 4 * n
    rng = np.random.default_rng(7)
    blocks = rng.standard_normal(tuple(mesh.shape.values()) + (elems,)).astype(np.float32)
    spec = PartitionSpec(tuple(mesh.axis_names))
    out_elems = {"all_gather": elems * n, "reduce_scatter": elems // n}.get(op, elems)
    fn = jax.jit(jax.shard_map(lambda x: collective.run(x, axes if len(axes) > 1 else axes[0], n), mesh=mesh,
                               in_specs=spec, out_specs=spec, check_vma=False))
    out = np.asarray(fn(jax.device_put(blocks.reshape(-1), NamedSharding(mesh, spec))))
    group_dims = tuple(list(mesh.axis_names).index(a) for a in axes)
    expected = reference(op, blocks, group_dims)
    np.testing.assert_allclose(out.reshape(expected.shape[:-1] + (out_elems,)), expected, rtol=1e-5, atol=1e-5)


def test_bus_bandwidth_follows_nccl_tests_conventions():
    mesh = build_mesh(MESH)
    for name, factor in [("all_reduce", 2 * 3 / 4), ("all_gather", 3 / 4), ("collective_permute", 1.0)]:
        row = bc.measure(mesh, bc._collectives()[name], ("data",), 64 * 1024, iters=2, repeats=1)
        assert row["devices"] == 4 and row["bytes"] == 64 * 1024 and row["time_us"] > 0
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / (row["time_us"] * 1e-6) / 1e9)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * factor)


def nccl_tests_bus_factor(op: str, n: int) -> float:
    """nccl-tests' doc/PERFORMANCE.md: the bytes each rank's link carries per byte of the size."""
    if op == "all_reduce":  # a ring reduce-scatter then all-gather: 2 (n-1) chunks of size/n
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):  # n-1 of the n chunks leave / arrive
        return (n - 1) / n
    assert op == "collective_permute"  # the whole buffer to one peer
    return 1.0


@pytest.mark.parametrize("op", bc.COLLECTIVES)
def test_bus_factors_are_nccl_tests_definitions(op):
    """The row's columns from a known size and time, for group sizes 2 to 16."""
    collective = bc._collectives()[op]
    for n in (2, 3, 4, 8, 16):
        size, seconds = 48 * 2**20, 2.5e-3
        row = bc.bandwidths(collective, n, size, seconds)
        assert row["time_us"] == pytest.approx(2500.0)
        assert row["algbw_GBps"] == pytest.approx(48 * 2**20 / 2.5e-3 / 1e9)
        assert row["busbw_GBps"] == pytest.approx(48 * 2**20 / 2.5e-3 / 1e9 * nccl_tests_bus_factor(op, n)), n


def _bench(args, **kw):
    env = child_env()
    return subprocess.Popen([sys.executable, "-m", "jaxtrain.cli.bench", "collectives", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.end_to_end
def test_cli_table_json_and_plot_on_16_devices(tmp_path):
    proc = _bench(["--mesh", "data=4,tensor=4", "--sizes", "4k,64k", "--iters", "2", "--repeats", "1",
                   "--json", str(tmp_path / "rows.jsonl"), "--png", str(tmp_path / "busbw.png")])
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert {(r["axes"], r["op"]) for r in rows} == {(a, o) for a in ("data", "tensor", "data+tensor")
                                                   for o in bc.COLLECTIVES}
    assert len(rows) == 3 * 5 * 2 and all(r["busbw_GBps"] > 0 for r in rows)
    assert out.count("\n") >= len(rows) + 2  # header lines + a table row each
    assert (tmp_path / "busbw.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.multiprocess
@pytest.mark.end_to_end
def test_cli_across_two_processes(tmp_path):
    with reserved_port() as port:
        procs = [_bench(["--mesh", "data=4", "--ops", "all_reduce,all_gather", "--sizes", "4k", "--iters", "2",
                         "--repeats", "1", "--json", str(tmp_path / "rows.jsonl"),
                         f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={i}"])
                 for i in range(2)]
        try:
            outs = [p.communicate(timeout=300) for p in procs]
        finally:
            for p in procs:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(e[-2000:] for _, e in outs)
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [(r["axes"], r["op"], r["devices"]) for r in rows] == [("data", "all_reduce", 4), ("data", "all_gather", 4)]
    assert "2 process(es)" in outs[0][0] and "all_reduce" not in outs[1][0]  # only process 0 prints


@pytest.mark.slow  # starts the CLI's process per case: out of the edit-test lane
@pytest.mark.parametrize("args, message", [
    (["--mesh", "data=4,tensr=2"], "expected axis=size pairs"),
    (["--mesh", "data=4", "--axes", "tensor"], "tensor has size 1"),
    (["--mesh", "data=4", "--axes", "model"], "unknown mesh axis 'model'"),
    (["--mesh", "data=4", "--ops", "broadcast"], "--ops 'broadcast': choose from"),
    (["--mesh", "data=4", "--sizes", "12q"], "message size '12q'"),
])
def test_bad_input_is_one_line_exit_2(args, message):
    proc = _bench(args)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and message in err and err.strip().startswith("error:"), err[-2000:]

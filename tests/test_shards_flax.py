"""A version a TF1 graph partitioned 4 ways wrote, restored into a JAX job of 2 processes whose
arrays are sharded 2x2 (each process fetching only its devices' parts, counted at S3), and into
a PyTorch job of 2 ranks in its own sharding; and JAX's own shards published and read back."""

from __future__ import annotations

import os
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("s3fs")

from processes import fork_together, free_port  # noqa: E402

import weightstore as ws  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "weightstore-shards-flax"
ROWS, COLS = 1024, 768

#: what both processes import, once, in the interpreter they are forked from
JOB_IMPORTS = textwrap.dedent("""
    import jax, s3fs, torch, torch.distributed
    import weightstore.adapters.flax, weightstore.adapters.torch
""")

#: one process of a job of two that runs a JAX job, then a PyTorch one (each process forked from
#: one interpreter that imported both, rather than an interpreter per process and job).
#:
#: JAX: two CPU devices each, a 2x2 mesh over both processes. Restores the version into a pytree
#: whose kernel is sharded over both mesh axes and whose bias is replicated along one, saves each
#: local shard, then publishes the restored tree's own shards as step 2 (process 0 commits) for
#: the test to read whole. Then both processes meet at a barrier and process 0 writes a marker
#: object (``<folder>.between-jobs``): every S3 request the server recorded before the marker's
#: PUT is the JAX job's, every one after it the PyTorch job's (whose ranks start only once both
#: have joined its process group, after the marker).
#:
#: PyTorch: a module holding dense/kernel split by columns and dense/bias replicated, as DTensors
#: on a 2-rank CPU mesh; assigns the TF1 version and saves its local shards.
JOB = textwrap.dedent("""
    import sys
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import weightstore as ws
    from weightstore.adapters import flax as wf

    folder, process, jax_port, torch_port, out, tf1_version = sys.argv[1:7]
    process = int(process)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{jax_port}", num_processes=2, process_id=process)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
    grid, columns = NamedSharding(mesh, P("x", "y")), NamedSharding(mesh, P("y"))
    tree = {"dense": {"kernel": jax.make_array_from_callback((1024, 768), grid, lambda i: np.zeros((1024, 768),
                                                                                                 np.float32)[i]),
                      "bias": jax.make_array_from_callback((768,), columns, lambda i: np.zeros(768, np.float32)[i])}}
    restored = wf.restore(tree, ws.latest(folder))
    held = {}
    for key in ("kernel", "bias"):
        array = restored["dense"][key]
        assert array.sharding == tree["dense"][key].sharding, key
        for shard in array.addressable_shards:
            box = "_".join(f"{s.start or 0}-{s.stop if s.stop is not None else -1}" for s in shard.index)
            held[f"{key}|{box}"] = np.asarray(shard.data)
    pieces = wf.export_pieces({**restored, "steps": jax.numpy.arange(12.0).reshape(4, 3)})  # local to each process
    held["steps-rows"] = np.array([(piece.start[0], len(piece.array)) for piece in pieces["steps"]])
    np.savez(f"{out}-jax.npz", **held)
    ws.publish_shard(folder, pieces, step=2, rank=process, world=2, attempt=0)
    if process == 0:
        ws.commit_shards(folder, step=2, world=2, attempt=0, timeout=60)
    multihost_utils.sync_global_devices("the JAX job is done")
    # both leave the JAX cluster together: a process still in it when the other (the service's
    # host) ends aborts on the lost service
    jax.distributed.shutdown()
    if process == 0:
        import s3fs
        s3fs.S3FileSystem().pipe(folder + ".between-jobs", b"")

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from weightstore.adapters import torch as wt

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=process, world_size=2)
    dist.barrier()
    mesh = init_device_mesh("cpu", (2,))
    model = nn.Module()
    model.dense = nn.Module()
    model.dense.kernel = nn.Parameter(distribute_tensor(torch.zeros(1024, 768), mesh, [Shard(1)]))
    model.dense.bias = nn.Parameter(distribute_tensor(torch.zeros(768), mesh, [Replicate()]))
    wt.assign(model, tf1_version)  # the TF1 version, by its index's path
    np.savez(f"{out}-torch.npz", kernel=model.dense.kernel.to_local().detach().numpy(),
             bias=model.dense.bias.to_local().detach().numpy())
    dist.destroy_process_group()
""")


def run_job(server, tmp_path, folder, tf1_version):
    """Both processes of :data:`JOB`; what each saved from its JAX and its PyTorch job."""
    ports = (str(free_port()), str(free_port()))
    env = {**os.environ, **server.environment(), "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}  # two CPU devices in each process
    ranks = fork_together(JOB_IMPORTS, JOB, [[folder, str(rank), *ports, str(tmp_path / f"process{rank}"), tf1_version]
                                             for rank in range(2)], [env] * 2, timeout=240)
    for rank in ranks:
        assert rank.returncode == 0, (rank.stdout + rank.stderr)[-3000:]
    return [{job: dict(np.load(tmp_path / f"process{rank}-{job}.npz")) for job in ("jax", "torch")} for rank in range(2)]


def publish_from_tf1(folder):
    """A TF1 graph with dense/kernel partitioned 4 ways by rows; 4 ranks publish a part each."""
    tf = pytest.importorskip("tensorflow")
    v1 = tf.compat.v1
    from weightstore.adapters import tf1

    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(5)
        v1.get_variable("dense/kernel", [ROWS, COLS], partitioner=v1.fixed_size_partitioner(4, axis=0))
        v1.get_variable("dense/bias", [COLS], initializer=v1.random_normal_initializer())
        init = v1.global_variables_initializer()
    with v1.Session(graph=graph) as sess:
        sess.run(init)
        expected, pieces = tf1.export(sess), tf1.export_pieces(sess)
    for rank in range(4):
        held = {"dense/kernel": [pieces["dense/kernel"][rank]]}
        if rank == 3:
            held["dense/bias"] = pieces["dense/bias"]
        ws.publish_shard(folder, held, step=1, rank=rank, world=4, attempt=0)
    return ws.commit_shards(folder, step=1, world=4, attempt=0, timeout=30), expected


@pytest.mark.slow
def test_a_tf1_version_restores_into_jax_sharded_2x2_and_torch_dtensors(server, tmp_path):
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    version, expected = publish_from_tf1(folder)
    kernel, bias = expected["dense/kernel"], expected["dense/bias"]
    server.reset()
    saved = run_job(server, tmp_path, folder, version.path)
    marker = next(at for at, r in enumerate(server.requests) if r.method == "PUT" and r.path.endswith(".between-jobs"))
    fetched = sum(r.sent for r in server.requests[:marker]  # by the JAX job alone
                  if r.method == "GET" and "step-000000000001.attempt-0/rank-" in r.path)
    for process, shards in enumerate(process["jax"] for process in saved):
        kernels = {name: value for name, value in shards.items() if name.startswith("kernel|")}
        assert len(kernels) == 2  # this process's two devices: one quarter each
        for name, value in kernels.items():
            (r0, r1), (c0, c1) = (map(int, span.split("-")) for span in name.split("|")[1].split("_"))
            assert r0 == process * 512 and r1 - r0 == 512 and c1 - c0 == 384
            assert value.tobytes() == kernel[r0:r1, c0:c1].tobytes(), name
        for name, value in shards.items():
            if name.startswith("bias|"):
                (c0, c1), = (map(int, span.split("-")) for span in name.split("|")[1].split("_"))
                assert value.tobytes() == bias[c0:c1].tobytes()
        assert shards["steps-rows"].tolist() == [[process * 2, 2]]  # each writes half of a process-local array
    # each process fetched its half of the kernel: together about the kernel once, not twice
    assert kernel.nbytes <= fetched <= 1.1 * kernel.nbytes + 2 * bias.nbytes, fetched / kernel.nbytes
    with ws.open(ws.latest(folder)) as store:  # the JAX job's own shards, published and committed
        assert ws.latest(folder).step == 2
        assert store["dense/kernel"].tobytes() == kernel.tobytes() and store["dense/bias"].tobytes() == bias.tobytes()
        assert store["steps"].tobytes() == np.arange(12.0, dtype=np.float32).reshape(4, 3).tobytes()
    for rank, shards in enumerate(process["torch"] for process in saved):
        assert shards["kernel"].tobytes() == np.ascontiguousarray(kernel[:, rank * 384:(rank + 1) * 384]).tobytes()
        assert shards["bias"].tobytes() == bias.tobytes()


def test_export_pieces_of_one_process_and_restore_from_a_local_version(tmp_path):
    import jax
    import jax.numpy as jnp

    from weightstore.adapters import flax as wf

    tree = {"dense": {"kernel": jnp.arange(12.0).reshape(3, 4), "bias": np.arange(4, dtype=np.float32)}}
    pieces = wf.export_pieces(tree)  # one process: every array whole, at the origin
    assert {key: [p.start for p in found] for key, found in pieces.items()} == {"dense/kernel": [(0, 0)],
                                                                                 "dense/bias": [(0,)]}
    ws.publish_shard(tmp_path, pieces, step=1, rank=0, world=1, attempt=0)
    version = ws.commit_shards(tmp_path, step=1, world=1, attempt=0, timeout=10)
    zeros = jax.tree_util.tree_map(lambda leaf: leaf * 0, tree)
    restored = wf.restore(zeros, version)
    assert isinstance(restored["dense"]["kernel"], jax.Array) and isinstance(restored["dense"]["bias"], np.ndarray)
    assert np.asarray(restored["dense"]["kernel"]).tobytes() == np.asarray(tree["dense"]["kernel"]).tobytes()
    assert restored["dense"]["bias"].tobytes() == tree["dense"]["bias"].tobytes()
    # publish_sharded alone (one process) passes digests= on: a checkpoint no follower reads
    version = wf.publish_sharded(tmp_path / "run", tree, step=1, digests=False)
    with ws.open(version) as store:
        assert store.region_digest("dense/kernel", ()) is None
    restored = wf.restore(zeros, version)
    assert np.asarray(restored["dense"]["kernel"]).tobytes() == np.asarray(tree["dense"]["kernel"]).tobytes()

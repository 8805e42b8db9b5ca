"""PyTorch DTensor feeds: a 2-process gloo group on 127.0.0.1 publishes FSDP2-sharded parameters
and reads them back in a tensor-parallel sharding, each rank fetching only its shards (S3); DTensors
on submeshes; FSDP2 versions read by jobs of other world sizes. The jobs' ranks are one launch of
processes (:data:`JOBS`), whose results the tests check."""

from __future__ import annotations

import os
import textwrap
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.tensor")
pytest.importorskip("s3fs")

from processes import fork_together  # noqa: E402

import weightstore as ws  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "weightstore-shards-torch"

#: one of three processes that are, in turn, ranks of six jobs, each its own process group made
#: and destroyed in turn (``sys.argv``: rank, a folder for each job's output, the S3 folder, the
#: port of each job's TCPStore, which the test holds): one launch of processes serves them all, as
#: starting torch in each rank of each job cost most of these tests. A rank whose job raises prints
#: why and exits at once; its peers give up within 60 s (the process group's timeout), a rank still
#: to join its first job within 180 s. Ranks 0 and 1:
#: - "fsdp2-tp": build the model (same seed on both), shard it with FSDP2 and publish its shards
#:   to S3; rank 0 commits. Then both read the version into the same model laid out for tensor
#:   parallelism (first Linear by output rows, second by input columns, its bias replicated),
#:   and save what each holds, for the test to check against the model whole.
#: - "tp": a (dp=1, tp=2) mesh, the first Linear tensor parallel over "tp", the second, outside
#:   the plan, sharded by FSDP2 over "dp" alone, so both tp ranks hold its shard.
#: - "pp": a (pp=2, dp=1) mesh, each rank a pipeline stage of one Linear, sharded over its "dp":
#:   the same kind of DTensor, holding another layer on each rank.
#: Then three FSDP2 jobs, of all three: 2 ranks write step 2, 3 ranks read it and write step 3,
#: 2 ranks read that and write step 4. Each reads the latest version (if any) into its own
#: FSDP2-sharded model and checks every parameter whole against the model that wrote it (seed:
#: the writers' world), then publishes its own model's shards.
JOBS = textwrap.dedent("""
    import datetime, os, sys, traceback

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import weightstore as ws
    from weightstore.adapters import torch as wt

    rank, out, s3_folder, ports = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]

    def join(world, port):
        # every rank waits here for its peers, rank 2 for four jobs of ranks 0 and 1; then each
        # collective of the group waits at most 60 s
        store = dist.TCPStore("127.0.0.1", int(port), is_master=False, timeout=datetime.timedelta(seconds=180))
        store.set(f"arrived/{rank}", "")
        store.wait([f"arrived/{peer}" for peer in range(world)])
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))

    def fsdp2_read_tensor_parallel(folder):
        mesh = init_device_mesh("cpu", (2,))

        def model(seed):
            torch.manual_seed(seed)
            return nn.Sequential(nn.Linear(1024, 768), nn.ReLU(), nn.Linear(768, 1024), nn.BatchNorm1d(1024))

        writer = model(1)
        fully_shard(writer, mesh=mesh)
        pieces = wt.export_pieces(writer)
        ws.publish_shard(folder, pieces, step=1, rank=rank, world=2, attempt=0)
        if rank == 0:
            ws.commit_shards(folder, step=1, world=2, attempt=0, timeout=60)
        dist.barrier()
        reader = parallelize_module(model(2), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        report = wt.assign(reader, ws.latest(folder))
        held = {key: wt.to_numpy(wt._torch_shards.local_tensor(tensor), key)
                for key, tensor in wt.tensors(reader).items()}
        again = parallelize_module(model(3), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        wt.assign(again, ws.load(ws.latest(folder)))  # from a dict of whole tensors: each rank cuts its shard
        for key, tensor in wt.tensors(again).items():
            assert wt.to_numpy(wt._torch_shards.local_tensor(tensor), key).tobytes() == held[key].tobytes(), key
        held["pieces"] = np.array(sorted(pieces))
        held["assigned"] = np.array(sorted(report.assigned))
        from torch.distributed.tensor import DTensor, Partial

        summed = nn.Module()  # a DTensor of partial sums: no part of its value, refused naming the key
        summed.w = nn.Parameter(DTensor.from_local(torch.ones(2, 2), mesh, [Partial()]))
        try:
            wt.export_pieces(summed)
        except ws.TargetError as exc:
            assert exc.key == "w" and "partial sums" in str(exc), exc
        else:
            raise AssertionError("a Partial DTensor was exported")
        np.savez(f"{out}/fsdp2-tp/{rank}.npz", **{key.replace("/", "|"): value for key, value in held.items()})

    def two_d(layout):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4))
        if layout == "tp":
            mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
            model = parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
            fully_shard(model[1], mesh=mesh["dp"])
        else:
            mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
            model[1 - rank] = nn.Identity()  # this rank's stage keeps its layer's name
            fully_shard(model[rank], mesh=mesh["dp"])
        folder = f"{out}/{layout}"
        ws.publish_shard(folder, wt.export_pieces(model), step=1, attempt=0)
        dist.barrier()
        if rank == 0:
            ws.commit_shards(folder, step=1, attempt=0, timeout=30)

    def fsdp2_worlds(world, step):
        folder = f"{out}/worlds"

        def model(seed):
            torch.manual_seed(seed)
            return nn.Sequential(nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 5))

        mesh = init_device_mesh("cpu", (world,))
        before = ws.latest(folder)
        if before is not None:
            reader = model(0)
            fully_shard(reader, mesh=mesh)
            wt.assign(reader, before)
            written = model(before.step)  # the writers' seed is their world, which is their step
            for (name, mine), theirs in zip(reader.named_parameters(), written.parameters(), strict=True):
                assert mine.full_tensor().detach().numpy().tobytes() == theirs.detach().numpy().tobytes(), name
            print(f"world {world} read", before.step, flush=True)
        writer = model(world)
        fully_shard(writer, mesh=mesh)
        print(f"world {world} wrote", wt.publish_sharded(folder, writer, step=step, timeout=60).step, flush=True)

    jobs = [(2, lambda: fsdp2_read_tensor_parallel(s3_folder)), (2, lambda: two_d("tp")), (2, lambda: two_d("pp")),
            (2, lambda: fsdp2_worlds(2, 2)), (3, lambda: fsdp2_worlds(3, 3)), (2, lambda: fsdp2_worlds(2, 4))]
    for (world, job), port in zip(jobs, ports, strict=True):
        if rank < world:
            try:
                join(world, port)
                job()
                dist.destroy_process_group()
            except BaseException:  # not the interpreter's exit, which can wait on the group's peers
                traceback.print_exc()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
""")


@pytest.fixture(scope="module")
def jobs(server, tmp_path_factory):
    """The three processes of :data:`JOBS`, run once for the module's tests (``./tasks test`` gives
    a file's tests to one worker): what each printed, the folder of each job's output, the S3
    folder, and the bytes of members the S3 readers fetched."""
    out = tmp_path_factory.mktemp("jobs")
    (out / "fsdp2-tp").mkdir()
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    server.reset()
    env = {**os.environ, **server.environment(), "PYTHONPATH": str(ROOT)}
    # each job's store, listening before the launch starts: a port picked early could be taken
    stores = [torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(6)]
    ports = [str(store.port) for store in stores]
    # forked from one interpreter that imported torch and weightstore: a rank's import of them each
    ranks = fork_together("import numpy, torch, torch.distributed, weightstore", JOBS,
                          [[str(rank), str(out), folder, *ports] for rank in range(3)],
                          [env] * 3, timeout=240)  # within pytest's 300 s, which counts this fixture
    for rank in ranks:
        assert rank.returncode == 0, (rank.stdout + rank.stderr)[-3000:]
    fetched = sum(r.sent for r in server.requests if r.method == "GET" and r.path.endswith(".safetensors"))
    return SimpleNamespace(said=[rank.stdout.splitlines() for rank in ranks], out=out, folder=folder, fetched=fetched)


def test_fsdp2_shards_published_by_two_ranks_read_back_tensor_parallel(jobs):
    held = [{key.replace("|", "/"): value for key, value in np.load(jobs.out / "fsdp2-tp" / f"{rank}.npz").items()}
            for rank in range(2)]
    with ws.open(ws.latest(jobs.folder)) as store:
        whole = {key: store[key] for key in store}
    torch.manual_seed(1)  # the writers' model, whole
    model = torch.nn.Sequential(torch.nn.Linear(1024, 768), torch.nn.ReLU(), torch.nn.Linear(768, 1024),
                                torch.nn.BatchNorm1d(1024))
    expected = {key.replace(".", "/"): value.detach().numpy() for key, value in model.state_dict().items()}
    assert sorted(whole) == sorted(expected)
    for key, value in expected.items():
        assert whole[key].tobytes() == value.tobytes(), key
    for rank in range(2):
        assert sorted(held[rank]["assigned"]) == sorted(expected)
        assert set(held[rank]["pieces"]) >= {"0/weight", "0/bias", "2/weight", "2/bias"}  # FSDP2: every rank a shard
        rows, cols = slice(rank * 384, rank * 384 + 384), slice(rank * 384, rank * 384 + 384)
        assert held[rank]["0/weight"].tobytes() == expected["0/weight"][rows].tobytes()
        assert held[rank]["0/bias"].tobytes() == expected["0/bias"][rows].tobytes()
        assert held[rank]["2/weight"].tobytes() == expected["2/weight"][:, cols].tobytes()
        assert held[rank]["2/bias"].tobytes() == expected["2/bias"].tobytes()  # replicated: each rank whole
        assert held[rank]["3/running_var"].tobytes() == expected["3/running_var"].tobytes()
    # the two readers together fetched each sharded byte once: their shards, not the whole model
    # twice (then each loaded the version whole, for the assign from a dict: the model's bytes)
    fetched = jobs.fetched - 2 * sum(value.nbytes for value in expected.values())
    sharded = sum(expected[key].nbytes for key in ("0/weight", "0/bias", "2/weight"))
    replicated = sum(value.nbytes for key, value in expected.items() if key not in ("0/weight", "0/bias", "2/weight"))
    assert sharded <= fetched <= 1.1 * sharded + 2 * replicated, fetched / sharded


def test_export_pieces_of_plain_tensors_splits_rows_between_ranks():
    model = torch.nn.Linear(6, 5)
    whole = {key.replace(".", "/"): value.detach().numpy() for key, value in model.state_dict().items()}
    from weightstore.adapters import torch as wt

    alone = wt.export_pieces(model)  # no process group: one rank holds and writes everything
    assert {key: [(p.start, np.asarray(p.array).tobytes()) for p in pieces] for key, pieces in alone.items()} == {
        key: [((0,) * value.ndim, value.tobytes())] for key, value in whole.items()}
    halves = [wt.export_pieces(model, rank=rank, world=2) for rank in range(2)]
    assert [[p.start for p in part["weight"]] for part in halves] == [[(0, 0)], [(2, 0)]]
    assert np.concatenate([part["weight"][0].array for part in halves]).tobytes() == whole["weight"].tobytes()
    assert [part["bias"][0].shape for part in halves] == [(5,), (5,)]


def test_publish_sharded_alone_without_digests_reads_back_bit_exact(tmp_path):
    """``digests=False`` reaches the member: a checkpoint no follower reads, its blocks still
    verified as read, its regions without a digest; the module restores bit-exact."""
    from weightstore.adapters import torch as wt

    model = torch.nn.Linear(6, 5)
    version = wt.publish_sharded(tmp_path / "run", model, step=1, digests=False)
    with ws.open(version) as store:
        assert store.region_digest("weight", ()) is None
    restored = torch.nn.Linear(6, 5)
    wt.assign(restored, version)
    assert all(torch.equal(restored.state_dict()[key], value) for key, value in model.state_dict().items())


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_a_dtensor_on_a_submesh_is_published_whole_once(jobs, layout):
    """Tensor parallelism's copies of a submesh hold one shard alike (written by each, kept once);
    pipeline stages on one hold other layers (each must be written: a rule keeping one copy of
    the submesh left every stage but the first out of the version)."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
    loaded = ws.load(ws.latest(jobs.out / layout))
    assert {key: value.tobytes() for key, value in loaded.items()} == {
        key.replace(".", "/"): value.detach().numpy().tobytes() for key, value in model.state_dict().items()}


@pytest.mark.slow
def test_fsdp2_versions_of_two_ranks_read_by_three_and_of_three_by_two_bit_exact(jobs):
    """FSDP2 writers of one world size, readers of another (uneven shards: 5 rows over 2 and 3
    ranks), every parameter bit-exact: 2 ranks write step 2, 3 read it and write step 3, 2 read it."""
    both = ["world 2 wrote 2", "world 3 read 2", "world 3 wrote 3", "world 2 read 3", "world 2 wrote 4"]
    assert jobs.said == [both, both, ["world 3 read 2", "world 3 wrote 3"]], jobs.said

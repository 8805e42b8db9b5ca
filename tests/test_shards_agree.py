"""What a job's ranks agree on through its own store: the attempt, the launch (incarnation), and
the committed version every rank returns; with real processes on 127.0.0.1 (gloo, torchrun,
jax.distributed)."""

from __future__ import annotations

import os
import re
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from processes import fork_together, free_port, run_together

import weightstore as ws
from weightstore.formats._sharded_index import parse_done

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


def job_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **extra}
    env.pop("TF_CONFIG", None)
    return env


#: the two processes of a 2-rank gloo job, which are, in turn, the ranks of five launches of it
#: (``sys.argv``: rank, a folder for the launches' folders, and the ports of TCPStores the test
#: holds, one for each of the first four launches and one for the last two); each of the first
#: four is its own process group (a new store: a new incarnation), made and destroyed in turn, as
#: starting torch in each rank of each launch cost most of these tests. A rank whose launch raises
#: prints why and exits at once; its peer gives up in 60 s. Each line printed starts with the
#: launch's name:
#: - "one-call": a publish in one call, in the background, one a rank's write refuses, one of a
#:   step LATEST passed;
#: - "keys": 6 steps in one call each, rank 0 printing the store's keys after each;
#: - "zombie", then "replacement": a launch preempted while its rank 1 still writes step 5, and
#:   the one replacing it, writing step 5 at the same attempt;
#: - "first", then "second": ranks whose job store is a TCPStore that outlives them, as torchrun's
#:   agent's does, learning each launch's incarnation through it (the second's rank 0 comes late).
JOBS = textwrap.dedent("""
    import datetime, os, sys, time, traceback
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn
    import weightstore as ws
    from weightstore.adapters import torch as wt
    from weightstore.formats._sharded_index import parse_done
    from weightstore.sharded import _agree, _cluster, _shards

    rank, out, ports, store_port = int(sys.argv[1]), sys.argv[2], sys.argv[3:7], int(sys.argv[7])

    def say(launch, what, value):
        print(f"{launch} {what}: {value}", flush=True)

    def outcome(call):
        try:
            found = call()
            return f"{found.step} {found.path.rsplit('/', 1)[-1]}"
        except ws.WeightStoreError as exc:
            return f"{type(exc).__name__}: {exc}"

    def one_call(folder):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 8))
        say("one-call", "one call", outcome(lambda: wt.publish_sharded(folder, model, step=1, timeout=30)))
        with torch.no_grad():
            model[0].weight.add_(1)
        future = wt.publish_sharded(folder, model, step=2, timeout=30, background=True)
        with torch.no_grad():
            model[0].weight.add_(1)  # after the snapshot: the version holds the values at the call
        say("one-call", "background", outcome(future.result))
        pieces = {"w": np.ones(3)} if rank == 0 else {"not a key/": np.ones(3)}
        say("one-call", "refused", outcome(lambda: _shards.publish_together(folder, pieces, step=3, timeout=600)))
        say("one-call", "behind", outcome(lambda: wt.publish_sharded(folder, model, step=2, timeout=600)))

    def many_steps(folder):
        store = dist.distributed_c10d._get_default_store()
        kernel = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
        for step in range(1, 7):
            piece = {"k": _shards.Piece(kernel[rank * 4:rank * 4 + 4] + step, (rank * 4, 0), (8, 3))}
            _shards.publish_together(folder, piece, step=step, timeout=60)
            if rank == 0:
                say("keys", "keys", store.num_keys())
        dist.barrier()

    def launch(folder, role):
        kernel = np.arange(8 * 3, dtype=np.float32).reshape(8, 3) + (100 if role == "zombie" else 0)
        mine = {"k": ws.Piece(kernel[rank * 4:rank * 4 + 4], (rank * 4, 0), (8, 3))}
        say(role, "incarnation", ws.sharded.job_incarnation())
        if role == "zombie":
            ws.publish_shard(folder, mine, step=4, attempt=0)
            if rank == 0:
                ws.commit_shards(folder, step=4, attempt=0, timeout=60)
            dist.barrier()
            if rank == 1:  # rank 0 is preempted before step 5; this one still writes it, as the README once said
                ws.publish_shard(folder, mine, step=5, attempt=0)
                with open(f"{folder}/step-000000000005.attempt-0/rank-00001.done", "rb") as done:  # before the retry removes it
                    say(role, "done-record of", parse_done(done.read()).incarnation)
            return
        flag = os.path.join(os.path.dirname(folder), "refused")
        if rank == 0:  # the replacement, also at attempt 0 of step 5: rank 1's member is the zombie's
            ws.publish_shard(folder, mine, step=5, attempt=0)
            try:
                ws.commit_shards(folder, step=5, attempt=0, timeout=60)
            except ws.PublishError as exc:
                say(role, "refused", exc)
            open(flag, "w").close()
        else:
            while not os.path.exists(flag):
                time.sleep(0.05)
        ws.publish_shard(folder, mine, step=5)  # agreed: above every attempt the folder holds
        if rank == 0:
            say(role, "committed", ws.commit_shards(folder, step=5, timeout=60).path)

    def store_launch(name, delay):
        time.sleep(delay)
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=60))
        channel = object.__new__(_cluster._TorchChannel)
        channel.store, channel.owner, channel.timeout_error = store, store, dist.DistStoreError
        say(name, "incarnation", _agree.incarnation(channel, rank, 2, timeout=60))

    def launches():
        for (name, job), port in zip([("one-call", one_call), ("keys", many_steps), ("zombie", launch),
                                      ("replacement", launch)], ports, strict=True):
            store = dist.TCPStore("127.0.0.1", int(port), is_master=False, timeout=datetime.timedelta(seconds=60))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
            if job is launch:
                launch(f"{out}/launches/run", name)
            else:
                job(f"{out}/{name}")
            dist.destroy_process_group()
        store_launch("first", 0)
        store_launch("second", 2 if rank == 0 else 0)  # rank 1 reads the store while it holds only the first's keys

    try:
        launches()
    except BaseException:  # not the interpreter's exit, which can wait on the group's peer
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
""")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The two processes of :data:`JOBS`, run once for the module's tests (``./tasks test`` gives
    a file's tests to one worker): the folder of the launches' folders, and what each launch's
    ranks said (``said[launch][rank][what]``)."""
    out = tmp_path_factory.mktemp("jobs")
    (out / "launches").mkdir()
    # every store listening before the launch starts: a port picked early could be taken
    stores = [torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(5)]
    # forked from one interpreter that imported torch and weightstore: not a rank's import of them each
    ranks = fork_together("import numpy, torch, torch.distributed, weightstore", JOBS,
                          [[str(rank), str(out), *(str(store.port) for store in stores)] for rank in range(2)],
                          [job_env()] * 2, timeout=240)
    assert [rank.returncode for rank in ranks] == [0, 0], [rank.stderr[-3000:] for rank in ranks]
    said: dict[str, list[dict[str, list[str]]]] = {}
    for at, rank in enumerate(ranks):
        for line in rank.stdout.splitlines():  # "launch what: value"; any other line (a library's) is skipped
            if (said_line := re.fullmatch(r"(\S+) ([^:]+): (.*)", line)) is not None:
                launch, what, value = said_line.groups()
                said.setdefault(launch, [{}, {}])[at].setdefault(what, []).append(value)
    return SimpleNamespace(out=out, said=said)


def test_one_call_on_every_torch_rank_returns_the_committed_version_or_the_same_error(jobs):
    folder = jobs.out / "one-call"
    said = [{what: values[0] for what, values in rank.items()} for rank in jobs.said["one-call"]]
    assert said[0]["one call"] == said[1]["one call"] == "1 step-000000000001.wsindex"
    assert said[0]["background"] == said[1]["background"] == "2 step-000000000002.wsindex"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 8))
    assert np.array_equal(ws.load(ws.latest(folder))["0/weight"], model[0].weight.detach().numpy() + 1)  # the snapshot
    # a rank whose write is refused tells rank 0, whose commit stops at once, naming it
    assert said[0]["refused"].startswith("PublishError: ") and "rank 1 of 2 gave up: InvalidKeyError" in said[0]["refused"]
    assert said[1]["refused"].startswith("InvalidKeyError")
    # a step LATEST already passed: refused on every rank alike, at once (timeout=600 was not waited)
    assert said[0]["behind"] == said[1]["behind"]
    assert said[0]["behind"].startswith("PublishError: ") and "is not after step 2, which LATEST names" in said[0]["behind"]
    assert ws.latest(folder).step == 2


#: one process of a 2-process jax.distributed job
JAX_CALL = textwrap.dedent("""
    import os, sys
    import jax
    import numpy as np
    import weightstore as ws
    from weightstore.adapters import flax as wf

    folder = sys.argv[1]
    jax.distributed.initialize(os.environ["COORDINATOR"], num_processes=2, process_id=int(sys.argv[2]))
    tree = {"dense": {"kernel": np.arange(40 * 6, dtype=np.float32).reshape(40, 6), "bias": np.ones(6, np.float32)}}
    from jax._src import distributed
    for step in (1, 2, 3):
        version = wf.publish_sharded(folder, tree, step=step, timeout=30, background=step == 2)
        version = version.result() if step == 2 else version
        print("version:", version.step, version.path.rsplit("/", 1)[-1])
        if sys.argv[2] == "0":  # the store's keys: those of committed steps deleted
            print("keys:", len(distributed.global_state.client.key_value_dir_get("weightstore/")), flush=True)
    jax.distributed.shutdown()
""")


def test_one_call_on_every_jax_process_returns_the_committed_version(tmp_path):
    folder, port = tmp_path / "run", free_port()
    procs = fork_together("import numpy, jax, weightstore", JAX_CALL, [[str(folder), str(rank)] for rank in range(2)],
                          [job_env(COORDINATOR=f"127.0.0.1:{port}")] * 2, timeout=120)
    assert [proc.returncode for proc in procs] == [0, 0], [proc.stderr[-3000:] for proc in procs]
    lines = [[line for line in proc.stdout.splitlines() if line.startswith("version:")] for proc in procs]
    assert lines[0] == lines[1] == [f"version: {step} step-00000000000{step}.wsindex" for step in (1, 2, 3)]
    keys = [line for line in procs[0].stdout.splitlines() if line.startswith("keys:")]
    assert len(keys) == 3 and keys[1] == keys[2] and int(keys[2].split()[-1]) >= 3, keys  # the launch's hellos stay
    loaded = ws.load(ws.latest(folder))
    assert loaded["dense/kernel"].tobytes() == np.arange(240, dtype=np.float32).tobytes()
    attempt = folder / "step-000000000003.attempt-0"
    records = [parse_done((attempt / f"rank-0000{rank}.done").read_bytes()) for rank in range(2)]
    assert records[0].incarnation and records[0].incarnation == records[1].incarnation


def test_a_zombie_and_its_replacement_writing_one_step_are_refused_naming_both_launches(jobs):
    folder = jobs.out / "launches" / "run"

    def drawn(launch):
        incarnations = {rank["incarnation"][0] for rank in jobs.said[launch]}
        assert len(incarnations) == 1  # every rank of a launch has its incarnation
        return incarnations.pop()

    theirs, ours = drawn("zombie"), drawn("replacement")
    assert jobs.said["zombie"][1]["done-record of"] == [theirs]
    assert ours != theirs
    refusal = jobs.said["replacement"][0]["refused"][0]
    assert f"rank 1's done-record is of job incarnation {theirs}, rank 0's of {ours}" in refusal, refusal
    assert "step 5 attempt 0" in refusal
    # the retry the error asks for: the store agrees attempt 1, whose members are all the replacement's
    assert jobs.said["replacement"][0]["committed"][0].endswith("step-000000000005.wsindex")
    assert ws.latest(folder).step == 5
    assert ws.load(ws.latest(folder))["k"].tobytes() == np.arange(24, dtype=np.float32).tobytes()
    attempt = folder / "step-000000000005.attempt-1"
    assert [parse_done((attempt / f"rank-0000{rank}.done").read_bytes()).incarnation for rank in range(2)] == [ours] * 2
    assert not (folder / "step-000000000005.attempt-0").exists()


def test_a_commit_whose_step_latest_passed_fails_at_once_naming_it(tmp_path):
    folder = tmp_path / "run"
    ws.publish(folder, {"k": np.zeros(4)}, step=1)
    ws.publish_shard(folder, {"k": ws.Piece(np.zeros(2), (0,), (4,))}, step=3, rank=0, world=2, attempt=0)
    ws.publish(folder, {"k": np.ones(4)}, step=7)  # another launch moved on while rank 1 is still to write
    started = time.monotonic()
    with pytest.raises(ws.PublishError, match="step 3 is not after step 7, which LATEST names"):
        ws.commit_shards(folder, step=3, world=2, attempt=0, timeout=600)
    # and while it waits for a rank: LATEST passes it, and the wait ends, not at its timeout
    ws.publish_shard(folder, {"k": ws.Piece(np.zeros(2), (0,), (4,))}, step=9, rank=0, world=2, attempt=0)
    failed: list[BaseException] = []
    waiting = threading.Thread(target=lambda: failed.extend(_raised(folder)))
    waiting.start()
    time.sleep(0.5)
    ws.publish(folder, {"k": np.ones(4)}, step=10)
    waiting.join(120)
    assert not waiting.is_alive() and time.monotonic() - started < 120
    assert len(failed) == 1 and "step 9 is not after step 10, which LATEST names" in str(failed[0])
    assert ws.latest(folder).step == 10


def _raised(folder: Path) -> list[BaseException]:
    try:
        ws.commit_shards(folder, step=9, world=2, attempt=0, timeout=600)
    except ws.PublishError as exc:
        return [exc]
    return []


#: one rank under torchrun: publishes steps until LATEST reaches 3 (resuming after LATEST on a
#: restart); in the first launch, rank 1 is SIGKILLed just before its step-2 publish
TORCHRUN = textwrap.dedent("""
    import os, signal, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    import weightstore as ws
    from weightstore.adapters import torch as wt

    folder, flag = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    latest = ws.latest(folder)
    for step in range((latest.step if latest else 0) + 1, 4):
        torch.manual_seed(step)
        model = nn.Linear(32, 16)
        if step == 2 and rank == 1 and not os.path.exists(flag):
            open(flag, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        version = wt.publish_sharded(folder, model, step=step, timeout=40)
        print(f"rank {rank} restart {os.environ['TORCHELASTIC_RESTART_COUNT']} step {step}: {version.path}",
              flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_torchrun_two_nodes_a_killed_rank_and_a_restart_end_in_one_version_every_rank_agrees_on(tmp_path):
    """Two torchrun agents (2 nodes x 1 rank) on 127.0.0.1. After rank 1 is killed, its node's
    agent restarts its worker with TORCHELASTIC_RESTART_COUNT 1, the other node's with 0 (it
    did not fail): the attempt comes from the store, so they agree. The c10d rendezvous gives
    each launch a fresh TCPStore (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): gloo itself cannot
    rendezvous again through the agent's shared store, which keeps the dead launch's keys."""
    folder, flag, port = tmp_path / "run", tmp_path / "killed", free_port()
    script = tmp_path / "rank.py"
    script.write_text(TORCHRUN)
    env = job_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    nodes = run_together([[sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                           "--nproc-per-node=1", "--max-restarts=2", "--rdzv-backend=c10d",
                           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=agree", "--monitor-interval=0.5",
                           str(script), str(folder), str(flag)] for node in range(2)], [env] * 2, timeout=150)
    assert [node.returncode for node in nodes] == [0, 0], [node.stderr[-4000:] for node in nodes]
    assert flag.exists()
    said = [line for node in nodes for line in node.stdout.splitlines() if line.startswith("rank ")]
    final = {}
    for line in said:
        head, path = line.split(": ")
        _, rank, _, restart, _, step = head.split()
        final.setdefault(int(step), {})[int(rank)] = (int(restart), path)
    assert sorted(final[3]) == [0, 1], said  # every rank of the last launch returned step 3
    assert len({path for _, path in final[3].values()}) == 1 and ws.latest(folder).step == 3
    restarts = {rank: restart for rank, (restart, _) in final[3].items()}
    # the killed rank's node counted a restart, the other did not: TORCHELASTIC_RESTART_COUNT disagrees
    assert (restarts[0], restarts[1]) == (0, 1), said
    assert {path for _, path in final[2].values()} == {str(folder / "step-000000000002.wsindex")}
    # one attempt folder a step: the dead try's, if it left one, went with the commit of its step
    assert sorted(p.name.split(".")[0] for p in folder.iterdir() if ".attempt-" in p.name) == [
        f"step-{step:012d}" for step in (1, 2, 3)]
    torch.manual_seed(3)
    model = torch.nn.Linear(32, 16)
    assert np.array_equal(ws.load(ws.latest(folder))["weight"], model.weight.detach().numpy())


def test_a_store_that_outlives_a_launch_never_gives_the_next_launch_the_old_incarnation(jobs):
    """torchrun's agent keeps its TCPStore across the launches it restarts, with the keys the
    dead launch's ranks left. The next launch's rank 1 starts well before its rank 0,
    and still learn the new incarnation, never the one the store holds."""
    first, second = ({rank["incarnation"][0] for rank in jobs.said[launch]} for launch in ("first", "second"))
    assert len(first) == len(second) == 1, (first, second)
    assert second != first


def test_two_launches_whose_rank_0s_read_the_folder_at_once_claim_different_attempts(tmp_path, monkeypatch):
    """Both read the folder before either wrote (next_attempt says 0 to both): the create-only
    claim gives the first attempt 0 and the second attempt 1, so neither's members mix."""
    from weightstore.io.folders import folder_for
    from weightstore.sharded import _shards as shards

    target = folder_for(tmp_path / "run")
    monkeypatch.setattr(shards, "next_attempt", lambda *args, **kwargs: 0)  # the moment both read it
    assert shards.claimed_attempt(target, 5, "zombie0001") == 0
    assert shards.claimed_attempt(target, 5, "replacement") == 1
    assert (tmp_path / "run" / "step-000000000005.attempt-0" / "claimed-by").read_text() == "zombie0001"
    assert (tmp_path / "run" / "step-000000000005.attempt-1" / "claimed-by").read_text() == "replacement"
    monkeypatch.undo()
    assert shards.claimed_attempt(target, 5, "replacement", least=1) == 2  # a retry: above what the folder holds


def test_the_keys_of_committed_steps_leave_the_job_store(jobs):
    """Each publish meets at keys of its own in the job's store; rank 0 deletes them once no rank
    reads them again, so the store of a job of many steps holds one step's keys, not all."""
    keys = [int(value) for value in jobs.said["keys"][0]["keys"]]
    assert len(keys) == 6 and keys[1:] == [keys[1]] * 5, keys  # two keys a step before
    folder = jobs.out / "keys"
    assert ws.load(ws.latest(folder))["k"].tobytes() == (np.arange(24, dtype=np.float32).reshape(8, 3) + 6).tobytes()

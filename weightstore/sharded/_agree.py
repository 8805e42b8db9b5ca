"""What the ranks of a job agree on through its own store: the launch they belong to, and the attempt.

Nothing here is read from a node's environment. ``torchrun`` counts restarts per node, so after
one node restarts its workers ``TORCHELASTIC_RESTART_COUNT`` differs between ranks; the
attempt and the job's incarnation are instead *agreed* through the job's key-value store
(:func:`weightstore.sharded._cluster.channel`: ``torch.distributed``'s c10d store,
``jax.distributed``'s coordination service).

**The incarnation** is drawn once per launch, by rank 0, and learnt by every other rank the
first time it publishes. Under ``torchrun`` the store may outlive a launch (the agent's
``TCPStore`` keeps the keys of the workers it restarted), so a key another launch left must
never be taken for this launch's. Each rank therefore says hello with a nonce of its own
(``weightstore/hello/<rank>``); rank 0 answers every nonce it reads with its incarnation
(``weightstore/welcome/<nonce>``), and keeps answering until every rank has said it joined
(``weightstore/joined/<incarnation>/<rank>``). A rank only believes an answer to its own fresh
nonce, which only a live rank 0 can have written, so a stale key is never believed; rank 0
only stops once each rank holds its answer. Every done-record carries the incarnation, and a
commit refuses members of another (a preempted job's zombie and its replacement both writing
one step).

**The attempt** of each publish is handed out by rank 0 (one above every attempt the folder
holds of the step, and above any it handed out before, that it claims: see
:func:`weightstore.sharded._shards.claimed_attempt`) at keys unique to the incarnation,
the folder, the step and the call (each process counts its calls of a folder and step, as
every rank makes them alike): ``weightstore/<incarnation>/<folder digest>/step-<n>/call-<i>/…``.
The same keys carry a rank's word that it gave up (so rank 0's commit stops at once) and rank
0's news of the commit (the committed version, or the error every rank then raises).

**Keys are deleted** once no rank reads them again, so a job of 100,000 steps holds a few keys,
not 300,000 (:meth:`Meeting.sweep`): when rank 0's commit has every rank's done-record, each rank
has read that call's attempt (it wrote its member in that attempt's folder) and the news of
every call before (a rank makes its calls one after another: it heard the last commit's news
before it wrote this member), so rank 0 deletes this call's attempt and every key of the calls
before; this call's news goes at the next such commit.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from weightstore import errors
from weightstore.errors import PublishError, ShardTimeoutError, WeightStoreError
from weightstore.sharded import _cluster as cluster
from weightstore.sharded._cluster import Channel

__all__ = ["job_incarnation", "incarnation", "Meeting", "handed_out", "news_of", "told", "AGREE_TIMEOUT"]

#: how long a rank waits for the others when it learns the incarnation, and for rank 0's
#: attempt, unless the caller bounds it
AGREE_TIMEOUT = 600.0
_POLL = 0.5
#: per job store (its owner's id) and world: the owner (kept, so its id is not reused) and the incarnation
_incarnations: dict[tuple[int, int], tuple[Any, str]] = {}
#: the incarnation of this process's versions of one rank
_alone: str | None = None
#: per (incarnation, folder, step): calls this process made
_calls: dict[tuple[str, str, int], int] = {}
#: per (folder, step): the last meeting at which this process handed out an attempt as rank 0
_handed_out: dict[tuple[str, int], Meeting] = {}
#: meetings at which this process was rank 0, whose keys are not deleted yet (:meth:`Meeting.sweep`)
_unswept: list[Meeting] = []
_lock = threading.Lock()


def incarnation(channel: Channel, rank: int, world: int, timeout: float = AGREE_TIMEOUT) -> str:
    """This launch's incarnation, the same on every rank: drawn by rank 0 the first time, learnt
    by the others through ``channel`` (see above), then remembered for the store's life.

    Raises:
        ShardTimeoutError: a rank (``.missing``) did not take part within ``timeout`` seconds.
        WeightStoreError: the store was lost.
    """
    global _alone
    with _lock:
        if world == 1:  # a rank that writes a version alone meets no one: its own, drawn once
            _alone = _alone or secrets.token_hex(8)
            return _alone
        known = _incarnations.get((id(channel.owner), world))
        if known is not None and known[0] is channel.owner:
            return known[1]
        found = _lead(channel, world, timeout) if rank == 0 else _join(channel, rank, timeout)
        _incarnations[(id(channel.owner), world)] = (channel.owner, found)
        return found


def _lead(channel: Channel, world: int, timeout: float) -> str:
    drawn = secrets.token_hex(8)
    deadline = time.monotonic() + timeout
    answered: set[str] = set()
    waiting = set(range(1, world))
    pause = 0.01
    while waiting:
        for rank in sorted(waiting):
            if channel.peek(f"weightstore/joined/{drawn}/{rank}") is not None:
                waiting.discard(rank)
                continue
            nonce = channel.peek(f"weightstore/hello/{rank}")
            if nonce is not None and nonce not in answered:  # a stale nonce's answer is never read
                channel.set(f"weightstore/welcome/{nonce}", drawn)
                answered.add(nonce)
        if not waiting:
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            shown = ", ".join(map(str, sorted(waiting)[:20])) + (" …" if len(waiting) > 20 else "")
            raise ShardTimeoutError(f"rank{'s' if len(waiting) > 1 else ''} {shown} of {world} did not join this "
                                    f"launch's first publish within {timeout:g}s (through {channel.source}); nothing "
                                    "was published", missing=sorted(waiting))
        time.sleep(min(pause, remaining))
        pause = min(pause * 2, _POLL)
    return drawn


def _join(channel: Channel, rank: int, timeout: float) -> str:
    nonce = secrets.token_hex(8)
    channel.set(f"weightstore/hello/{rank}", nonce)
    drawn = channel.get(f"weightstore/welcome/{nonce}", timeout)
    if drawn is None:
        raise ShardTimeoutError(f"rank 0 did not answer rank {rank}'s hello within {timeout:g}s (through "
                                f"{channel.source}); nothing was published", missing=[0])
    channel.set(f"weightstore/joined/{drawn}/{rank}", "1")
    return drawn


def job_incarnation(timeout: float = AGREE_TIMEOUT) -> str:
    """This launch's incarnation, as every rank of it has it: agreed through the job's store the
    first time (every rank must call this, or publish, for any to return); ``""`` in a process
    with no job store (no ``torch.distributed`` process group, no ``jax.distributed``).

    Raises:
        ShardTimeoutError: a rank did not take part within ``timeout`` seconds.
    """
    channel = cluster.channel()
    if channel is None:
        return ""
    found = cluster.membership()
    return incarnation(channel, found.rank, found.world, timeout)


def handed_out(where: str, step: int) -> Meeting | None:
    """The last meeting at which this process handed out an attempt (``.chosen``) as rank 0 for
    ``step`` of the folder at ``where``: what a coordinator in the same process commits."""
    with _lock:
        return _handed_out.get((where, step))


class Meeting:
    """The keys one publish of a step meets at (see above); ``alone`` for a job of one rank."""

    def __init__(self, channel: Channel | None, incarnation: str, where: str, step: int, rank: int,
                 world: int) -> None:
        self.channel, self.incarnation, self.where = channel, incarnation, where
        self.step, self.rank, self.world = step, rank, world
        self.chosen: int | None = None  # the attempt agreed
        place = (incarnation, where, step)
        with _lock:
            call = _calls.get(place, 0)
            _calls[place] = call + 1
        digest = hashlib.sha256(where.encode()).hexdigest()[:16]
        self.prefix = f"weightstore/{incarnation}/{digest}/step-{step}/call-{call}"
        if rank == 0 and channel is not None:
            with _lock:
                _unswept.append(self)

    def attempt(self, claim: Callable[[int], int], timeout: float) -> int:
        """Rank 0 hands out the attempt (``claim(least)``: the first this launch claims at or
        above ``least``, which is above any it handed out of this step before); the others wait
        for it up to ``timeout`` seconds.

        Raises:
            ShardTimeoutError: rank 0 said nothing in time.
            PublishError: rank 0 failed to choose one (its error given), or writes for another world.
        """
        if self.rank == 0:
            try:
                before = handed_out(self.where, self.step)
                chosen = claim(0 if before is None or before.chosen is None else before.chosen + 1)
            except Exception as exc:
                self.tell("attempt", news_of(exc))
                raise
            self.tell("attempt", {"attempt": chosen, "world": self.world})
            self.chosen = chosen
            with _lock:
                _handed_out[(self.where, self.step)] = self
            return chosen
        news = self.hear("attempt", timeout, "the attempt")
        if news.get("world") != self.world:
            self.give_up(f"it writes for {self.world} ranks, rank 0 for {news.get('world')}")
            raise PublishError(f"rank 0 writes for {news.get('world')} ranks, this rank for {self.world}",
                               path=self.where)
        self.chosen = int(news["attempt"])
        return self.chosen

    def sweep(self) -> None:
        """Rank 0, once its commit of this call has every rank's done-record: delete the keys no
        rank reads again (this call's attempt and word of giving up, every key of this launch's
        calls before it; see above). A store that refuses leaves them, never failing the commit."""
        if self.channel is None or self not in _unswept:
            return
        with _lock:
            at = _unswept.index(self)
            before = [meeting for meeting in _unswept[:at] if meeting.channel is not None
                      and meeting.channel.owner is self.channel.owner]  # of a store gone: dropped unswept
            del _unswept[:at]
        keys = [f"{meeting.prefix}/{what}" for meeting in before for what in ("attempt", "gave-up", "committed")]
        keys += [f"{self.prefix}/attempt", f"{self.prefix}/gave-up"]
        with contextlib.suppress(WeightStoreError):
            for key in keys:
                self.channel.delete(key)

    def tell(self, what: str, news: Mapping[str, Any]) -> None:
        if self.channel is not None:
            self.channel.set(f"{self.prefix}/{what}", json.dumps(news))

    def give_up(self, why: str) -> None:
        """Tell rank 0 that this rank writes nothing, and why; the first rank to say so is heard."""
        if self.channel is not None:
            with contextlib.suppress(WeightStoreError):  # lost: rank 0's wait ends at its timeout
                self.channel.offer(f"{self.prefix}/gave-up", json.dumps({"rank": self.rank, "why": why}))

    def failures(self) -> dict[int, str]:
        """The rank that gave up, with why (``commit_shards`` asks at each look for members)."""
        if self.channel is None:
            return {}
        text = self.channel.peek(f"{self.prefix}/gave-up")
        if text is None:
            return {}
        news = json.loads(text)
        return {int(news["rank"]): str(news["why"])}

    def hear(self, what: str, timeout: float, waited_for: str) -> dict[str, Any]:
        """Rank 0's news; an error it told raised here as the same error."""
        text = None if self.channel is None else self.channel.get(f"{self.prefix}/{what}", timeout)
        if text is None:
            raise ShardTimeoutError(f"no word of {waited_for} from rank 0 within {timeout:g}s; nothing was "
                                    "published", path=self.where, missing=[0])
        news = json.loads(text)
        if "error" not in news:
            return dict(news)
        raise told(news, self.where)


def news_of(exc: BaseException) -> dict[str, Any]:
    """An error as rank 0 tells it, for :func:`told` to raise again on every rank."""
    if not isinstance(exc, WeightStoreError):
        return {"error": f"{type(exc).__name__}: {exc}", "kind": "PublishError"}
    news: dict[str, Any] = {"error": exc.message, "kind": type(exc).__name__, "path": exc.path, "key": exc.key}
    if isinstance(exc, ShardTimeoutError):
        news["missing"] = list(exc.missing)
    return news


def told(news: Mapping[str, Any], where: str) -> WeightStoreError:
    """The error rank 0 told (:func:`news_of`): the same class (where it is weightstore's), message,
    path and key."""
    message, path, key = str(news["error"]), news.get("path") or where, news.get("key")
    if "missing" in news:
        return ShardTimeoutError(message, path=path, missing=list(news["missing"]))
    kind = getattr(errors, str(news.get("kind")), None)
    if isinstance(kind, type) and issubclass(kind, WeightStoreError):
        try:
            return kind(message, path=path, key=key)
        except TypeError:  # an error class that takes other words
            pass
    return PublishError(message, path=path, key=key)

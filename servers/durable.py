"""Sessions that survive the server: an append-only event log in SQLite (WAL mode).

Every change to a session (created, a call recorded, a reward, closed, deleted) is one row of
`events`, written by one writer thread in batches, so the event loop never waits on the disk.
Routes `await store.sync()` before they answer, so a turn the client has seen is in the log:
after `kill -9` and a restart the log is replayed through the same `Session` methods, and
every session merges and exports exactly as it would have without the restart. Calls still in
flight at the kill were never answered, so nothing a client saw is missing.

One server per store: a second one on the same file is refused (an advisory lock), and a store
remembers the tokenizer its token ids belong to, so serving another model from it is refused.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import json
import logging
import os
import queue
import sqlite3
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from agentrl.completion import Completion
from agentrl.types import Image
from servers.sessions import CallRecord, InMemorySessionStore, Session, StoreError

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    session TEXT NOT NULL,
    kind TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
_BATCH = 256


def default_store_path(model: str) -> Path:
    """Where `agentrl serve` keeps a model's sessions unless told otherwise."""
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in Path(model).name) or "model"
    return base / "agentrl" / "sessions" / f"{safe}.sqlite"


class SqliteSessionStore(InMemorySessionStore):
    """Sessions in memory for speed, every change journaled to `path` for durability."""

    def __init__(self, path: str | Path, *, tokenizer_id: str) -> None:
        """`tokenizer_id` names what the token ids mean (model name and vocabulary size): a
        store written for one tokenizer is refused for another."""
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_file = _lock(self.path)
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # a commit survives kill -9
            self._db.executescript(_SCHEMA)
            _check_tokenizer(self._db, self.path, tokenizer_id)
            self.restored = self._replay()
        except sqlite3.Error as e:
            self._lock_file.close()
            raise StoreError(f"cannot use the session store {self.path}: {e}; pass --store with "
                             f"another path (or --store memory)") from None
        except BaseException:
            self._lock_file.close()
            raise
        self._queue: queue.SimpleQueue[tuple[str, str, Any] | Future[None] | None] = (
            queue.SimpleQueue())
        self._failed: BaseException | None = None
        self._writer = threading.Thread(target=self._write_loop, name="agentrl-session-store",
                                        daemon=True)
        self._writer.start()

    # -- the store interface ----------------------------------------------------------------

    def create(
        self, session_id: str | None = None, *, group: str | None = None,
        info: dict | None = None, seed: int | None = None,
    ) -> Session:
        session = super().create(session_id, group=group, info=info, seed=seed)
        self._append(session.id, "create", {"group": group, "info": info or {}, "seed": seed,
                                            "created": session.created})
        session.journal = functools.partial(self._append, session.id)
        return session

    def delete(self, session_id: str) -> bool:
        deleted = super().delete(session_id)
        if deleted:
            self._append(session_id, "delete", {})
        return deleted

    async def sync(self) -> None:
        """Return once every change made so far is committed; raise if storing failed."""
        done: Future[None] = Future()
        self._queue.put(done)
        await asyncio.wrap_future(done)

    def flush(self, timeout_s: float = 30.0) -> None:
        """`sync` for threads: block until every change so far is committed."""
        done: Future[None] = Future()
        self._queue.put(done)
        done.result(timeout=timeout_s)

    def close(self) -> None:
        """Commit what is queued, stop the writer, release the file."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        self._db.close()
        self._lock_file.close()

    # -- writing ----------------------------------------------------------------------------

    def _append(self, session_id: str, kind: str, payload: Any) -> None:
        self._queue.put((session_id, kind, payload))

    def _write_loop(self) -> None:
        stop = False
        while not stop:
            batch = [self._queue.get()]
            while len(batch) < _BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            rows: list[tuple[str, str, Any]] = []
            waiting: list[Future[None]] = []
            for item in batch:
                if item is None:
                    stop = True
                elif isinstance(item, Future):
                    waiting.append(item)
                else:
                    rows.append(item)
            if rows and self._failed is None:
                try:
                    body = [(sid, kind, json.dumps(_encode(kind, payload)))
                            for sid, kind, payload in rows]
                    self._db.execute("BEGIN")
                    self._db.executemany(
                        "INSERT INTO events (session, kind, body) VALUES (?, ?, ?)", body)
                    self._db.execute("COMMIT")
                except (sqlite3.Error, TypeError, ValueError) as e:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    log.error("session store %s: writing failed: %s", self.path, e)
                    self._failed = StoreError(f"the session store {self.path} could not be "
                                              f"written ({e}); recorded turns are kept in "
                                              f"memory until the server stops")
            for done in waiting:
                if self._failed is not None:
                    done.set_exception(self._failed)
                else:
                    done.set_result(None)

    # -- reading ----------------------------------------------------------------------------

    def _replay(self) -> int:
        """Rebuild the sessions from the log; returns how many there are (`_replay_into`)."""
        _replay_into(self, self._db, self.path)
        for session in self._sessions.values():  # Journal only what happens from now on.
            session.journal = functools.partial(self._append, session.id)
        return len(self._sessions)


def read_sessions(path: str | Path) -> list[Session]:
    """The sessions of a store file, read without taking it: a running server may hold it
    (`agentrl view` reads it beside `agentrl serve`). The log is replayed into memory through
    the same `Session` methods; nothing is written to the file."""
    path = Path(path)
    if not path.is_file():
        raise StoreError(f"{path} is not a session store file (no such file)")
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            store = InMemorySessionStore()
            _replay_into(store, db, path)
        finally:
            db.close()
    except sqlite3.Error as e:
        raise StoreError(f"cannot read the session store {path}: {e}") from None
    return store.list()


def _replay_into(store: InMemorySessionStore, db: sqlite3.Connection, path: Path) -> None:
    """Apply the log's events to `store` in order. An event that cannot be read back (not
    JSON, a reward since refused, ...) is skipped and flagged on its session, which is served
    and exported with the rest: one bad row must not take the store, or any other session,
    down with it (#34)."""
    rows = db.execute("SELECT seq, session, kind, body FROM events ORDER BY seq")
    for seq, sid, kind, body in rows:
        try:
            _apply(store, path, sid, kind, json.loads(body))
        except Exception as e:  # noqa: BLE001 - whatever a row holds spoils one session
            _skip(store, path, seq, sid, kind, e)


def _apply(store: InMemorySessionStore, path: Path, sid: str, kind: str, data: Any) -> None:
    """One event of the log, through the same `Session` methods that made it (the in-memory
    store's own `create` and `delete`: replaying journals nothing)."""
    if kind == "create":
        # "seed" is absent from stores written before sessions had seeds.
        InMemorySessionStore.create(store, sid, group=data["group"], info=data["info"],
                                    seed=data.get("seed")).created = data["created"]
        return
    session = store.get(sid)
    if kind == "delete":
        InMemorySessionStore.delete(store, sid)
    elif session is None:
        log.warning("session store %s: %s event for unknown session %r ignored", path, kind, sid)
    elif kind == "call":
        session.record(_decode_call(data))
    elif kind == "reward":
        session.add_reward(data["value"], call_id=data["call_id"],
                           choice=data["choice"], terminated=data["terminated"],
                           truncated=data["truncated"], info=data["info"])
    elif kind == "close":
        session.close()


def _skip(store: InMemorySessionStore, path: Path, seq: int, sid: str, kind: str,
          error: Exception) -> None:
    """Flag the session of an event that could not be replayed (made if its very creation
    failed, so that what follows still has a session to go to)."""
    if isinstance(error, json.JSONDecodeError):
        reason = f"its body is not JSON ({error})"
    else:
        reason = f"{type(error).__name__}: {error}"
    message = f"event {seq} ({kind}) could not be read back and was skipped: {reason}"
    log.warning("session store %s: session %r: %s", path, sid, message)
    session = store.get(sid)
    if session is None and kind == "create":
        try:
            session = InMemorySessionStore.create(store, sid)
        except (KeyError, ValueError):  # an id no session may have
            return
    if session is not None:
        session.flag(message)


def _lock(path: Path) -> Any:
    lock = open(path.with_name(path.name + ".lock"), "a+")  # noqa: SIM115 - held until close
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise StoreError(f"another server is using the session store {path}; stop it, or pass "
                         f"--store with another path (or --store memory)") from None
    return lock


def _check_tokenizer(db: sqlite3.Connection, path: Path, tokenizer_id: str) -> None:
    row = db.execute("SELECT value FROM meta WHERE key = 'tokenizer'").fetchone()
    if row is None:
        db.execute("INSERT INTO meta (key, value) VALUES ('tokenizer', ?)", (tokenizer_id,))
    elif row[0] != tokenizer_id:
        raise StoreError(f"the session store {path} holds token ids of {row[0]}, not of "
                         f"{tokenizer_id}; pass --store with another path for this model")


def _encode(kind: str, payload: Any) -> Any:
    if kind != "call":
        return payload
    call: CallRecord = payload
    return {
        "call_id": call.call_id,
        "prompt_ids": call.prompt_ids,
        "choices": [{"token_ids": c.token_ids, "logprobs": c.logprobs,
                     "finish_reason": c.finish_reason, "policy_version": c.policy_version,
                     "stop_reason": c.stop_reason, "top_logprobs": c.top_logprobs,
                     "version_changes": [list(x) for x in c.version_changes]}
                    for c in call.choices],
        "images": [im.to_dict() for im in call.images],
        "aborted": call.aborted,
        "retry_count": call.retry_count,
        "created": call.created,
        "context_key": call.context_key,
        "reply_keys": call.reply_keys,
        "rewritten": call.rewritten,
    }


def _decode_call(d: dict) -> CallRecord:
    choices = [
        Completion(token_ids=c["token_ids"], logprobs=c["logprobs"],
                   finish_reason=c["finish_reason"], policy_version=c["policy_version"],
                   stop_reason=c["stop_reason"],
                   version_changes=[(int(i), int(v)) for i, v in c.get("version_changes", ())],
                   top_logprobs=None if c["top_logprobs"] is None else
                   [[(int(t), float(lp)) for t, lp in pos] for pos in c["top_logprobs"]])
        for c in d["choices"]
    ]
    return CallRecord(call_id=d["call_id"], prompt_ids=d["prompt_ids"], choices=choices,
                      images=[Image.from_dict(im) for im in d["images"]], aborted=d["aborted"],
                      retry_count=d["retry_count"], created=d["created"],
                      context_key=d.get("context_key"), reply_keys=d.get("reply_keys", []),
                      rewritten=bool(d.get("rewritten", False)))

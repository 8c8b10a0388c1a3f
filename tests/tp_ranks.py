"""Test-side launcher for tensor-parallel tests: N CPU processes joined in one gloo process group (the environment
torchrun gives each rank), kept alive across a test module and fed jobs.

    ranks = Ranks(2)
    per_rank = ranks.run(module_function, *args, timeout=60)   # [rank 0's result, rank 1's result]
    ranks.close()

A job is a module-level function called on every rank with the same arguments; its return value (picklable) comes
back per rank, an exception as RankError with the rank's traceback. A job that does not finish on every rank within
`timeout` seconds (a rank stuck in a collective) fails the test and ends the processes (the next run starts new
ones), so no test can hang CI; the process group's own timeout also ends a collective left waiting.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import socket
import time
import traceback

COLLECTIVE_TIMEOUT_S = 60


class RankError(RuntimeError):
    """A job raised on a rank: type name and message of the rank's exception, with its traceback."""

    def __init__(self, rank: int, kind: str, message: str, trace: str):
        super().__init__(f"rank {rank}: {kind}: {message}\n{trace}")
        self.rank, self.kind, self.message = rank, kind, message


class Ranks:
    def __init__(self, world: int = 2):
        self.world = world
        self.procs: list = []

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        port = _free_port()
        self.jobs = [ctx.Queue() for _ in range(self.world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(r, self.world, port, self.jobs[r], self.results), daemon=True)
                      for r in range(self.world)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = 60.0) -> list:
        """fn(*args) on every rank; the per-rank return values, or RankError (not raised: a test may expect it)."""
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.close()
            self._start()
        for q in self.jobs:
            q.put((fn.__module__, fn.__qualname__, args))
        out: dict = {}
        deadline = time.monotonic() + timeout
        while len(out) < self.world:
            try:
                rank, ok, value = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(self.world)) - set(out))
                self.close()
                raise TimeoutError(f"tensor-parallel job {fn.__qualname__} did not finish on ranks {missing} within "
                                   f"{timeout:.0f} s (stuck in a collective?); the rank processes were ended") from None
            out[rank] = value if ok else RankError(rank, *value)
        return [out[r] for r in range(self.world)]

    def close(self) -> None:
        for q in getattr(self, "jobs", []):
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()          # only the processes this launcher started, by their own handle
                p.join(timeout=5)
        self.procs = []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world: int, port: int, jobs, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import importlib

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        while (job := jobs.get()) is not None:
            module, name, args = job
            torch._dynamo.reset()
            try:
                value = getattr(importlib.import_module(module), name)(*args)
                results.put((rank, True, value))
            except BaseException as exc:  # noqa: BLE001  (reported to the test, which decides)
                results.put((rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))
    finally:
        dist.destroy_process_group()

"""Grammar compiles in worker processes, each with its own deadline.

A compile's deadline counts from the moment a worker starts it (time queued does not count); a
worker still compiling at its deadline is killed and replaced, and only that compile fails. The
workers are killed when the pool shuts down or the process exits, so neither waits for them,
and a worker idle for :data:`IDLE_WORKER_S` exits."""
from __future__ import annotations

import atexit
import json
import queue
import select
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

WORKER = Path(__file__).with_name("grammar_worker.py")
STARTUP_TIMEOUT_S = 120.0
"""How long a new worker may take to import the grammar libraries and build its compilers."""
IDLE_WORKER_S = 30.0
"""A worker idle this long exits; the next compile starts a new one."""


class CompileTimeout(Exception):
    """A compile ran past its deadline (its worker is killed and replaced)."""


class GrammarCompileError(Exception):
    """The grammar library refused the grammar (the message is the library's)."""


class CompilePool:
    """``workers`` processes compiling specs for one vocabulary (``header()``: the worker's header,
    :mod:`deepinfer.decoding.grammar_worker`, asked for when the first worker starts);
    :meth:`submit` returns a future of the worker's reply (``{"backend", "grammar", "warnings"}``).
    Workers start on first use."""

    def __init__(self, header: Callable[[], dict], workers: int, timeout_s: float):
        self.timeout_s = timeout_s
        self._make_header = header
        self._header: bytes | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._processes: set[subprocess.Popen] = set()
        self._lock, self._header_lock = threading.Lock(), threading.Lock()
        self._closed, self._workers = False, workers
        for index in range(workers):
            threading.Thread(target=self._serve, name=f"deepinfer-grammar-{index}", daemon=True).start()
        atexit.register(_shutdown_if_alive, weakref.ref(self))

    def submit(self, spec: dict) -> Future:
        if self._closed:
            raise RuntimeError("the grammar compile pool is shut down")
        future: Future = Future()
        self._jobs.put((spec, future))
        return future

    def shutdown(self) -> None:
        """Cancel queued compiles, kill the workers (whatever they are compiling)."""
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                _, future = self._jobs.get_nowait()
            except queue.Empty:
                break
            future.cancel()
        for _ in range(self._workers):
            self._jobs.put((None, None))
        with self._lock:
            processes, self._processes = list(self._processes), set()
        for process in processes:
            process.kill()

    def _serve(self) -> None:
        process = None
        while True:
            try:
                spec, future = self._jobs.get(timeout=IDLE_WORKER_S)
            except queue.Empty:
                self._kill(process)
                process = None
                continue
            if future is None:
                break
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if process is None or process.poll() is not None:
                    process = self._start()
                future.set_result(self._compile(process, spec))
            except GrammarCompileError as error:
                future.set_exception(error)
            except BaseException as error:  # a timeout or a dead worker: that request fails, the worker goes
                self._kill(process)
                process = None
                future.set_exception(error)
        self._kill(process)

    def _start(self) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-u", str(WORKER)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        with self._lock:
            self._processes.add(process)
        try:
            process.stdin.write(self._startup_header() + b"\n")
            process.stdin.flush()
            if self._reply(process, STARTUP_TIMEOUT_S) != "ready":
                raise RuntimeError("the grammar worker did not start")
        except BaseException as error:
            self._kill(process)
            raise RuntimeError(f"the grammar worker did not start: {error}") from None
        return process

    def _startup_header(self) -> bytes:
        with self._header_lock:
            if self._header is None:
                self._header = json.dumps(self._make_header()).encode()
            return self._header

    def _compile(self, process: subprocess.Popen, spec: dict) -> dict:
        process.stdin.write(json.dumps(spec).encode() + b"\n")
        process.stdin.flush()
        reply = self._reply(process, self.timeout_s)
        if "error" in reply:
            raise GrammarCompileError(reply["error"])
        return reply

    def _reply(self, process: subprocess.Popen, timeout_s: float):
        started = time.monotonic()
        ready, _, _ = select.select([process.stdout], [], [], timeout_s)
        if not ready:
            raise CompileTimeout(f"still compiling after {time.monotonic() - started:.1f} s")
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"the grammar worker exited (code {process.wait()})")
        return json.loads(line)

    def _kill(self, process: subprocess.Popen | None) -> None:
        if process is not None:
            process.kill()
            process.wait()
            process.stdin.close()
            process.stdout.close()
            with self._lock:
                self._processes.discard(process)


def _shutdown_if_alive(pool_ref) -> None:
    pool = pool_ref()
    if pool is not None:
        pool.shutdown()

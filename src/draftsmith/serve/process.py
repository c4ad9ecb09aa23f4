"""Run `draftsmith serve` as a child process on a free loopback port, for benchmarks and tests.

A real server process behind a real socket, so what is measured or tested is what users run: the child binds
port 0, and we read its URL from the "ready" line it prints on stderr. Its stderr is kept (last lines) for the
error message when it fails to start, and optionally copied to a log file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.serve.server import READY

_READY_LINE = re.compile(re.escape(READY) + r" (\S+)")


class ServerProcess:
    """`with ServerProcess(["--target", T, "--drafter", D]) as server: ... server.url ...`"""

    def __init__(
        self,
        args: list[str],
        log: Path | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = 600.0,
    ) -> None:
        self.args = ["--host", "127.0.0.1", "--port", "0", *args]
        self.log, self.env, self.startup_timeout = log, env, startup_timeout
        self.url = ""
        self.lines: deque[str] = deque(maxlen=60)
        self._ready = threading.Event()
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        env = {**os.environ, **(self.env or {})}
        cmd = [sys.executable, "-m", "draftsmith.cli", "serve", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = "\n".join(self.lines)
                raise DraftsmithError(
                    f"`draftsmith serve {' '.join(self.args)}` did not start:\n{tail}",
                    hint="run the same command by hand to see the whole output",
                )

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        sink = self.log.open("a") if self.log else None
        try:
            for line in self.proc.stderr:
                self.lines.append(line.rstrip())
                if sink:
                    sink.write(line)
                    sink.flush()
                match = _READY_LINE.search(line)
                if match and not self._ready.is_set():
                    self.url = match.group(1)
                    self._ready.set()
        finally:
            if sink:
                sink.close()

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (uvicorn shuts down gracefully), then SIGKILL if it hangs; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

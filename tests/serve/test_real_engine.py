"""The scheduler and ``perfx-serve`` on the real BatchEngine, with a tiny compiled model (~20 s compile)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import perfx_compiler.pipeline  # noqa: F401 (full TVM before the runtime: these tests compile; runtime/engine.py)
from tests.serve.conftest import free_port

REPO = Path(__file__).resolve().parents[2]

if importlib.util.find_spec("perfx_compiler.runtime.batch_engine") is None:
    reason = "perfx_compiler.runtime.batch_engine does not exist yet"
    print(f"skipping real-engine serving tests: {reason}")
    pytest.skip(reason, allow_module_level=True)


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from perfx_compiler.model.testing import write_tiny_gguf
    from perfx_compiler.pipeline import compile_model

    root = tmp_path_factory.mktemp("serve-tiny")
    path, _ = write_tiny_gguf(root / "m.gguf", context_length=128)
    # Only weight_layout: as in tests/spine/test_batch_engine.py (the fusion passes are not batched yet).
    return Path(compile_model(str(path), "host", root / "art", progress=False, batching=True, passes=["weight_layout"]))


def test_batched_serving_matches_offline_llm(tiny_artifact: Path) -> None:
    from perfx_compiler.llm import LLM
    from perfx_compiler.runtime.api import SamplingParams
    from perfx_compiler.runtime.batch_engine import BatchEngine
    from perfx_compiler.serve.scheduler import Scheduler

    llm = LLM(str(tiny_artifact))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["hello world", "the cat", "a b c d e f g h i j k l m n o p", "xyz"]
    ids = [llm.get_tokenizer().encode(p) for p in prompts]
    offline = [llm.generate([i], params)[0].outputs[0].token_ids for i in ids]

    engine = BatchEngine(tiny_artifact, max_batch=4)
    sched = Scheduler(engine, llm.get_tokenizer(), prefill_chunk=8)
    sched.start()
    try:
        handles = [sched.submit(i, params) for i in ids]
        served = [h.result(timeout=60)[0].token_ids for h in handles]
    finally:
        sched.shutdown()
    assert served == offline
    assert engine.free_pages() == engine.num_pages


def metric_value(text: str, name: str = "perfx_prefix_cache_hits_total") -> float:
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


def test_perfx_serve_cli_end_to_end(tiny_artifact: Path) -> None:
    openai = pytest.importorskip("openai")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "perfx_compiler.cli.serve", str(tiny_artifact), "--port", str(port)]
    cmd += ["--api-key", "k1", "--max-batch", "4", "--log-level", "warning", "--no-verify"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(f"{url}/health", headers={"Authorization": "Bearer k1"}, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "perfx-serve did not come up in 60 s"
            time.sleep(0.2)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 401
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="k1", max_retries=0, timeout=60)
        model = c.models.list().data[0].id
        r = c.completions.create(
            model=model, prompt="hello", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.usage.completion_tokens == 8
        chunks = c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True, temperature=0
        )
        assert [ch.choices[0].finish_reason for ch in chunks][-1] in ("stop", "length")
        metrics = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer k1"}, timeout=5).text
        assert "perfx_kv_pages_total" in metrics
        # Prefix caching: the same 60-token prompt again starts on its cached pages, with the same text;
        # after POST /reset_prefix_cache it runs cold, with the same text again.
        auth = {"Authorization": "Bearer k1"}
        long_prompt = list(range(3, 63))
        texts = []
        for reset in (False, False, True):
            if reset:
                assert httpx.post(f"{url}/reset_prefix_cache", headers=auth, timeout=30).json()["freed_pages"] > 0
            hits = metric_value(httpx.get(f"{url}/metrics", headers=auth, timeout=5).text)
            r = c.completions.create(model=model, prompt=long_prompt, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip
            texts.append((r.choices[0].text, metric_value(httpx.get(f"{url}/metrics", headers=auth).text) - hits))
        assert texts[0][0] == texts[1][0] == texts[2][0]
        assert [t[1] for t in texts] == [0, 48, 0]  # 3 full pages of 16 reused the second time
        proc.terminate()
        out = proc.communicate(timeout=20)[0]
        # the startup line names the pool's size: max-batch 4 full contexts, float32 (a default build)
        line = next((ln for ln in out.splitlines() if "KV pool:" in ln), "")
        pages = 4 * json.loads((tiny_artifact / "perfx-config.json").read_text())["paged_kv"]["pages_per_sequence"]
        assert f"{pages} pages of 16 tokens, float32" in line, out[-2000:]
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

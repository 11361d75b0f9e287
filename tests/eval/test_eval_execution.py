"""The sandboxed executor: HumanEval canonical solutions pass; escapes are reported as failures.

Each escape is tested twice: with every layer, and with the in-process audit hook off, so the
kernel-level confinement (namespaces, read-only mounts, nobody, rlimits) is checked on its own
where it is available.
"""

import os
import sys
import uuid

import pytest

from kvarn.eval import grade, load_task
from kvarn.eval.execution import run_program, run_programs
from kvarn.eval.grading import humaneval_program


def _kernel_layer_available() -> bool:
    res = run_program("pass\n", timeout_s=10)
    return sys.platform == "linux" and "kvarn-sandbox: warning" not in res.stderr


KERNEL = _kernel_layer_available()
LAYERS = [True, pytest.param(False, marks=pytest.mark.skipif(not KERNEL, reason="no namespaces here"))]


@pytest.fixture(scope="module")
def humaneval():
    return load_task("humaneval")


def test_all_humaneval_canonical_solutions_pass(humaneval):
    programs = [humaneval_program(r, r["canonical_solution"]) for r in humaneval]
    results = run_programs(programs, workers=4, timeout_s=15)
    failed = [(r["id"], res.reason, res.stderr[-300:]) for r, res in zip(humaneval, results) if not res.passed]
    assert failed == []


def test_humaneval_wrong_solutions_fail(humaneval):
    wrong = ["    return None\n", "    raise ValueError\n", "    pass\n"]
    programs = [humaneval_program(r, w) for r, w in zip(humaneval[:3], wrong)]
    assert not any(res.passed for res in run_programs(programs, workers=2, timeout_s=10))


def test_humaneval_full_program_in_fence_passes(humaneval):
    r = humaneval[0]
    full = r["prompt"] + r["canonical_solution"]
    assert grade("humaneval", r, f"Here it is:\n```python\n{full}```\nDone.").correct


def test_passing_program_and_local_files():
    res = run_program("open('a.txt', 'w').write('x')\nassert open('a.txt').read() == 'x'\n", timeout_s=10)
    assert res.passed and res.reason == "passed"


@pytest.mark.parametrize("audit_hook", LAYERS)
def test_infinite_loop(audit_hook):
    res = run_program("while True:\n    pass\n", timeout_s=1.5, audit_hook=audit_hook)
    assert not res.passed and res.reason in ("timeout", "cpu_limit")
    assert res.seconds < 10


@pytest.mark.parametrize("audit_hook", LAYERS)
def test_memory_bomb(audit_hook):
    res = run_program("x = bytearray(8 * 1024 ** 3)\nx[-1] = 1\n", timeout_s=10, memory_mb=512,
                      audit_hook=audit_hook)
    assert not res.passed and res.reason == "MemoryError"


@pytest.mark.parametrize("audit_hook", LAYERS)
@pytest.mark.parametrize("where", ["/tmp", os.path.dirname(os.path.abspath(__file__))])
def test_write_outside_directory(tmp_path, audit_hook, where):
    target = os.path.join(where, f"kvarn-escape-{uuid.uuid4().hex}.txt")
    try:
        res = run_program(f"open({target!r}, 'w').write('escaped')\n", timeout_s=10, audit_hook=audit_hook)
        assert not res.passed and ("PermissionError" in res.reason or "OSError" in res.reason)
        assert not os.path.exists(target)
    finally:
        if os.path.exists(target):
            os.remove(target)


@pytest.mark.parametrize("audit_hook", LAYERS)
@pytest.mark.parametrize("code", [
    "import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\n",
    "import subprocess\nsubprocess.run(['true'], check=True)\n",
    "import os\nassert os.system('true') == 0\n",
], ids=["fork", "subprocess", "system"])
def test_process_creation(audit_hook, code):
    res = run_program(code, timeout_s=10, audit_hook=audit_hook)
    assert not res.passed
    assert res.reason in ("PermissionError", "BlockingIOError", "AssertionError", "OSError")


@pytest.mark.parametrize("audit_hook", LAYERS)
@pytest.mark.parametrize("code", [
    "import socket\ns = socket.socket()\ns.settimeout(3)\ns.connect(('1.1.1.1', 80))\n",
    "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=3)\n",
    "import socket\nsocket.getaddrinfo('pypi.org', 443)\n",
], ids=["internet", "loopback", "dns"])
def test_network(audit_hook, code):
    res = run_program(code, timeout_s=10, audit_hook=audit_hook)
    assert not res.passed
    assert res.reason in ("PermissionError", "OSError", "ConnectionRefusedError", "socket.gaierror",
                          "TimeoutError", "socket.timeout")


def test_temporary_directory_removed():
    res = run_program("import os\nprint(os.getcwd())\nraise SystemExit(os.getcwd())\n", timeout_s=10)
    workdir = res.stderr.strip().splitlines()[-1]
    assert workdir.startswith("/") and "kvarn-exec-" in workdir
    assert not os.path.exists(workdir)


def test_invalid_limits():
    with pytest.raises(ValueError):
        run_program("pass", timeout_s=0)

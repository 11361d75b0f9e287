"""Run untrusted Python (model-written HumanEval programs) in a confined separate process.

Each program runs in a fresh interpreter (``python -I -S -B``: no site-packages, no environment, no
bytecode writes) started in its own session, inside a temporary directory that is removed
afterwards. :mod:`kvarn.eval.sandbox_child` confines it before the program starts.

What is contained (on Linux, as root or where unprivileged user namespaces are allowed):
- network: a fresh network namespace with no usable interface;
- files: every mount but the work directory is read-only in a private mount namespace; as root
  the program also runs as ``nobody``;
- processes: RLIMIT_NPROC = 0 (fork/exec fail) plus an audit hook refusing process creation;
- resources: RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE, and a wall-clock
  timeout that kills the whole process group.

What is not: reads are allowed wherever the (possibly ``nobody``) user may read; CPU time of other
processes is not isolated; without namespaces (macOS, locked-down containers) only the in-process
audit hook guards network, files and processes, which native code can bypass: a warning is
logged when that happens. It is a harness for model outputs, not a security boundary for
adversarial code.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CHILD = str(Path(__file__).with_name("sandbox_child.py"))
NOBODY = 65534
_warned: set[str] = set()


@dataclass(frozen=True)
class ExecResult:
    passed: bool
    reason: str  # "passed", "timeout", "cpu_limit", "killed", or the exception's class name
    returncode: int | None
    stderr: str
    seconds: float


def _reason(returncode: int | None, stderr: str, timed_out: bool) -> str:
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "passed"
    if returncode == -signal.SIGXCPU or returncode == -signal.SIGKILL:
        return "cpu_limit" if returncode == -signal.SIGXCPU else "killed"
    if returncode is not None and returncode < 0:
        return f"signal_{-returncode}"
    for line in reversed(stderr.strip().splitlines()):
        line = line.strip()
        if line and not line.startswith(("kvarn-sandbox:", "File ", "^", "~")):
            return line.split(":", 1)[0][:80]
    return f"exit_{returncode}"


def run_program(program: str, *, timeout_s: float = 10.0, memory_mb: int = 1024,
                max_file_mb: int = 16, audit_hook: bool = True) -> ExecResult:
    """Run ``program`` (Python source) confined; passed means it exited with status 0.

    ``audit_hook=False`` leaves only the kernel-level confinement (for testing that layer alone).
    """
    if timeout_s <= 0 or memory_mb <= 0 or max_file_mb <= 0:
        raise ValueError(f"limits must be positive: timeout_s={timeout_s}, memory_mb={memory_mb}, "
                         f"max_file_mb={max_file_mb}")
    workdir = tempfile.mkdtemp(prefix="kvarn-exec-")
    start = time.monotonic()
    try:
        prog = Path(workdir, "program.py")
        prog.write_text(program, encoding="utf-8")
        root = os.geteuid() == 0
        if root:
            os.chown(workdir, NOBODY, NOBODY)
            os.chown(prog, NOBODY, NOBODY)
        cfg = {
            "workdir": workdir, "program": prog.name, "cpu_seconds": max(1, math.ceil(timeout_s)),
            "memory_bytes": memory_mb << 20, "fsize_bytes": max_file_mb << 20,
            "uid": NOBODY if root else None, "gid": NOBODY if root else None,
            "audit_hook": audit_hook,
        }
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", CHILD, json.dumps(cfg)], cwd=workdir,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"},
                start_new_session=True, close_fds=True,
            )
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the session's group: stragglers too
                except ProcessLookupError:
                    pass
                proc.wait()
            err.seek(0)
            stderr = err.read()[-8000:].decode("utf-8", "replace")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for line in stderr.splitlines():
        if line.startswith("kvarn-sandbox: warning") and line not in _warned:
            _warned.add(line)
            log.warning("%s", line)
    reason = _reason(proc.returncode, stderr, timed_out)
    return ExecResult(reason == "passed", reason, proc.returncode, stderr, time.monotonic() - start)


def run_programs(programs: list[str], *, workers: int = 2, **limits) -> list[ExecResult]:
    """:func:`run_program` over a list, ``workers`` processes at a time, results in order."""
    if workers < 1:
        raise ValueError(f"workers={workers!r} must be >= 1")
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda p: run_program(p, **limits), programs))

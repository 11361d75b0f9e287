"""Child side of :mod:`kvarn.eval.execution`: confine this fresh interpreter, then run a program.

Run as ``python -I -S -B sandbox_child.py CONFIG_JSON`` with the work directory as cwd. Standard
library only (it runs without site-packages). Steps, in order, before any untrusted code runs:

1. New network and mount namespaces (as root directly; otherwise inside a new user namespace).
   The network namespace has only a loopback device, left down: no connection can be made.
2. In the mount namespace every mount is remounted read-only except a bind mount of the work
   directory, so writes outside it fail with EROFS (the host's mounts are untouched).
3. Preload the modules the program imports (found by a line scan), then, when root, drop to
   ``nobody``: the interpreter may live under a directory ``nobody`` cannot read
   (``/root/.pyenv``), so modules imported dynamically later may fail to import.
4. Resource limits: address space, CPU seconds, file size, no new processes (RLIMIT_NPROC = 0 is
   enforced for every uid but root), few file descriptors, no core files.
5. An audit hook refuses process creation, sockets, ctypes and writes outside the work directory:
   a second layer, and the only one where namespaces are unavailable (a warning is printed then).

Messages for the parent start with ``kvarn-sandbox:`` on stderr.
"""

import ctypes
import json
import os
import resource
import sys

CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWUSER = 0x00020000, 0x40000000, 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# Modules preloaded while still privileged: those the program imports, plus "encodings.idna"
# (socket's name lookups need it). Interpreter startup dominates the cost of a run, so nothing else.
ALWAYS_PRELOAD = ("encodings.idna",)
BLOCKED_EVENTS = (
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill",
    "os.killpg", "subprocess.Popen", "socket.connect", "socket.bind", "socket.sendto",
    "socket.sendmsg", "socket.getaddrinfo", "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function",
    "os.chdir", "os.setuid", "pty.spawn", "webbrowser.open",
)
WRITE_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                "os.symlink", "os.link", "os.truncate", "os.utime", "shutil.rmtree")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

libc = ctypes.CDLL(None, use_errno=True)


def note(msg: str) -> None:
    sys.stderr.write(f"kvarn-sandbox: {msg}\n")
    sys.stderr.flush()


def _call(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, target, flags) -> None:
    _call(libc.mount(src, target.encode(), None, ctypes.c_ulong(flags), None), f"mount {target}")


def _mount_points() -> list[tuple[str, set]]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            point = parts[4].encode().decode("unicode_escape")  # "\040" is a space
            out.append((point, set(parts[5].split(","))))
    return out


def _readonly_except(workdir: str) -> int:
    """Remount every mount read-only but a bind mount of ``workdir``; returns failures."""
    _mount(None, "/", MS_REC | MS_PRIVATE)
    _mount(workdir.encode(), workdir, MS_BIND)
    failures = 0
    for point, opts in _mount_points():
        if point == workdir:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for name, bit in (("nosuid", MS_NOSUID), ("nodev", MS_NODEV), ("noexec", MS_NOEXEC),
                          ("noatime", MS_NOATIME), ("nodiratime", MS_NODIRATIME),
                          ("relatime", MS_RELATIME)):
            if name in opts:
                flags |= bit
        try:
            _mount(None, point, flags)
        except OSError:
            failures += 1
    return failures


def _namespaces(workdir: str) -> bool:
    uid, gid = os.geteuid(), os.getegid()
    try:
        if uid == 0:
            _call(libc.unshare(CLONE_NEWNET | CLONE_NEWNS), "unshare")
        else:
            _call(libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS), "unshare")
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
    except OSError as exc:
        note(f"warning: no network/mount namespace ({exc}); only in-process guards apply")
        return False
    try:
        failures = _readonly_except(workdir)
    except OSError as exc:
        note(f"warning: could not make the file system read-only ({exc})")
        return True
    if failures:
        note(f"warning: {failures} mounts stayed writable")
    return True


def _drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def _limits(cfg: dict) -> None:
    mem, cpu, fsize = cfg["memory_bytes"], cfg["cpu_seconds"], cfg["fsize_bytes"]
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))


def _guard(workdir: str) -> None:
    prefix = workdir.rstrip("/") + "/"

    def outside(path) -> bool:
        if isinstance(path, int):
            return False  # an fd already open
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        full = os.path.realpath(os.path.join(workdir, os.fspath(path)))
        return full != workdir and not full.startswith(prefix) and full != "/dev/null"

    def hook(event, args):
        if event in BLOCKED_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and len(args) > 2 and isinstance(args[2], int) \
                and args[2] & WRITE_FLAGS and outside(args[0]):
            raise PermissionError(f"sandbox: writing {args[0]!r} outside the work directory")
        if event in WRITE_EVENTS and args and isinstance(args[0], (str, bytes, os.PathLike)) \
                and outside(args[0]):
            raise PermissionError(f"sandbox: {event} outside the work directory")

    sys.addaudithook(hook)


def _preload(source: str) -> None:
    """Import what ``source`` imports at top level (by a line scan), ignoring failures."""
    import re

    names = set(ALWAYS_PRELOAD)
    for m in re.finditer(r"^[ \t]*(?:from[ \t]+([\w.]+)[ \t]+import|import[ \t]+([\w., \t]+))", source, re.M):
        for name in (m.group(1) or m.group(2)).split(","):
            name = name.strip().split(" ")[0]
            if name and not name.startswith("."):
                names.add(name)
    for name in sorted(names):
        try:
            __import__(name)
        except Exception:  # the program meets the same error itself, later
            pass


def main() -> None:
    cfg = json.loads(sys.argv[1])
    workdir = os.path.realpath(cfg["workdir"])
    isolated = _namespaces(workdir)
    program = os.path.join(workdir, cfg["program"])
    with open(program, encoding="utf-8") as f:
        source = f.read()
    _preload(source)
    if isolated and os.geteuid() == 0 and cfg.get("uid") is not None:
        _drop_privileges(cfg["uid"], cfg["gid"])
    os.chdir(workdir)
    _limits(cfg)
    code = compile(source, program, "exec")
    sys.argv = [program]
    sys.path.insert(0, workdir)
    if cfg.get("audit_hook", True):
        _guard(workdir)
    # Not "__main__": a candidate's `if __name__ == "__main__":` block (input(), doctest) is skipped.
    exec(code, {"__name__": "__candidate__", "__file__": program, "__builtins__": __builtins__})


if __name__ == "__main__":
    main()

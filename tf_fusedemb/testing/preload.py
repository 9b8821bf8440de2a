"""Rank processes that start with TensorFlow already imported: a test's multi-rank jobs
pay TensorFlow's import (about 2.3 s of CPU a process) once per rank slot, not once per
rank of every job.

A :class:`Preloader` keeps one server process per rank index ("zygote"): it has imported
TensorFlow, tf_keras, Horovod and the library, and nothing more (no eager context, no
device, no thread pool of TensorFlow's), and forks a child for each rank it is asked to
run. The launcher (``testing.cluster.launcher``) starts a small stub in the rank's place,
``python -S -c STUB SOCKET ARGV...``; the stub hands the server its standard streams,
environment, working directory and argv, and the child runs the command as
``python ARGV...`` would: ``-m module``, a script or ``-c code``, as ``__main__``, with
``sys.path`` built as Python builds it, then a normal interpreter exit (``atexit``
handlers, flushing). The stub exits as the child exited (its code, or the same signal),
forwards SIGTERM, SIGINT and SIGHUP to it, and when the stub is killed the server kills the
child's process group, so the launcher's kills and timeouts act as on a plain process.

Why one server per rank index: forked children share their server's string-hash seed
(``PYTHONHASHSEED``), so two ranks of one job forked from one server would iterate sets
of names in the same order, and a rank-order bug that plain processes expose would hide.
Each server has its own seed, so the ranks of a job differ as plain processes do; the
children also reseed ``random`` and numpy's global generator.

A command is run on a server only when running it there cannot differ from a fresh
process: its argv is ``[sys.executable, ...]`` with options the child understands, and its
environment differs from the server's only in variables read after start-up (Horovod's,
``TF_FUSEDEMB_*``, ``PYTHONPATH``); anything else (another ``TF_CPP_MIN_LOG_LEVEL``,
Keras 3, thread counts, a pinned core) runs as a plain process (:meth:`Preloader.command_for`
returns None).
"""
import array
import importlib
import json
import os
import random
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from tf_fusedemb import quiet

__all__ = ["Preloader"]

# What every server imports before it forks: TensorFlow, Keras 2, Horovod, the library.
PRELOADED = ("tensorflow", "tf_keras", "horovod.tensorflow", "tf_fusedemb.layers",
             "tf_fusedemb.models", "tf_fusedemb.training", "tf_fusedemb.pipeline")
# Variables read after start-up, when the job starts Horovod or uses the library: these
# may differ between the server's environment and a job's.
LATE_PREFIXES = ("HOROVOD_", "NCCL_", "GLOO_", "TF_FUSEDEMB_", "OMPI_", "PMI_")
# PYTEST_CURRENT_TEST: pytest rewrites it for every test; nothing at import reads it.
LATE_NAMES = frozenset({"PYTHONPATH", "PYTHONUNBUFFERED", "PWD", "OLDPWD",
                        "PYTEST_CURRENT_TEST"})
# Python options the child reproduces (-u: the ranks are unbuffered anyway; -B: no effect
# on what runs).
FLAGS = frozenset({"-u", "-B"})
READY = "preload-ready"
START_TIMEOUT_S = 120.0

# The stub: stdlib only, no site (-S), so it starts in milliseconds. Protocol: one JSON
# request with the three standard streams' descriptors; the reply "pid N\n", then
# "exit CODE\n" or "signal SIG\n".
STUB = r"""
import array, json, os, signal, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
req = json.dumps({"argv": sys.argv[2:], "env": dict(os.environ), "cwd": os.getcwd()}).encode()
s.sendmsg([len(req).to_bytes(8, "big") + req],
          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
f = s.makefile("r")
pid = int(f.readline().split()[1])
def forward(sig, frame):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, forward)
line = ""
while not line:
    try:
        line = f.readline()
    except InterruptedError:
        continue
    if not line:
        os._exit(125)
kind, value = line.split()
if kind == "signal":
    if int(value) in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(int(value), signal.SIG_DFL)
    os.kill(os.getpid(), int(value))
os._exit(int(value))
"""


class Preloader:
    """Servers that run rank commands in processes forked after TensorFlow's import (see
    the module docstring). Start-up is lazy: a rank index's server starts the first time a
    command for it comes. A context manager; :meth:`close` stops the servers.

    Args:
      env: the environment the servers import under (the jobs' own must agree with it
        outside ``LATE_PREFIXES``/``LATE_NAMES``), e.g. the launcher's rank environment
        without Horovod's variables.
    """

    def __init__(self, env: Mapping[str, str]):
        self._env = {k: v for k, v in env.items() if not _late(k)}
        self._dir = tempfile.mkdtemp(prefix="fusedemb_preload_")
        self._servers: Dict[int, Tuple[subprocess.Popen, str]] = {}

    def command_for(self, rank: int, argv: Sequence[str],
                    env: Mapping[str, str]) -> Optional[List[str]]:
        """The stub's argv that runs ``argv`` under ``env`` on rank ``rank``'s server, or
        None when it must run as a plain process (the module docstring says when)."""
        if not argv or argv[0] != sys.executable or _target(list(argv[1:])) is None:
            return None
        if {k: v for k, v in env.items() if not _late(k)} != self._env:
            return None
        return [sys.executable, "-S", "-E", "-c", STUB, self._server(rank)] + list(argv[1:])

    def close(self) -> None:
        """Stops every server (the children they run are the jobs'; the launcher stops
        those)."""
        for proc, _ in self._servers.values():
            proc.kill()
            proc.wait()
        self._servers.clear()
        for name in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, name))
        os.rmdir(self._dir)

    def __enter__(self) -> "Preloader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _server(self, rank: int) -> str:
        """The socket of ``rank``'s server, started (and waited for) where needed."""
        if rank in self._servers and self._servers[rank][0].poll() is None:
            return self._servers[rank][1]
        path = os.path.join(self._dir, f"rank{rank}.sock")
        if os.path.exists(path):
            os.unlink(path)
        env = dict(self._env, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen([sys.executable, "-m", "tf_fusedemb.testing.preload", path],
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                start_new_session=True, text=True)
        assert proc.stdout is not None  # stdout=PIPE
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        line = proc.stdout.readline() if ready else ""
        if line.strip() != READY:
            proc.kill()
            raise RuntimeError(f"the preloading server for rank {rank} did not start "
                               f"(exit {proc.wait()}); run the job without a Preloader to "
                               "see why")
        self._servers[rank] = (proc, path)
        return path


def _late(name: str) -> bool:
    return name.startswith(LATE_PREFIXES) or name in LATE_NAMES


def _target(args: List[str]) -> Optional[Tuple[str, str, List[str]]]:
    """(kind, what, argv) of ``python ARGS``: ("module", name, ...), ("script", path, ...)
    or ("code", source, ...), with sys.argv as Python sets it; None for options the child
    does not reproduce."""
    while args and args[0] in FLAGS:
        args = args[1:]
    if not args:
        return None
    if args[0] == "-m" and len(args) > 1:
        return "module", args[1], [args[1]] + args[2:]
    if args[0] == "-c" and len(args) > 1:
        return "code", args[1], ["-c"] + args[2:]
    if args[0].startswith("-"):
        return None
    return "script", args[0], args


# The server side: runs as ``python -m tf_fusedemb.testing.preload SOCKET``.

def _receive(conn: socket.socket) -> Tuple[dict, List[int]]:
    """One request and its three descriptors."""
    fds = array.array("i")
    data, ancdata, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    size = int.from_bytes(data[:8], "big")
    body = data[8:]
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise EOFError("stub closed mid-request")
        body += chunk
    return json.loads(body), list(fds)


def _serve(path: str) -> Tuple[dict, List[int]]:
    """Accepts stubs and forks a child for each; returns (in the child only) its request
    and descriptors. The server itself loops until it is killed."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print(READY, flush=True)
    owner = os.getppid()  # the Preloader's process: the server ends when it is gone
    children: Dict[int, socket.socket] = {}  # child pid -> its stub's connection
    while True:
        if os.getppid() != owner and not children:
            raise SystemExit(0)
        conns = list(children.values())
        readable, _, _ = select.select([listener] + conns, [], [], 0.05)
        for conn in readable:
            if conn is listener:
                stub, _ = listener.accept()
                request, fds = _receive(stub)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in list(children.values()) + [stub]:
                        other.close()
                    return request, fds
                for fd in fds:
                    os.close(fd)
                stub.sendall(f"pid {pid}\n".encode())
                children[pid] = stub
            else:  # a stub's connection is readable only when the stub is gone
                pid = next(p for p, c in children.items() if c is conn)
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                stub = children.pop(pid)
                word = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                        else f"exit {os.WEXITSTATUS(status)}")
                try:
                    stub.sendall(f"{word}\n".encode())
                except OSError:
                    pass
                stub.close()


def _become(request: dict, fds: List[int], base_path: List[str]) -> Tuple[str, str]:
    """Turns this forked child into the stub's process: its streams, session,
    environment, directory, argv and sys.path. Returns (kind, what) to run."""
    for std, fd in zip((0, 1, 2), fds):
        os.dup2(fd, std)
        os.close(fd)
    os.setsid()  # its own group: the server kills the group when the stub is killed
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    target = _target(request["argv"])
    assert target is not None, request["argv"]  # command_for sent only commands it can run
    kind, what, argv = target
    sys.argv = argv
    first = {"module": os.getcwd(), "code": ""}.get(kind, os.path.dirname(os.path.abspath(what)))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first] + extra + base_path
    random.seed()  # from fresh entropy, as a fresh process would be seeded
    np.random.seed()
    return kind, what


def main(path: str) -> None:
    """The server: preload, then serve; in each forked child, run its command."""
    quiet.install()  # as the ranks' commands do, before TensorFlow loads
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path[1:] if p not in own]
    for name in PRELOADED:
        importlib.import_module(name)
    request, fds = _serve(path)
    kind, what = _become(request, fds, base_path)
    if kind == "module":
        runpy.run_module(what, run_name="__main__", alter_sys=True)
    elif kind == "script":
        runpy.run_path(what, run_name="__main__")
    else:
        exec(compile(what, "<string>", "exec"), {"__name__": "__main__"})  # pylint: disable=exec-used


if __name__ == "__main__":
    main(sys.argv[1])

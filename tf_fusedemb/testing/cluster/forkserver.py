"""Rank processes forked from an interpreter that has already imported TensorFlow.

A rank started as a fresh ``python`` spends about 3 s of CPU importing TensorFlow, tf_keras,
Horovod and this package before its first line; a test suite of multi-rank jobs pays it
on every rank of every job. A :class:`ForkServer` is a process that imports them once (as
a rank would: :func:`tf_fusedemb.quiet.install` first), then forks one process per command
it is given. The forked process takes the command's environment (``os.environ`` updated in
place), working directory, argv, stdin (``/dev/null``), stdout and stderr (the caller's
pipes) and a session of its own, and runs ``python -m MODULE ARGS`` or ``python SCRIPT
ARGS`` as the interpreter would (``runpy``, ``sys.path`` as a fresh interpreter would set
it); its exit status is the program's, after its ``atexit`` handlers. The server starts no
TensorFlow thread before it forks: no op has run, no eager context is initialised.

What forked processes share with their server is what the imports made, plus the hash
seed of ``str`` (fixed when an interpreter starts). Ranks of one job that shared it would
iterate a set of names in the same order, where separately started ranks can differ, so
:class:`ForkServers` keeps one server per rank index: rank r of every job forks from
server r, and two ranks of a job never share a seed. numpy's global ``RandomState`` is
reseeded from the OS in each forked process (Python's ``random`` reseeds itself at fork).

A command runs in a process of its own (:meth:`ForkServers.server_for` gives None) when it
is not ``python -m``/``python SCRIPT`` of this interpreter, when its environment leaves a
variable of ``quiet.ENV_DEFAULTS`` unset (a program that does not call ``quiet.install()``
imports TensorFlow with its own defaults), or when it differs from the server's in a
variable read while the modules load (:data:`IMPORT_ENV`).

    python -m tf_fusedemb.testing.cluster.forkserver FD    (the server; FD: its socket)
"""
import atexit
import contextlib
import ctypes
import os
import pickle
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import IO, Dict, List, Mapping, Optional, Sequence, Tuple

from tf_fusedemb import quiet

__all__ = ["ForkServer", "ForkServers", "ForkedProcess", "IMPORT_ENV", "PRELOAD",
           "SHARED_FORK_SERVERS"]

# What the server imports before it forks: what a rank of the project's tests imports.
PRELOAD = ("numpy", "tensorflow", "tf_keras", "horovod.tensorflow", "cloudpickle",
           "tf_fusedemb", "tf_fusedemb.testing.distributed")
# Environment variables read while PRELOAD loads (TensorFlow's Keras choice, its C++ log
# level and oneDNN switch, the op library's path, BLAS thread counts): a command whose
# values differ from its server's runs in a process of its own.
IMPORT_ENV = ("TF_USE_LEGACY_KERAS", "TF_CPP_MIN_LOG_LEVEL", "TF_CPP_MAX_VLOG_LEVEL",
              "TF_CPP_VMODULE", "TF_ENABLE_ONEDNN_OPTS", "KERAS_BACKEND", "KERAS_HOME",
              "TF_FUSEDEMB_OPS_LIBRARY", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
              "MKL_NUM_THREADS", "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONHASHSEED",
              "PYTHONOPTIMIZE", "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS")
_NETNS_RUN, _NETNS_ETC = "/run/netns", "/etc/netns"  # where `ip netns` keeps them
_MS_BIND, _MS_REC, _MS_SLAVE, _MNT_DETACH = 0x1000, 0x4000, 0x80000, 2  # <sys/mount.h>
_CLONE_NEWNS, _CLONE_NEWNET = 0x20000, 0x40000000  # <sched.h>
_LIBC = ctypes.CDLL(None, use_errno=True)  # setns, unshare, mount (os.setns: Python 3.12+)
_READY = b"ready"
_INT64 = struct.Struct("q")  # a pid, or a wait status
_POLL_S = 0.05
_MAX_REQUEST = 1 << 20


class ForkedProcess:
    """A process a :class:`ForkServer` forked: what :class:`subprocess.Popen` offers the
    launcher (``pid``, ``stdout``, ``stderr``, ``returncode``, ``poll``, ``wait``). Its
    exit status comes from the server, which reaps it, through a pipe of its own."""

    def __init__(self, pid: int, stdout: IO[bytes], stderr: IO[bytes], status_fd: int):
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: Optional[int] = None
        self._status_fd = status_fd
        self._status = b""

    def poll(self) -> Optional[int]:
        """The exit status (negative: killed by that signal, as Popen), or None if running."""
        if self.returncode is not None:
            return self.returncode
        if not select.select([self._status_fd], [], [], 0)[0]:
            return None
        chunk = os.read(self._status_fd, _INT64.size)
        self._status += chunk
        if len(self._status) >= _INT64.size:
            status = _INT64.unpack(self._status[:_INT64.size])[0]
            self.returncode = os.waitstatus_to_exitcode(status)
        elif not chunk:  # the server died before it could reap this process
            if _alive(self.pid):
                return None
            self.returncode = -signal.SIGKILL
        if self.returncode is not None:
            os.close(self._status_fd)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Waits for the exit; raises subprocess.TimeoutExpired after ``timeout`` seconds."""
        start = time.monotonic()
        while True:
            code = self.poll()
            if code is not None:
                return code
            if timeout is not None and time.monotonic() - start > timeout:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(_POLL_S)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def _import_env(env: Mapping[str, str]) -> Tuple[Optional[str], ...]:
    return tuple(env.get(k) for k in IMPORT_ENV)


def python_command(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is ``[this interpreter, -m, MODULE, ...]`` or ``[this interpreter,
    SCRIPT.py, ...]``, the commands a server runs."""
    if len(argv) < 2 or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return False
    return (argv[1] == "-m" and len(argv) > 2) or argv[1].endswith(".py")


class ForkServer:
    """One server process (see the module docstring), started at construction; it imports
    ``PRELOAD`` while the caller goes on, and the first :meth:`spawn` waits for it.

    Args:
        env: the server's environment: its :data:`IMPORT_ENV` values are those of the
            commands it runs. It sets every variable of ``quiet.ENV_DEFAULTS``, so that the
            server's ``quiet.install()`` leaves the environment as it is.
    """

    def __init__(self, env: Mapping[str, str]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.TemporaryFile()  # the server's own output, for its errors
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno())], env={**env,
                                                                       "PYTHONUNBUFFERED": "1"},
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT)
        theirs.close()
        self._sock = ours
        self._ready = False
        self._lock = threading.Lock()  # one request and its reply at a time

    def _wait_ready(self) -> None:
        if self._ready:
            return
        if self._sock.recv(len(_READY)) != _READY:
            self._proc.wait()
            self._log.seek(0)
            raise RuntimeError(f"the fork server exited {self._proc.returncode} before it was "
                               f"ready:\n{self._log.read().decode(errors='replace')[-4000:]}")
        self._ready = True

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Optional[str] = None,
              netns: Optional[str] = None,
              cpus: Optional[Tuple[int, ...]] = None) -> ForkedProcess:
        """Forks a process running ``argv`` (:func:`python_command`) under ``env`` in
        ``cwd`` (default: this process's working directory), in network namespace
        ``netns`` (as ``ip netns exec NETNS`` would; None: the server's) pinned to ``cpus``
        (as ``taskset -c``; None: unpinned). Raises ValueError for any other command."""
        if not python_command(argv):
            raise ValueError(f"a fork server runs `{sys.executable} -m MODULE ...` or "
                             f"`{sys.executable} SCRIPT.py ...`, not {list(argv)}")
        with self._lock:
            self._wait_ready()
            return self._spawn((list(argv), dict(env), cwd or os.getcwd(), netns, cpus))

    def _spawn(self, request: tuple) -> ForkedProcess:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        status_r, status_w = os.pipe()
        try:
            socket.send_fds(self._sock, [pickle.dumps(request)], [out_w, err_w, status_w])
            pid = _INT64.unpack(self._sock.recv(_INT64.size))[0]
        finally:
            for fd in (out_w, err_w, status_w):
                os.close(fd)
        return ForkedProcess(pid, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"), status_r)

    def close(self) -> None:
        """Stops the server (processes it forked go on until they exit)."""
        self._sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._log.close()


class ForkServers:
    """The fork servers of one launching process, one per (rank index, import-time
    environment), started on first use: at most ``max_servers``, for ranks below
    ``max_rank`` (others run as processes of their own). Each server holds a few hundred MB
    of imported modules. :meth:`close` (also at exit) stops them."""

    def __init__(self, max_rank: int = 4, max_servers: int = 4):
        self.max_rank = max_rank
        self.max_servers = max_servers
        self._servers: Dict[Tuple[int, Tuple[Optional[str], ...]], ForkServer] = {}
        atexit.register(self.close)

    def server_for(self, rank: int, argv: Sequence[str],
                   env: Mapping[str, str]) -> Optional[ForkServer]:
        """The server that runs ``argv`` under ``env`` as rank ``rank``, or None when the
        command needs a process of its own."""
        if rank >= self.max_rank or not python_command(argv) or \
                any(k not in env for k in quiet.ENV_DEFAULTS):
            return None
        key = (rank, _import_env(env))
        if key not in self._servers:
            if len(self._servers) >= self.max_servers:
                return None
            self._servers[key] = ForkServer(env)
        return self._servers[key]

    def close(self) -> None:
        """Stops every server."""
        for server in self._servers.values():
            server.close()
        self._servers.clear()


# The fork servers of this process's jobs, for whoever passes them (DistributedTestCase's
# ranks, the project's tests): one pool per process, like a connection pool; its servers
# start on first use and stop at exit.
SHARED_FORK_SERVERS = ForkServers()


# ---- the server side ----

def _reap(status_fds: Dict[int, int]) -> None:
    """Writes the wait status of every exited child to its status pipe."""
    while status_fds:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = status_fds.pop(pid, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.write(fd, _INT64.pack(status))
            os.close(fd)


def _sys_path(program_dir: str, env: Mapping[str, str], base: List[str]) -> List[str]:
    """``sys.path`` of a fresh interpreter started under ``env``: the program's folder,
    then ``PYTHONPATH``, then the interpreter's own entries (``base``)."""
    extra = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [program_dir] + extra + [p for p in base if p not in extra]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: Optional[str], target: str, fstype: Optional[str], flags: int) -> None:
    _check(_LIBC.mount(None if source is None else source.encode(), target.encode(),
                      None if fstype is None else fstype.encode(), flags, None),
           f"mount {source} on {target}")


def _enter_host(netns: Optional[str], cpus: Optional[Tuple[int, ...]]) -> None:
    """What ``taskset -c CPUS`` and ``ip netns exec NETNS`` do before they run a command:
    the cores; the namespace's network, a mount namespace of the process's own with
    ``/sys`` showing that network's devices and each file of ``/etc/netns/NETNS`` over the
    one of ``/etc`` (the emulated hosts' ``hosts`` file)."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    if netns is None:
        return
    fd = os.open(os.path.join(_NETNS_RUN, netns), os.O_RDONLY)
    try:
        _check(_LIBC.setns(fd, _CLONE_NEWNET), f"setns {netns}")
    finally:
        os.close(fd)
    _check(_LIBC.unshare(_CLONE_NEWNS), "unshare the mount namespace")
    _mount(None, "/", None, _MS_REC | _MS_SLAVE)  # nothing mounted here leaks out
    _LIBC.umount2(b"/sys", _MNT_DETACH)
    _mount(netns, "/sys", "sysfs", 0)
    etc = os.path.join(_NETNS_ETC, netns)
    for name in sorted(os.listdir(etc)) if os.path.isdir(etc) else ():
        _mount(os.path.join(etc, name), os.path.join("/etc", name), None, _MS_BIND)


def _run_child(argv: List[str], env: Dict[str, str], cwd: str, netns: Optional[str],
               cpus: Optional[Tuple[int, ...]], fds: List[int], base_path: List[str]) -> None:
    """In the forked process: takes the command's session, streams, host, folder and
    environment, runs it, exits with its status. Never returns."""
    code = 1
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((devnull, 0), (fds[0], 1), (fds[1], 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.close(fds[2])
        _enter_host(netns, cpus)
        os.chdir(cwd)
        os.environ.clear()  # in place: modules hold os.environ itself
        os.environ.update(env)
        sys.modules["numpy"].random.seed()  # its global RandomState is the server's
        if argv[1] == "-m":
            sys.argv = [argv[2]] + argv[3:]
            sys.path[:] = _sys_path(os.getcwd(), env, base_path)
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv[1:]
            sys.path[:] = _sys_path(os.path.dirname(os.path.abspath(argv[1])), env, base_path)
            runpy.run_path(argv[1], run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  as the interpreter: the traceback, status 1
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()  # pylint: disable=protected-access
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)  # pylint: disable=protected-access


def _serve(sock: socket.socket) -> None:
    """Forks a child per request until the client closes its end."""
    quiet.install()  # as the ranks do, before TensorFlow loads
    for name in PRELOAD:
        __import__(name)
    base_path = sys.path[1:]  # less the server's own folder (sys.path[0])
    sock.sendall(_READY)
    status_fds: Dict[int, int] = {}
    while True:
        readable = select.select([sock], [], [], _POLL_S)[0]
        _reap(status_fds)
        if not readable:
            continue
        message, fds, _, _ = socket.recv_fds(sock, _MAX_REQUEST, 3)
        if not message:
            return
        argv, env, cwd, netns, cpus = pickle.loads(message)
        pid = os.fork()
        if pid == 0:
            sock.close()
            for fd in status_fds.values():
                os.close(fd)
            _run_child(argv, env, cwd, netns, cpus, fds, base_path)
        os.close(fds[0])
        os.close(fds[1])
        status_fds[pid] = fds[2]
        sock.sendall(_INT64.pack(pid))


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))

"""Running a command inside a memory cgroup: proof that a table larger than memory trains.

    with MemoryLimit(limit_bytes=900 << 20) as limit:
        run = limit.run([sys.executable, "train_it.py"], timeout=300)
    assert run.returncode == 0 and run.oom_kills == 0
    print(run.peak_bytes)

A limit is the job's DRAM budget plus its fixed overhead plus a margin;
:func:`measure_overhead` measures the overhead as the smallest peak of a few unlimited runs
of the same job over a small table.

The cgroup is this kernel's memory controller: cgroup v1's ``memory.limit_in_bytes``
where the v1 hierarchy is mounted (``/sys/fs/cgroup/memory``), else cgroup v2's
``memory.max`` (``/sys/fs/cgroup`` with the memory controller). Creating one needs root.
The kernel charges a cgroup both the anonymous memory of its processes and the page cache
they fill; page cache is reclaimed under the limit, anonymous memory is not, so a process
whose anonymous memory outgrows the limit is OOM-killed (counted in ``oom_kills``).
``limit_bytes=None`` runs without a limit and still reports the peak: the way to measure a
process's fixed overhead before choosing a limit.

As a command, it runs one inside a limit, its output left as it is, then prints one line
``MEMORY_LIMIT {"limit_bytes": ..., "peak_bytes": ..., "oom_kills": ...}`` and exits with
the command's status:

    python -m tf_fusedemb.testing.memory_limit --limit-mb 3072 -- python -m tf_fusedemb.train ...
"""
import argparse
import json
import os
import signal
import sys
import subprocess
import time
import uuid
from typing import List, NamedTuple, Optional, Sequence

V1_ROOT = "/sys/fs/cgroup/memory"
V2_ROOT = "/sys/fs/cgroup"


class MemoryLimitUnavailable(RuntimeError):
    """No memory cgroup can be made here (not root, or no memory controller mounted)."""


class LimitedRun(NamedTuple):
    """What a command run inside the cgroup did."""
    returncode: int
    stdout: str
    stderr: str
    peak_bytes: int  # the cgroup's peak charge: anonymous memory plus page cache
    oom_kills: int  # processes the kernel's OOM killer ended in the cgroup


def cgroup_version() -> int:
    """1 or 2: the hierarchy whose memory controller this machine offers to root.

    Raises MemoryLimitUnavailable when neither does, or when not running as root."""
    if os.geteuid() != 0:
        raise MemoryLimitUnavailable("a memory cgroup needs root")
    if os.path.exists(os.path.join(V1_ROOT, "memory.limit_in_bytes")):
        return 1
    try:
        with open(os.path.join(V2_ROOT, "cgroup.controllers")) as f:
            if "memory" in f.read().split():
                return 2
    except OSError:
        pass
    raise MemoryLimitUnavailable(f"no memory controller under {V1_ROOT} (cgroup v1) nor "
                                 f"{V2_ROOT} (cgroup v2)")


class MemoryLimit:
    """A fresh memory cgroup, limited to ``limit_bytes`` (None: unlimited), removed on
    exit with every process still in it killed. Use as a context manager."""

    def __init__(self, limit_bytes: Optional[int]):
        if limit_bytes is not None and limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be positive, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.version = cgroup_version()
        root = V1_ROOT if self.version == 1 else V2_ROOT
        self.path = os.path.join(root, f"tf_fusedemb_{uuid.uuid4().hex[:12]}")

    def __enter__(self) -> "MemoryLimit":
        os.mkdir(self.path)
        try:
            if self.limit_bytes is not None:
                name = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
                self._write(name, str(self.limit_bytes))
            if self.version == 2:
                self._write("memory.swap.max", "0")  # as v1 without memsw: no swapping out
        except BaseException:
            os.rmdir(self.path)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for pid in self._read("cgroup.procs").split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        for _ in range(100):  # the kernel removes a cgroup once its last task is gone
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.05)

    def run(self, argv: Sequence[str], timeout: Optional[float], env: Optional[dict] = None,
            cwd: Optional[str] = None, capture: bool = True) -> LimitedRun:
        """Runs ``argv`` inside the cgroup (it joins before it executes anything) and
        waits at most ``timeout`` seconds (None: no limit; then kills it and raises
        TimeoutExpired). ``capture=False`` leaves its output on this process's (the
        returned stdout and stderr are then empty)."""
        procs = os.path.join(self.path, "cgroup.procs")

        def join_cgroup() -> None:  # in the child, between fork and exec
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        done = subprocess.run(list(argv), capture_output=capture, text=True, timeout=timeout,
                              env=env, cwd=cwd, preexec_fn=join_cgroup)
        return LimitedRun(done.returncode, done.stdout or "", done.stderr or "",
                          self.peak_bytes(), self.oom_kills())

    def peak_bytes(self) -> int:
        """The cgroup's peak charge so far, in bytes."""
        return int(self._read("memory.max_usage_in_bytes" if self.version == 1
                              else "memory.peak"))

    def oom_kills(self) -> int:
        """Processes of the cgroup that the OOM killer ended so far."""
        text = self._read("memory.oom_control" if self.version == 1 else "memory.events")
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
        return 0

    def _read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)


def measure_overhead(argvs: Sequence[Sequence[str]], timeout: Optional[float],
                     env: Optional[dict] = None, cwd: Optional[str] = None) -> LimitedRun:
    """A job's fixed overhead (TensorFlow, the model, a batch's tensors): each command of
    ``argvs`` (the same job over a small table, two runs or more) in a fresh cgroup
    without a limit; the run whose peak is the smallest.

    Why the smallest: the kernel charges a cgroup the page cache its processes fill, and the
    first process after heavy file I/O reads TensorFlow's libraries back into it (914 MB
    against 246 MB once, on a 2-core VM). A limit built on that peak would bind nothing.

    Raises:
      ValueError: ``argvs`` is empty.
      RuntimeError: a run exited non-zero (its command and the end of its stderr).
      MemoryLimitUnavailable: no memory cgroup here.
    """
    if not argvs:
        raise ValueError("measure_overhead needs at least one command")
    runs = []
    for argv in argvs:
        with MemoryLimit(None) as cgroup:
            run = cgroup.run(argv, timeout=timeout, env=env, cwd=cwd)
        if run.returncode != 0:
            raise RuntimeError(f"overhead run {list(argv)} exited {run.returncode}:\n"
                               f"{run.stderr[-3000:]}")
        runs.append(run)
    return min(runs, key=lambda run: run.peak_bytes)


def main(argv: Optional[List[str]] = None) -> int:
    """The command (see the module doc): the command's exit status (128 + the signal's
    number when a signal ended it)."""
    p = argparse.ArgumentParser(description="Run a command inside a memory cgroup.")
    p.add_argument("--limit-mb", type=float, default=None,
                   help="the cgroup's limit in MiB (default: none, the peak still reported)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given (put it after --)")
    if args.limit_mb is not None and args.limit_mb <= 0:
        p.error(f"--limit-mb must be positive, got {args.limit_mb}")
    limit_bytes = None if args.limit_mb is None else int(args.limit_mb * 2**20)
    try:
        with MemoryLimit(limit_bytes) as limit:
            run = limit.run(command, timeout=None, capture=False)
    except MemoryLimitUnavailable as e:
        p.error(str(e))
    print("MEMORY_LIMIT " + json.dumps({"limit_bytes": limit_bytes, "peak_bytes": run.peak_bytes,
                                        "oom_kills": run.oom_kills}), flush=True)
    # A signal's death as a shell reports it (137 for the OOM killer's SIGKILL).
    return run.returncode if run.returncode >= 0 else 128 - run.returncode


if __name__ == "__main__":
    sys.exit(main())

"""Local Gloo workers WITHOUT horovodrun's supervision, for tests of what ranks do on
their own when a peer dies.

horovodrun terminates every worker as soon as one exits non-zero, which hides whether the
survivors would have noticed the loss (or hung in a collective) by themselves. Here each
rank is a plain child process rendezvousing through Horovod's own HTTP rendezvous server
(the one horovodrun starts), with the environment horovodrun would give it, and nothing
kills the others when one dies.
"""
import os
import subprocess
import sys

from conftest import REPO_ROOT


class GlooWorkers:
    """Starts ``python script_args...`` as ``num_proc`` Gloo ranks on localhost.

    Attributes:
      procs: the rank processes, ``procs[r]`` is rank r.
      logs: paths of each rank's combined stdout/stderr.
    """

    def __init__(self, script_args, num_proc, log_dir, env=None):
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.http.http_server import RendezvousServer
        self._server = RendezvousServer()
        port = self._server.start()
        plan = get_host_assignments(parse_hosts(f"localhost:{num_proc}"), num_proc)
        self._server.init(plan)
        base = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1",
                    PYTHONUNBUFFERED="1", **(env or {}))
        base.update(HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1",
                    HOROVOD_GLOO_RENDEZVOUS_PORT=str(port), HOROVOD_CONTROLLER="gloo",
                    HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE="lo")
        self.procs, self.logs = [], []
        for slot in plan:
            rank_env = dict(base, HOROVOD_HOSTNAME=slot.hostname, HOROVOD_RANK=str(slot.rank),
                            HOROVOD_SIZE=str(slot.size), HOROVOD_LOCAL_RANK=str(slot.local_rank),
                            HOROVOD_LOCAL_SIZE=str(slot.local_size),
                            HOROVOD_CROSS_RANK=str(slot.cross_rank),
                            HOROVOD_CROSS_SIZE=str(slot.cross_size))
            log = os.path.join(str(log_dir), f"rank{slot.rank}.log")
            with open(log, "w") as out:
                self.procs.append(subprocess.Popen(
                    [sys.executable] + list(script_args), cwd=REPO_ROOT, env=rank_env,
                    stdout=out, stderr=subprocess.STDOUT))
            self.logs.append(log)

    def output(self, rank):
        with open(self.logs[rank], errors="replace") as f:
            return f.read()

    def close(self):
        """Kills whatever still runs (a test that failed half-way) and stops the server."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self._server.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

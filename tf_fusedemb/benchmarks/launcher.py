"""Running a benchmark module's workers under horovodrun from a plain invocation.

``python -m tf_fusedemb.benchmarks.NAME`` re-launches itself under ``horovodrun -np N
--gloo -H localhost:N`` (the horovodrun next to ``sys.executable``), streams the workers'
output to stderr and returns rank 0's result: the JSON after ``marker`` on its stdout.
"""
import importlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def launch(module, num_proc, argv, marker, timeout=None):
    """Runs ``python -m module argv...`` on ``num_proc`` local Gloo workers.

    Returns:
      (horovodrun exit code, rank 0's result dict or None).
    """
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    cmd = [horovodrun, "-np", str(num_proc), "--gloo", "-H", f"localhost:{num_proc}",
           sys.executable, "-m", module] + list(argv)
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    print("launching: " + " ".join(cmd), file=sys.stderr, flush=True)
    result = None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    timer = threading.Timer(timeout, lambda: _kill(proc)) if timeout else None
    try:
        if timer is not None:
            timer.start()
        for line in proc.stdout:
            if marker in line:
                result = json.loads(line.split(marker, 1)[1])
            else:
                sys.stderr.write(line)
                sys.stderr.flush()
        code = proc.wait()
    except BaseException:
        _kill(proc)
        raise
    finally:
        if timer is not None:
            timer.cancel()
    return code, result


def benchmark_main(module, worker_module, parse_args, marker, argv=None):
    """``main`` of a self-launching benchmark: a worker (HOROVOD_RANK set) runs
    ``worker_module.run(args)`` and rank 0 prints its result after ``marker``; a plain
    invocation launches ``args.np`` workers and prints rank 0's result (JSON last with
    ``--json``). Returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if "HOROVOD_RANK" in os.environ:
        result = importlib.import_module(worker_module).run(args)
        if result is not None:  # rank 0
            print(marker + json.dumps(result, sort_keys=True), flush=True)
        return 0
    code, result = launch(module, args.np, argv, marker, args.timeout)
    if code != 0 or result is None:
        print(f"{module} failed: horovodrun exit code {code}, "
              f"{'no' if result is None else 'a'} result", file=sys.stderr)
        return code or 1
    from tf_fusedemb.benchmarks.timing import emit  # pylint: disable=import-outside-toplevel
    emit(result, args.json)
    return 0


def _kill(proc):
    """Ends the horovodrun process group this launcher started."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

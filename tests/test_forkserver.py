"""tf_fusedemb.testing.cluster.forkserver: a command forked from a server behaves as the same
command started as a fresh interpreter (the reference: ``subprocess.run``), in what it sees
(argv, working directory, environment, ``sys.path[0]``, ``__name__``), in its output and in
its exit status (an exit code, an exception, a signal), and runs its atexit handlers. Forks
of two rank servers differ in str hash seed, and two forks of one server in numpy's global
random state; commands a server cannot run get None (and its spawn refuses them); a server
that cannot start says why.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tf_fusedemb import quiet
from tf_fusedemb.testing.cluster.forkserver import ForkServer, ForkServers

pytestmark = pytest.mark.timeout(300)

_SCRIPT = textwrap.dedent("""
    import atexit, json, os, sys
    import numpy as np
    atexit.register(lambda: print("atexit ran", flush=True))
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "name": __name__,
                      "path0": sys.path[0], "marker": os.environ.get("FORK_TEST_MARKER"),
                      "extra_on_path": os.environ["EXTRA"] in sys.path,
                      "hash": hash("tf_fusedemb"), "draw": float(np.random.random()),
                      "tensorflow_loaded": "tensorflow" in sys.modules}))
    print("to stderr", file=sys.stderr)
    if len(sys.argv) > 1 and sys.argv[1] == "raise":
        raise ValueError("the script raised")
    if len(sys.argv) > 1 and sys.argv[1] == "sleep":
        import time; time.sleep(600)
    sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
""")


@pytest.fixture(scope="module")
def servers():
    pool = ForkServers(max_rank=2, max_servers=2)
    yield pool
    pool.close()


@pytest.fixture
def script(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "probe.py").write_text(_SCRIPT)
    (tmp_path / "extra").mkdir()
    path = tmp_path / "probe_script.py"
    path.write_text(_SCRIPT)
    return path


def _env(tmp_path, **extra):
    env = {**os.environ, **quiet.ENV_DEFAULTS, "FORK_TEST_MARKER": "m",
           "EXTRA": str(tmp_path / "extra"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "extra")] + sys.path[1:])}
    env.update(extra)
    return env


def _forked(servers, rank, argv, env, cwd):
    server = servers.server_for(rank, argv, env)
    assert server is not None, argv
    proc = server.spawn(argv, env, cwd)
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    return proc.wait(timeout=120), out, err


def _fresh(argv, env, cwd):
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout, done.stderr


def _seen(out):
    record = json.loads(out.splitlines()[0])
    for volatile in ("hash", "draw", "tensorflow_loaded"):
        record.pop(volatile)
    return record


@pytest.mark.parametrize("form", ["script", "module"])
def test_a_forked_command_sees_and_exits_as_a_fresh_interpreter(servers, script, tmp_path, form):
    argv = [sys.executable, str(script), "3"] if form == "script" else \
        [sys.executable, "-m", "pkg.probe", "3"]
    env, cwd = _env(tmp_path), str(tmp_path)
    code, out, err = _forked(servers, 0, argv, env, cwd)
    want_code, want_out, want_err = _fresh(argv, env, cwd)
    assert (code, _seen(out)) == (want_code, _seen(want_out)) == (3, _seen(want_out))
    assert out.splitlines()[1:] == want_out.splitlines()[1:] == ["atexit ran"]
    assert "to stderr" in err and "to stderr" in want_err
    assert json.loads(out.splitlines()[0])["tensorflow_loaded"]  # imported by the server


def test_an_exception_gives_status_one_and_the_traceback(servers, script, tmp_path):
    argv = [sys.executable, str(script), "raise"]
    code, out, err = _forked(servers, 0, argv, _env(tmp_path), str(tmp_path))
    want_code, _, want_err = _fresh(argv, _env(tmp_path), str(tmp_path))
    assert code == want_code == 1
    assert "ValueError: the script raised" in err and "ValueError: the script raised" in want_err
    assert out.splitlines()[-1] == "atexit ran"


def test_a_signal_to_its_session_gives_the_negative_signal_number(servers, script, tmp_path):
    server = servers.server_for(0, [sys.executable, str(script)], _env(tmp_path))
    proc = server.spawn([sys.executable, str(script), "sleep"], _env(tmp_path), str(tmp_path))
    assert proc.stdout.readline()  # running
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    os.killpg(proc.pid, signal.SIGTERM)  # its own session, as start_new_session gives
    assert proc.wait(timeout=60) == -signal.SIGTERM


def test_ranks_differ_in_hash_seed_and_forks_in_random_state(servers, script, tmp_path):
    env, argv = _env(tmp_path), [sys.executable, str(script)]
    runs = [json.loads(_forked(servers, rank, argv, env, str(tmp_path))[1].splitlines()[0])
            for rank in (0, 0, 1)]
    assert runs[0]["hash"] == runs[1]["hash"] != runs[2]["hash"]  # servers 0 and 1
    assert runs[0]["draw"] != runs[1]["draw"]  # numpy reseeded in each fork


def test_commands_a_server_cannot_run_get_none(servers, script, tmp_path):
    env = _env(tmp_path)
    assert servers.server_for(0, ["/bin/echo", "x"], env) is None  # not this interpreter
    assert servers.server_for(0, [sys.executable, "-c", "pass"], env) is None
    server = servers.server_for(0, [sys.executable, str(script)], env)
    with pytest.raises(ValueError, match=r"(?s)SCRIPT\.py.*'-c', 'pass'"):
        server.spawn([sys.executable, "-c", "pass"], env)  # spawn checks the command itself
    assert servers.server_for(2, [sys.executable, str(script)], env) is None  # rank >= max
    bare = {k: v for k, v in env.items() if k != "TF_USE_LEGACY_KERAS"}
    assert servers.server_for(0, [sys.executable, str(script)], bare) is None  # no default
    one = ForkServers(max_rank=1, max_servers=1)
    try:
        assert one.server_for(0, [sys.executable, str(script)], env) is not None
        keras3 = _env(tmp_path, TF_USE_LEGACY_KERAS="0")  # another import-time environment:
        assert one.server_for(0, [sys.executable, str(script)], keras3) is None  # pool full
    finally:
        one.close()


def test_a_server_that_cannot_import_names_the_error(tmp_path):
    (tmp_path / "numpy.py").write_text("raise ImportError('broken preload')\n")
    server = ForkServer(_env(tmp_path, PYTHONPATH=str(tmp_path)))
    try:
        with pytest.raises(RuntimeError, match="(?s)before it was ready.*broken preload"):
            server.spawn([sys.executable, "x.py"], _env(tmp_path), str(tmp_path))
    finally:
        server.close()

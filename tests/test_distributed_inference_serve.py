"""``python -m tf_fusedemb.serve`` (the distributed inference command).

End to end under ``mpirun -np 2 --lag 2`` on Criteo lines: the predictions TSV equals the
single-host SavedModel's probabilities of the same lines (1e-6), in input order, with an
uneven last batch. A missing checkpoint (the command) and a checkpoint of another model
(other embedding dim; ``restore_shard``, whose message the command prints) fail with a
clear message instead of a traceback or a hang. On 2 emulated hosts x 1 rank (network
namespaces, ``python -m tf_fusedemb.testing.mpirun --hosts 2``; needs root) the same
command gives the same predictions, in one run: the emulated hosts' Open MPI daemons
once shared one session directory tree (one hostname, one /tmp), and a daemon that lost
the race failed after detaching, so mpirun waited for it silently (one CI run in three).
Each host now has its own tree, and a daemon that fails at start-up fails the job at once
with Open MPI's message (tested with a host whose session directory cannot be made).
"""
import os
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO_ROOT
from tf_fusedemb.testing import mpirun

pytestmark = pytest.mark.skipif(mpirun.unavailable_reason() is not None,
                                reason=str(mpirun.unavailable_reason()))

CRITEO = REPO_ROOT.parent / "shared" / "data" / "criteo-kaggle-sample" / "test.txt"
LINES, BATCH, DIM = 45, 16, 4
ENV = {"PYTHONPATH": str(REPO_ROOT)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(data file, checkpoint dir, SavedModel probabilities float[LINES]) of a DLRM built
    as the main job builds it, with rows for part of the IDs it will see."""
    if not CRITEO.exists():
        pytest.skip(f"Criteo sample not found at {CRITEO}")
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.data import criteo  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.inference.export import export_saved_model  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.layers.model_embeddings import fused_embedding_layers  # pylint: disable=import-outside-toplevel
    from tf_fusedemb import job  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.training.checkpoint import CheckpointManager  # pylint: disable=import-outside-toplevel
    root = tmp_path_factory.mktemp("serve")
    data = root / "lines.tsv"
    data.write_text("".join(CRITEO.read_text().splitlines(keepends=True)[:LINES]))
    kinds = {c: "scalar" for c in criteo.CRITEO_CATEGORICAL}
    model = job.make_model("dlrm", kinds, criteo.CRITEO_DENSE, dim=DIM)
    batches = list(criteo.criteo_dataset(str(data), BATCH))
    model(tf.nest.map_structure(lambda t: t[:0], batches[0][0]))
    rng = np.random.default_rng(0)
    layer = fused_embedding_layers(model)[0]
    for name in criteo.CRITEO_CATEGORICAL[:5]:  # rows for 10 IDs of 5 tables; the rest init
        seen = np.unique(np.concatenate([x[name].numpy() for x, _ in batches]))[:10]
        group = next(g for g in layer.groups if name in g.table_names)
        group.store.load_rows(name, seen, rng.uniform(-1, 1, (len(seen), DIM)))
    CheckpointManager(str(root / "ckpt"), model).save(3)
    export_saved_model(model, str(root / "export"), kinds, dense_features=criteo.CRITEO_DENSE)
    serve = tf.saved_model.load(str(root / "export")).signatures["serving_default"]
    probs = np.concatenate([serve(**x)["probability"].numpy().ravel() for x, _ in batches])
    return str(data), str(root / "ckpt"), probs


def _serve_args(data, ckpt, out, dim=DIM):
    return ["-m", "tf_fusedemb.serve", "--checkpoint-dir", ckpt, "--data", "criteo",
            "--data-path", data, "--lag", "2", "--batch-size", str(BATCH), "--dim", str(dim),
            "--output", out, "--timeout", "120"]


@pytest.mark.timeout(600)  # generous: under load; about a minute on an idle machine
def test_serve_under_mpirun_equals_savedmodel(trained, tmp_path):
    data, ckpt, want = trained
    out = tmp_path / "predictions.tsv"
    proc = mpirun.run_mpirun(2, _serve_args(data, ckpt, str(out)), timeout=540, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "samples/s" in proc.stdout and "RESULT " in proc.stdout
    table = np.loadtxt(out, skiprows=1, delimiter="\t")
    np.testing.assert_array_equal(table[:, 0], np.arange(LINES))
    np.testing.assert_allclose(table[:, 1], want, rtol=0, atol=1e-6)


def _skip_without_emulated_hosts():
    from tf_fusedemb.testing.cluster import unavailable_reason  # pylint: disable=import-outside-toplevel
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no emulated cluster on this machine: {reason}")


@pytest.mark.timeout(300)  # about a minute on an idle machine
def test_serve_on_two_emulated_hosts_equals_single_process(trained, tmp_path):
    _skip_without_emulated_hosts()
    data, ckpt, want = trained
    out = tmp_path / "predictions.tsv"
    proc = mpirun.run_on_emulated_hosts(2, 1, [sys.executable, *_serve_args(data, ckpt, str(out))],
                                        timeout=240, env=ENV, cwd=str(REPO_ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result["ranks"] == 2, result
    table = np.loadtxt(out, skiprows=1, delimiter="\t")
    np.testing.assert_array_equal(table[:, 0], np.arange(LINES))
    np.testing.assert_allclose(table[:, 1], want, rtol=0, atol=1e-6)


def test_rsh_agent_gives_each_emulated_host_its_own_session_directory(tmp_path):
    """The agent (run with a stand-in ``ip`` that prints what it is given) starts each
    host's command in that host's namespace with a session directory base of its own,
    which exists."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ip").write_text('#!/bin/sh\necho "$* | $OMPI_MCA_orte_tmpdir_base"\n')
    (fake / "ip").chmod(0o755)
    agent = mpirun.write_rsh_agent(str(tmp_path), ["fe1_h1", "fe1_h2"])
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}")
    seen = {}
    for ns in ("fe1_h1", "fe1_h2"):
        out = subprocess.run([agent, mpirun.host_alias(ns), "orted", "-mca", "x", "1"], env=env,
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        command, base = out.stdout.strip().split(" | ")
        assert command == f"netns exec {ns} /bin/sh -c orted -mca x 1", command
        assert os.path.isdir(base), base
        seen[ns] = base
    assert seen["fe1_h1"] != seen["fe1_h2"], seen
    bad = subprocess.run([agent, "fe1-h3", "true"], env=env, capture_output=True, text=True,
                         timeout=30)
    assert bad.returncode != 0 and "unknown emulated host" in bad.stderr


@pytest.mark.timeout(200)
def test_daemon_failing_at_start_on_an_emulated_host_fails_the_job_at_once(monkeypatch):
    """An Open MPI daemon that fails in orte_init (here: its session directory cannot be
    made) ends the job with a non-zero status and Open MPI's message within seconds;
    detached daemons (Open MPI's default under an rsh agent) left mpirun waiting for ever
    without a word."""
    _skip_without_emulated_hosts()
    write = mpirun.write_rsh_agent

    def broken_second_host(directory, namespaces):
        path = write(directory, namespaces)
        with open(path) as f:
            text = f.read()
        text = text.replace("export OMPI_MCA_orte_tmpdir_base", 'case "$ns" in *_h2) '
                            "OMPI_MCA_orte_tmpdir_base=/proc/no-such-dir ;; esac\n"
                            "export OMPI_MCA_orte_tmpdir_base")
        with open(path, "w") as f:
            f.write(text)
        return path
    monkeypatch.setattr(mpirun, "write_rsh_agent", broken_second_host)
    start = time.monotonic()
    proc = mpirun.run_on_emulated_hosts(2, 1, [sys.executable, "-c", "print('ran')"],
                                        timeout=150, cwd=str(REPO_ROOT))
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert time.monotonic() - start < 60
    assert "orte_init" in proc.stderr or "ORTE" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.timeout(120)
def test_serve_missing_checkpoint_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, *_serve_args(str(CRITEO), str(tmp_path / "none"),
                                                        str(tmp_path / "p.tsv"))],
                          capture_output=True, text=True, timeout=100, cwd=str(REPO_ROOT))
    assert proc.returncode != 0
    assert "does not exist" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.timeout(200)
def test_mismatched_checkpoint_is_a_clear_error(trained):
    """In process (the serve command wraps this error): a model of another dim."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.data import criteo  # pylint: disable=import-outside-toplevel
    from tf_fusedemb.inference.distributed import restore_shard  # pylint: disable=import-outside-toplevel
    from tf_fusedemb import job  # pylint: disable=import-outside-toplevel
    data, ckpt, _ = trained
    kinds = {c: "scalar" for c in criteo.CRITEO_CATEGORICAL}
    model = job.make_model("dlrm", kinds, criteo.CRITEO_DENSE, dim=DIM * 2)
    x, _ = next(iter(criteo.criteo_dataset(data, BATCH)))
    model(tf.nest.map_structure(lambda t: t[:0], x))
    with pytest.raises(ValueError, match="does not match the model"):
        restore_shard(model, ckpt, 0, 2)

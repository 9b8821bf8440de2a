"""The fused forward lookup across real Horovod workers (2 and 3 ranks), and ``make smoke``."""
import os
import re
import subprocess

import pytest

from conftest import REPO_ROOT, STACK
from horovod_launch import horovodrun


@pytest.mark.timeout(400)
@pytest.mark.parametrize("num_proc", [2, 3])
def test_fused_lookup_is_exact_across_ranks(num_proc):
    out = horovodrun(["examples/smoke_fused_lookup.py", "--steps", "3", "--batch-size", "1024"],
                     num_proc)
    exact = re.findall(r"rank (\d+)/(\d+) step (\d+): .* rows exact", out)
    assert len(exact) == 3 * num_proc, out[-2000:]
    assert {int(r) for r, _, _ in exact} == set(range(num_proc))
    assert "WRONG" not in out


@pytest.mark.timeout(400)
def test_make_smoke_prints_no_cuda_factory_lines():
    """``make smoke`` as the README gives it, in a newcomer's environment: the job passes and
    neither horovodrun's own Gloo check (run with C++ logs off) nor the workers (which
    call tf_fusedemb.quiet.install()) print TensorFlow's CUDA-factory error lines."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TF_CPP", "TF_USE_LEGACY", "HOROVOD"))}
    out = subprocess.run(["make", "--no-print-directory", "-o", "setup", "smoke", f"STACK={STACK}"],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=360)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert len(re.findall(r"rows exact", text)) == 2 * 5, text[-3000:]
    assert "Unable to register cu" not in text, text[-3000:]

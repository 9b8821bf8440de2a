"""The fused forward lookup across real Horovod workers (2 and 3 ranks)."""
import re

import pytest

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

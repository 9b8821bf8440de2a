"""TrainLoop, the one-batch lookahead of fit, train.py and the pipelines (issue 21): each
step is told the next batch's features, the last one none, the steps are flushed after
the last batch, and a new iterator starts afresh. A recording stand-in for the steps."""
import pytest

from tf_fusedemb.training.loop import TrainLoop


class Recorder:
    """A LookaheadStep that records its calls."""

    def __init__(self):
        self.calls = []

    def step(self, x, y, next_x=None, sample_weight=None):
        self.calls.append(("step", x, y, next_x, sample_weight))
        return f"result{x}"

    def flush(self):
        self.calls.append(("flush",))


def test_each_step_sees_the_next_batch_and_the_last_is_flushed():
    steps = Recorder()
    loop = TrainLoop(steps)
    data = iter([(1, "a"), (2, "b", 0.5), (3, "c")])
    done = [loop.progress(data) for _ in range(3)]
    assert [d.result for d in done] == ["result1", "result2", "result3"]
    assert done[1].batch == (2, "b", 0.5)
    assert steps.calls == [("step", 1, "a", 2, None), ("step", 2, "b", 3, 0.5),
                           ("step", 3, "c", None, None), ("flush",)]
    with pytest.raises(StopIteration):
        loop.progress(data)
    fresh = iter([(4, "d")])  # a new iterator (Keras's next epoch) starts afresh
    assert loop.progress(fresh).result == "result4"
    assert steps.calls[-2:] == [("step", 4, "d", None, None), ("flush",)]


def test_run_draws_no_batch_beyond_its_steps():
    steps = Recorder()
    drawn = []

    def batches():
        for i in range(10):
            drawn.append(i)
            yield i, -i
    assert [d.result for d in TrainLoop(steps).run(batches(), steps=2)] == ["result0",
                                                                            "result1"]
    assert drawn == [0, 1] and steps.calls[1] == ("step", 1, -1, None, None)
    with pytest.raises(StopIteration):  # nothing to train on
        TrainLoop(Recorder()).progress(iter([]))

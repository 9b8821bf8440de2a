"""tf_fusedemb.benchmarks.op_profile: op categories, the idle-gap split, and a real
profile of a small tf.function step read back (its ops found, its wall time accounted)."""
import tensorflow as tf

from tf_fusedemb.benchmarks import op_profile
from tf_fusedemb.benchmarks.op_profile import OpEvent


def test_categories_follow_op_type_and_scope():
    def cat(name, op_type):
        return op_profile.category(OpEvent(name, op_type, 0.0, 1.0), "emb")
    assert cat("emb/x", "FusedEmb>EngineLookup") == "engine"
    assert cat("emb/x", "FusedEmb>RecoveryPoolGrad") == "pooling_recovery"
    assert cat("emb/x", "FusedEmb>PackKeyMessages") == "exchange"
    assert cat("dense_grads/x", "HorovodGroupedAllreduce") == "exchange"
    assert cat("emb/Reshape", "Reshape") == "embedding_other"
    assert cat("net/dense/MatMul", "_MklMatMul") == "dense"
    assert cat("IteratorGetNext", "IteratorGetNext") == "input"


def test_gaps_are_waits_up_to_the_last_completion_inside_them():
    # µs: ops at 1000-2000, 1500-3000, 6000-7000 in a 0-10000 step
    gaps = op_profile._minus([(0.0, 1e4)], [(1e3, 2e3), (1.5e3, 3e3), (6e3, 7e3)])
    assert gaps == [(0.0, 1e3), (3e3, 6e3), (7e3, 1e4)]
    # callbacks: 80 µs before the second gap's end (the executor slow to start the next
    # op), two inside the third, one 30 µs after the first's end (its own record)
    completions = [1030.0, 5920.0, 7500.0, 8200.0, 20000.0]
    assert op_profile.split_gap((0.0, 1e3), completions) == ((0.0, 1e3), None)
    assert op_profile.split_gap((3e3, 6e3), completions) == ((3e3, 5920.0), (5920.0, 6e3))
    assert op_profile.split_gap((7e3, 1e4), completions) == ((7e3, 8200.0), (8200.0, 1e4))
    # a gap without a callback in it, one whose only callback came before it began
    assert op_profile.split_gap((10100.0, 19000.0), completions) == \
        (None, (10100.0, 19000.0))
    assert op_profile.split_gap((8200.0, 9000.0), [8200.0]) == (None, (8200.0, 9000.0))


def test_a_profiled_step_is_read_back(tmp_path):
    w = tf.Variable(tf.ones([64, 64]))

    @tf.function
    def step(x):
        with tf.name_scope("emb"):
            x = tf.reshape(x, [64, 64])
        return tf.reduce_sum(tf.matmul(x, w))

    x = tf.random.normal([4096])
    step(x)
    # One profiled step: the summary's figures are medians over the profiled steps, taken
    # apart, and the busy time and the gaps add up to the wall time only within one step.
    profiler = op_profile.StepProfiler(str(tmp_path), range(2, 3))
    for k in range(6):  # steps 0, 1, 3, 4 and 5 run unprofiled
        with profiler.step(k):
            step(x).numpy()
    assert not profiler._running
    prof = profiler.summary("emb")
    assert prof.wall_ms > 0 and prof.ops_per_step >= 2
    assert prof.categories_ms["dense"] > 0
    assert prof.categories_ms["collective_wait"] == 0.0
    total = prof.ops_busy_ms + prof.categories_ms["python_overhead"]
    assert abs(total - prof.wall_ms) <= 0.02 * prof.wall_ms + 0.01
    assert any("MatMul" in t for t, _ in prof.top_ops_ms)

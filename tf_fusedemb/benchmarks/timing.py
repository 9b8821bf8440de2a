"""Side-by-side timing: interleaved repeats, median per variant.

``time_side_by_side`` times zero-argument callables in one process; ``interleaved_rounds``
is the same idea for blocks of training steps on several Horovod ranks (the blocks time
themselves, every rank runs them in the same shuffled order, a barrier before each)."""
import json
import random
import statistics
import time


def time_side_by_side(variants, repeats, warmup=3, seed=0):
    """Times zero-argument callables, interleaved in a shuffled order each round.

    Args:
      variants: dict name -> callable (a tf.function call that returns when done).
      repeats: timed rounds; every variant runs once per round.
    Returns:
      dict name -> {"median_ms", "min_ms", "p90_ms"}.
    """
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    samples = {name: [] for name in variants}
    order = list(variants)
    rng = random.Random(seed)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            start = time.perf_counter()
            variants[name]()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: {"median_ms": round(statistics.median(s), 4), "min_ms": round(min(s), 4),
                   "p90_ms": round(sorted(s)[int(0.9 * (len(s) - 1))], 4)}
            for name, s in samples.items()}


def interleaved_rounds(blocks, rounds, seed=0, barrier=None, after_round=None):
    """Runs every block once per round, in an order shuffled per round.

    Args:
      blocks: dict name -> zero-argument callable; each records its own times.
      rounds: number of rounds.
      seed: the shuffle's seed; give every rank the same one, so every rank runs the same
        block at the same time (blocks with collectives would deadlock otherwise).
      barrier: callable run before each block (e.g. ``lambda: comm.allgather_object(None)``),
        so the ranks start each block together; None for none.
      after_round: callable(round_index) run after each round (progress logs).
    """
    order = list(blocks)
    rng = random.Random(seed)
    for r in range(rounds):
        rng.shuffle(order)
        for name in order:
            if barrier is not None:
                barrier()
            blocks[name]()
        if after_round is not None:
            after_round(r)


def median_ms(values):
    """Median of a list of milliseconds, rounded to 3 decimals."""
    return round(statistics.median(values), 3)


def in_graph_loop(body, iterations):
    """A zero-argument callable running ``body()`` ``iterations`` times inside ONE
    tf.function (a tf.while_loop), so per-call Python dispatch does not dilute the op
    times. The loop carries the first element of every output (a value, not a size: a
    size that is known statically would let grappler prune the op), so every op of
    every iteration runs. Divide the measured time by ``iterations``."""
    import tensorflow as tf  # on use: the launching process loads no TensorFlow; its ranks do # pylint: disable=import-outside-toplevel

    @tf.function
    def run():
        acc = tf.constant(0.0, tf.float64)
        for _ in tf.range(iterations):
            outputs = tf.nest.flatten(body())
            acc += tf.add_n([tf.reduce_sum(tf.cast(tf.reshape(o, [-1])[:1], tf.float64))
                             for o in outputs])
        return acc
    return lambda: run().numpy()


def per_iteration(times, iterations):
    """Divides the timing entries of ``time_side_by_side`` by the loop length."""
    return {name: {k: round(v / iterations, 4) for k, v in t.items()}
            for name, t in times.items()}


def ratio(slow, fast):
    """Median ratio slow/fast of two timing entries, rounded."""
    return round(slow["median_ms"] / fast["median_ms"], 3)


def emit(result, as_json):
    """Prints a readable summary, then (with --json) the JSON object as the last line."""
    if not as_json:
        print(json.dumps(result, indent=2))
    else:
        print(json.dumps(result, sort_keys=True))

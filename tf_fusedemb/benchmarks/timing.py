"""The benchmarks' one timing loop: timed steps, interleaved rounds, medians.

Every benchmark worker (lookup, pipeline, topology, inference) and the single-process
benchmarks (ops, storage) time through these functions:

* :func:`time_steps` is THE timed-step loop: ``step(k)`` called ``count`` times one after
  another, each call timed (ms); warm-up steps are the same loop with their times not
  kept for the figures;
* :func:`timed_rounds` runs blocks of steps in rounds: every block once per round, in an
  order shuffled per round (the same on every rank, which matters when blocks hold
  collectives), a barrier before each block; it returns each block's measurement per
  round;
* :func:`median_ms` and :func:`step_stats` summarise the kept times.

``time_side_by_side`` is the single-process case (each variant one timed call per round).
"""
import json
import random
import statistics
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TypeVar

T = TypeVar("T")


def time_steps(step: Callable[[int], Any], count: int,
               keep: slice = slice(None)) -> List[float]:
    """Runs ``step(k)`` for k = 0 .. count-1, one after another, each call timed.

    Args:
      step: one step; it must return only when the step's work is done (read its loss:
        a tf.function may return before its ops finish).
      count: steps to run.
      keep: the steps whose times are returned, e.g. ``slice(1, count - 1)`` (not the
        first nor the last); default all.
    Returns:
      the kept steps' times in milliseconds, in order.
    """
    times = []
    for k in range(count):
        start = time.perf_counter()
        step(k)
        times.append((time.perf_counter() - start) * 1e3)
    return times[keep]


def timed_rounds(blocks: Mapping[str, Callable[[int], T]], rounds: int, seed: int = 0,
                 barrier: Optional[Callable[[], Any]] = None,
                 after_round: Optional[Callable[[int], Any]] = None) -> Dict[str, List[T]]:
    """Runs every block once per round, in an order shuffled per round.

    Args:
      blocks: name -> ``block(round_index)``, e.g. a few steps through
        :func:`time_steps`; it returns its measurement (or records what it needs).
      rounds: number of rounds.
      seed: the shuffle's seed; give every rank the same one, so every rank runs the same
        block at the same time (blocks with collectives would deadlock otherwise).
      barrier: callable run before each block (e.g. ``lambda: comm.allgather_object(None)``),
        so the ranks start each block together; None for none.
      after_round: callable(round_index) run after each round (progress logs).
    Returns:
      name -> [the block's return value per round].
    """
    order = list(blocks)
    results: Dict[str, List[T]] = {name: [] for name in blocks}
    rng = random.Random(seed)
    for r in range(rounds):
        rng.shuffle(order)
        for name in order:
            if barrier is not None:
                barrier()
            results[name].append(blocks[name](r))
        if after_round is not None:
            after_round(r)
    return results


def time_side_by_side(variants: Mapping[str, Callable[[], Any]], repeats: int, warmup: int = 3,
                      seed: int = 0) -> Dict[str, Dict[str, float]]:
    """Times zero-argument callables in one process, interleaved in a shuffled order each
    round (:func:`timed_rounds` of one :func:`time_steps` call each).

    Args:
      variants: dict name -> callable (a tf.function call that returns when done).
      repeats: timed rounds; every variant runs once per round.
      warmup: untimed calls of each variant first.
    Returns:
      dict name -> {"median_ms", "min_ms", "p90_ms"}.
    """
    steps = {name: _as_step(fn) for name, fn in variants.items()}
    for step in steps.values():
        time_steps(step, warmup)
    samples = timed_rounds({name: _timed_once(step) for name, step in steps.items()},
                           repeats, seed)
    return {name: {"median_ms": round(statistics.median(s), 4), "min_ms": round(min(s), 4),
                   "p90_ms": round(sorted(s)[int(0.9 * (len(s) - 1))], 4)}
            for name, s in samples.items()}


def _as_step(fn: Callable[[], Any]) -> Callable[[int], Any]:
    """``fn`` as a step of :func:`time_steps` (the step index unused)."""
    return lambda _: fn()


def _timed_once(step: Callable[[int], Any]) -> Callable[[int], float]:
    """A block of :func:`timed_rounds`: one timed call of ``step``, its ms."""
    return lambda _: time_steps(step, 1)[0]


def median_ms(values: Sequence[float]) -> float:
    """Median of a list of milliseconds, rounded to 3 decimals."""
    return round(statistics.median(values), 3)


def step_stats(times: Sequence[float]) -> Dict[str, float]:
    """{"step_ms" (the median), "min_ms", "p10_ms", "p90_ms"} of step times in ms,
    rounded to 3 decimals."""
    s = sorted(times)
    return {"step_ms": round(statistics.median(s), 3), "min_ms": round(s[0], 3),
            "p10_ms": round(s[int(0.1 * (len(s) - 1))], 3),
            "p90_ms": round(s[int(0.9 * (len(s) - 1))], 3)}


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

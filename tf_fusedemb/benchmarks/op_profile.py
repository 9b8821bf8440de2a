"""Where a training step's time goes: TensorFlow's profiler around a few steps
(:class:`StepProfiler`), each op's time put in one category (:func:`summarize`).

Categories (``CATEGORIES``), from each op's type and name (the executor records ops as
``name:type``; the gradient of a layer's op carries the layer's name scope):

* ``dense``: the MLP's forward and backward ops and the dense optimizer (MatMul, BiasAdd,
  activations, their gradients, ``ResourceApply*``), everything outside the embedding;
* ``exchange``: the key, row and gradient exchange's own ops (key messages, rank-wise
  sort, owner ranks, segment-unique, hashing) and the collectives' launch;
* ``engine``: the storage engine's ops (lookup, apply, record, find, gather/write rows);
* ``pooling_recovery``: recovery gather and pooling (forward and gradient);
* ``embedding_other``: other ops inside the embedding layer's scope (reshapes, casts,
  concatenations of the lookup);
* ``input``: reading the batch (iterator ops);
* ``collective_wait``: the step's idle time (no op running) until an asynchronous
  collective's completion callback (``ExecutorState::ProcessAsync::Done`` of a Horovod
  op) inside the gap: the step waiting on the other rank or on Gloo's transfer. (The
  profiler records no launch event for Horovod's asynchronous kernels, so a wait is
  known by the callback that ends it.)
* ``python_overhead``: the rest of the idle time (Python, ``tf.function`` dispatch, the
  executor's scheduling, including its time from a callback to the next op, which on
  busy cores is often past 50 µs).

Op times are unions of intervals per category (two ops of one category running at once
on two threads count once), so the categories' sum can exceed the wall time where ops of
different categories overlap; ``ops_busy_ms`` is the union over all ops.
"""
import bisect
import contextlib
import re
import statistics
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import tensorflow as tf

from tf_fusedemb.benchmarks.timeline_summary import Interval, host_plane, length, union

CATEGORIES = ("dense", "exchange", "engine", "pooling_recovery", "embedding_other", "input",
              "collective_wait", "python_overhead")
STEP_EVENT = "op_profile_step"

_ENGINE = re.compile(r"^FusedEmb>Engine")
_POOLING = re.compile(r"^FusedEmb>Recovery")
_EXCHANGE = re.compile(r"^(FusedEmb>|Horovod)")
_INPUT = re.compile(r"^(IteratorGetNext|MultiDeviceIteratorGetNextFromShard|OptionalGetValue)")
_ASYNC_DONE = "ExecutorState::ProcessAsync::Done"


class OpEvent(NamedTuple):
    """One op execution: name and type as the executor records them, [begin, end] µs."""
    name: str
    op_type: str
    begin: float
    end: float


class StepProfile(NamedTuple):
    """The profile of the steps run under :func:`profiled`.

    Fields:
      wall_ms: median step wall time.
      categories_ms: {category: median per-step ms} (see the module doc).
      ops_busy_ms: median per-step union of every op's interval.
      ops_per_step: median number of op executions per step.
      top_ops_ms: [(op type, mean ms per step)], the 12 largest types.
    """
    wall_ms: float
    categories_ms: Dict[str, float]
    ops_busy_ms: float
    ops_per_step: float
    top_ops_ms: List[Tuple[str, float]]


def category(op: OpEvent, embedding_scope: str) -> str:
    """The category of one op (see the module doc); ``embedding_scope``: the name scope of
    the embedding layer (e.g. ``"fused_embedding"``), ops under it are the embedding's."""
    if _ENGINE.match(op.op_type):
        return "engine"
    if _POOLING.match(op.op_type):
        return "pooling_recovery"
    if _EXCHANGE.match(op.op_type):
        return "exchange"
    if _INPUT.match(op.op_type):
        return "input"
    if embedding_scope and embedding_scope in op.name:
        return "embedding_other"
    return "dense"


class StepProfiler:
    """TensorFlow's profiler over the steps ``steps`` of a training loop, each marked for
    :func:`summarize`: wrap every step of the loop in ``with profiler.step(k):``; the
    profile starts at the first step of the range and stops after its last.

    Args:
      logdir: where the profile is written (one directory per rank).
      steps: the step indices to profile, e.g. ``range(10, 15)``.
    """

    def __init__(self, logdir: str, steps: range):
        self.logdir, self.steps = logdir, steps
        self._running = False

    @contextlib.contextmanager
    def step(self, k: int) -> Iterator[None]:
        """Runs step ``k``'s block, profiled and marked when ``k`` is in ``steps``."""
        if k not in self.steps:
            yield
            return
        if not self._running:
            tf.profiler.experimental.start(self.logdir)
            self._running = True
        try:
            with tf.profiler.experimental.Trace(STEP_EVENT, step_num=k):
                yield
        finally:
            if k == self.steps[-1]:
                self.stop()

    def stop(self) -> None:
        """Stops the profiler if it runs (after the last step, or a loop cut short)."""
        if self._running:
            tf.profiler.experimental.stop()
            self._running = False

    def summary(self, embedding_scope: str) -> "StepProfile":
        """The :class:`StepProfile` of the profiled steps."""
        self.stop()
        return summarize(self.logdir, embedding_scope)


# Events of the compute threads that are not op executions: the executor's own, and the
# thread pool's bookkeeping (``ThreadpoolListener::Record``, ``StartRegion``, ...).
_NOT_OPS = ("ExecutorState", "ThreadpoolListener")


def read_events(logdir: str) -> Tuple[List[Interval], List[OpEvent], List[float]]:
    """(step windows, op executions, completion times of the asynchronous collectives) of
    the profile in ``logdir``, in µs."""
    plane = host_plane(logdir)
    meta = plane.event_metadata
    stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
    steps: List[Interval] = []
    ops: List[OpEvent] = []
    completions: List[float] = []
    for line in plane.lines:
        base = line.timestamp_ns / 1e3
        for e in line.events:
            name = meta[e.metadata_id].name
            begin = base + e.offset_ps / 1e6
            end = begin + e.duration_ps / 1e6
            if name.startswith(STEP_EVENT):
                steps.append((begin, end))
            elif name == _ASYNC_DONE:
                kernel = next((stat_names.get(st.ref_value) for st in e.stats
                               if stat_names.get(st.metadata_id) == "kernel_type"), "")
                if (kernel or "").startswith("Horovod"):
                    completions.append(begin)
            elif line.name.startswith("tf_Compute") and ":" in name and \
                    not name.startswith(_NOT_OPS):
                op_name, op_type = name.rsplit(":", 1)
                ops.append(OpEvent(op_name, op_type, begin, end))
    return sorted(steps), ops, sorted(completions)


def summarize(logdir: str, embedding_scope: str) -> StepProfile:
    """The :class:`StepProfile` of the steps marked in the profile in ``logdir``."""
    steps, ops, completions = read_events(logdir)
    if not steps:
        raise ValueError(f"{logdir}: no step marked with {STEP_EVENT}")
    per_step: Dict[str, List[float]] = {c: [] for c in CATEGORIES}
    busy, counts, walls = [], [], []
    by_type: Dict[str, float] = {}
    for lo, hi in steps:
        mine = [o for o in ops if lo <= o.begin < hi]
        spans: Dict[str, List[Interval]] = {c: [] for c in CATEGORIES}
        for o in mine:
            spans[category(o, embedding_scope)].append((o.begin, min(o.end, hi)))
            by_type[o.op_type] = by_type.get(o.op_type, 0.0) + (o.end - o.begin) / 1e3
        all_ops = union([(o.begin, min(o.end, hi)) for o in mine])
        for gap in _minus([(lo, hi)], all_ops):
            wait, rest = split_gap(gap, completions)
            spans["collective_wait"] += [wait] if wait else []
            spans["python_overhead"] += [rest] if rest else []
        for c in CATEGORIES:
            per_step[c].append(length(union(spans[c])) / 1e3)
        busy.append(length(all_ops) / 1e3)
        counts.append(len(mine))
        walls.append((hi - lo) / 1e3)
    top = sorted(by_type.items(), key=lambda kv: -kv[1])[:12]
    return StepProfile(
        wall_ms=round(statistics.median(walls), 3),
        categories_ms={c: round(statistics.median(v), 3) for c, v in per_step.items()},
        ops_busy_ms=round(statistics.median(busy), 3),
        ops_per_step=float(statistics.median(counts)),
        top_ops_ms=[(t, round(ms / len(steps), 3)) for t, ms in top])


def split_gap(gap: Interval, completions: Sequence[float], slack_us: float = 50.0
              ) -> Tuple[Optional[Interval], Optional[Interval]]:
    """(the wait, the rest) of an idle ``gap``: the wait runs from its start to the last
    collective completion callback that starts inside it (or within ``slack_us`` after
    its end, the callback's own record), the rest from there to its end; (None, gap)
    without such a callback. ``completions``: sorted callback starts, µs."""
    i = bisect.bisect_right(completions, gap[1] + slack_us)
    if i == 0 or completions[i - 1] <= gap[0]:
        return None, gap
    end = min(completions[i - 1], gap[1])
    return (gap[0], end), ((end, gap[1]) if end < gap[1] else None)


def _minus(spans: Sequence[Interval], holes: Sequence[Interval]) -> List[Interval]:
    """The parts of the (disjoint, sorted) ``spans`` not covered by ``holes``."""
    out = []
    for lo, hi in spans:
        cursor = lo
        for a, b in holes:
            if b <= cursor or a >= hi:
                continue
            if a > cursor:
                out.append((cursor, a))
            cursor = max(cursor, b)
        if cursor < hi:
            out.append((cursor, hi))
    return out

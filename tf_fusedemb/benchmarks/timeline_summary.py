"""Per-collective timings of training steps, from a Horovod timeline and TensorFlow
profiler traces (``tf_fusedemb.benchmarks.pipeline_trace``).

Clocks: Horovod's timeline holds microseconds since its start and that start in epoch
microseconds (``start_time_since_epoch_in_micros``); the profiler's XSpace holds times
relative to the start of profiling, aligned here on the timeline by the collectives'
completions, which both record (see :func:`read_compute`). Every time below is epoch
microseconds.

What a collective's record says (Horovod executes collectives one at a time, on one
background thread, once every rank has requested them):

* ``ready``: {rank: when the coordinator (rank 0) saw that rank's request};
* ``begin``/``end``: the execution on the background thread (negotiated, then run);
  ``transfer``: its Gloo data exchange inside it (an AlltoAll first exchanges its splits);
* ``bytes``: of this rank's input tensor(s), where the timeline records a shape
  (AllReduce, AllGather; not AlltoAll).
"""
import dataclasses
import glob
import json
import os
import re
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

_TRANSFER = ("MPI_ALLTOALL", "GLOO_ALLREDUCE", "GLOO_ALLGATHER", "GLOO_BCAST")
_OPS = ("ALLTOALL", "ALLREDUCE", "ALLGATHER", "BROADCAST", "REDUCESCATTER")
_DTYPE_BYTES = {"float32": 4, "int32": 4, "int64": 8, "float64": 8, "uint8": 1, "int8": 1,
                "float16": 2, "bool": 1}
# A part of a grouped AllReduce, under its collective scope (comm.collective_scope).
_GROUPED = re.compile(r"(^|/)HorovodGroupedAllreduce_.*_(\d+)of(\d+)$")
# A part of the grouped allgather of a list's sum over two ranks
# (comm.communicator.gather_sum), under its collective scope: "<name>.<k>/gathered_1of3".
_GATHERED = re.compile(r"\.\d+/gathered(_\d+of\d+)?$")

Interval = Tuple[float, float]


@dataclasses.dataclass
class Collective:
    """One collective as Horovod's coordinator recorded it (see module doc)."""
    name: str
    kind: str
    ready: Dict[int, float]
    begin: float
    end: float
    transfer: float
    bytes: int

    @property
    def role(self) -> str:
        """The name without the model's scopes, e.g. "g0/rows/mb1_grad", "loss_stats";
        the parts of the grouped dense-gradient AllReduce, or with two ranks its allgather,
        are "dense_grads"."""
        if _GROUPED.search(self.name) or _GATHERED.search(self.name):
            return "dense_grads"
        # "<name>.<k>/<name>": the collective's scope (comm.collective_scope), then its name
        tail = self.name.rsplit("fusedemb/", 1)[-1]
        return re.sub(r"_d\d+_\w+?/", "/", tail, count=1)


# ---------------------------------------------------------------------------- reading
def _load_events(path: str) -> list:
    with open(path) as f:
        text = f.read().strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:  # a timeline whose writer was stopped mid-event
        return json.loads(text.rstrip(",]\n") + "]")


def _tensor_bytes(args: dict) -> int:
    shape = [int(d) for d in re.findall(r"\d+", args.get("shape", ""))]
    count = 1
    for d in shape:
        count *= d
    return count * _DTYPE_BYTES.get(args.get("dtype", ""), 4)


def read_timeline(path: str) -> List[Collective]:
    """Every executed collective of a Horovod timeline file (rank 0 writes it)."""
    events = _load_events(path)
    start, names = 0, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            args = e.get("args", {})
            if "start_time_since_epoch_in_micros" in args:
                start = args["start_time_since_epoch_in_micros"]
            elif "name" in args:
                names[e["pid"]] = args["name"]
    out: List["Collective"] = []
    stacks: Dict[Any, List[list]] = {}  # pid -> open [name, begin, transfer] spans
    ready: Dict[Any, Dict[int, float]] = {}  # pid -> {tensor: when it was ready}
    for e in events:
        ph, pid = e.get("ph"), e.get("pid")
        if ph == "X" and pid in names:
            ready.setdefault(pid, {})[int(e["name"])] = start + e["ts"]
        elif ph == "B":
            stacks.setdefault(pid, []).append([e["name"], start + e["ts"], None])
        elif ph == "E" and stacks.get(pid):
            name, begin, transfer = stacks[pid].pop()
            end = start + e["ts"]
            if name in _TRANSFER and stacks[pid]:
                stacks[pid][-1][2] = end - begin
            elif name in _OPS:
                out.append(Collective(names.get(pid, str(pid)), name, ready.pop(pid, {}),
                                      begin, end, transfer or 0.0,
                                      _tensor_bytes(e.get("args", {}))))
    return out


def host_plane(logdir: str):
    """The ``/host:CPU`` plane of the last TensorFlow profile written under ``logdir``."""
    # The profiler's protobuf, as TensorFlow ships it (no public module exports it); on
    # use: summarising a Horovod timeline alone needs no TensorFlow.
    from tensorflow.tsl.profiler.protobuf import (  # pylint: disable=import-outside-toplevel
        xplane_pb2)
    files = sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb")))
    if not files:
        raise FileNotFoundError(f"no TensorFlow profile (*.xplane.pb) under {logdir}")
    space = xplane_pb2.XSpace()
    with open(files[-1], "rb") as f:
        space.ParseFromString(f.read())
    return next(p for p in space.planes if p.name == "/host:CPU")


def read_compute(logdir: str, first_step_begin: float,
                 collectives: Sequence[Collective]) -> List[Interval]:
    """Intervals (epoch µs) during which a TensorFlow op ran on one of the rank's
    executor threads (the ops of the step, not the collectives' waiting).

    The profile's clock is aligned on Horovod's: each collective's completion callback
    in the profile (``ExecutorState::ProcessAsync::Done``, named after the op) against
    the end of its execution in the timeline (median difference), starting from the
    first ``_step`` call against ``first_step_begin``."""
    plane = host_plane(logdir)
    meta, stat_names = plane.event_metadata, {k: v.name for k, v in plane.stat_metadata.items()}
    calls, dones, spans = [], [], []
    for line in plane.lines:
        base = line.timestamp_ns / 1e3
        for e in line.events:
            name, t = meta[e.metadata_id].name, base + e.offset_ps / 1e6
            if name == "_step":
                calls.append(t)
            elif name == "ExecutorState::ProcessAsync::Done":
                op = next((stat_names.get(st.ref_value) for st in e.stats
                           if stat_names.get(st.metadata_id) == "name"), None)
                dones.append((op, t))
            elif (line.name.startswith("tf_Compute") and ":" in name
                  and not name.startswith(("ExecutorState", "Horovod"))):
                spans.append((t, t + e.duration_ps / 1e6))
    if not calls:
        raise ValueError(f"{logdir}: no _step call in the profile")
    guess = first_step_begin - min(calls)
    ends: Dict[str, List[float]] = {}
    for c in collectives:
        ends.setdefault(c.name, []).append(c.end)
    diffs = [min(ends[op], key=lambda end: abs(end - (t + guess))) - t
             for op, t in dones if op in ends]
    offset = statistics.median(diffs) if diffs else guess
    return union([(a + offset, b + offset) for a, b in spans])


# ---------------------------------------------------------------------------- intervals
def union(spans: Sequence[Interval]) -> List[Interval]:
    """The union of intervals, as sorted disjoint intervals."""
    out: List[Interval] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(spans: Sequence[Interval]) -> float:
    return sum(b - a for a, b in spans)


def clip(spans: Sequence[Interval], lo: float, hi: float) -> List[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi]


def intersect(x: Sequence[Interval], y: Sequence[Interval]) -> float:
    """Length of the intersection of two unions of intervals."""
    total, j = 0.0, 0
    for a, b in x:
        while j < len(y) and y[j][1] <= a:
            j += 1
        k = j
        while k < len(y) and y[k][0] < b:
            total += max(0.0, min(b, y[k][1]) - max(a, y[k][0]))
            k += 1
    return total


# ---------------------------------------------------------------------------- summary
def _executions(collectives: Sequence[Collective]) -> List[dict]:
    """Collectives merged per execution: the parts of a grouped AllReduce run as one."""
    merged: List[dict] = []
    for c in sorted(collectives, key=lambda c: c.begin):
        last = merged[-1] if merged else None
        if (last is not None and c.role == last["role"] == "dense_grads"
                and c.begin - last["begin"] < 1000):  # one fused execution (µs apart)
            last["bytes"] += c.bytes
            last["tensors"] += 1
            continue
        merged.append({"role": c.role, "kind": c.kind, "ready": c.ready, "begin": c.begin,
                       "end": c.end, "transfer": c.transfer, "bytes": c.bytes, "tensors": 1})
    return merged


def _step_detail(begin, end, executions, compute):
    rows = []
    for m in executions:
        if not begin <= m["begin"] < end:
            continue
        ready = m["ready"]
        first, last = (min(ready.values()), max(ready.values())) if ready else (m["begin"],) * 2
        rows.append({"role": m["role"], "kind": m["kind"], "tensors": m["tensors"],
                     "ready_ms": {str(r): round((t - begin) / 1e3, 2)
                                  for r, t in sorted(ready.items())},
                     "skew_ms": round((last - first) / 1e3, 2),
                     "queued_ms": round((m["begin"] - last) / 1e3, 2),
                     "start_ms": round((m["begin"] - begin) / 1e3, 2),
                     "exec_ms": round((m["end"] - m["begin"]) / 1e3, 2),
                     "transfer_ms": round(m["transfer"] / 1e3, 2), "bytes": m["bytes"]})
    comm = union([(m["begin"], m["end"]) for m in executions if begin <= m["begin"] < end])
    comm = clip(comm, begin, end)
    step = {"step_ms": round((end - begin) / 1e3, 2), "collectives": rows,
            "comm_busy_ms": round(length(comm) / 1e3, 2)}
    if compute is not None:
        busy = clip(compute, begin, end)
        step.update({"compute_spans_ms": [(round((a - begin) / 1e3, 2), round((b - begin) / 1e3, 2))
                                          for a, b in union(busy)],
                     "compute_busy_ms": round(length(busy) / 1e3, 2),
                     "comm_overlapped_ms": round(intersect(comm, busy) / 1e3, 2),
                     "idle_ms": round((end - begin - length(union(busy + comm))) / 1e3, 2)})
    return step


def _median(values):
    return round(statistics.median(values), 2) if values else None


def summarize(timeline: str, windows: Sequence[dict]) -> dict:
    """Per mode: every inner step's collectives (the first and last step of a window are
    left out: prologue prefetch, no next batch) and their medians over those steps.

    Args:
      timeline: path of the Horovod timeline.
      windows: per rank, {mode: {"steps_us": [(begin, end)], "tf_profile": dir or None}}.
    """
    collectives = read_timeline(timeline)
    executions = _executions(collectives)
    modes = {}
    for mode, window in windows[0].items():
        spans = window["steps_us"]
        compute = (read_compute(window["tf_profile"], spans[0][0], collectives)
                   if window.get("tf_profile") else None)
        steps = [_step_detail(b, e, executions, compute) for b, e in spans[1:-1]]
        roles: Dict[str, List[dict]] = {}
        for s in steps:
            for r in s["collectives"]:
                roles.setdefault(r["role"], []).append(r)
        per_role = {role: {"kind": rs[0]["kind"], "count_per_step": round(len(rs) / len(steps), 2),
                           **{k: _median([r[k] for r in rs]) for k in
                              ("start_ms", "skew_ms", "queued_ms", "exec_ms", "transfer_ms")},
                           "mbyte": round(statistics.median([r["bytes"] for r in rs]) / 1e6, 3)
                           or None}
                    for role, rs in roles.items()}
        modes[mode] = {"steps": len(steps), "collectives": per_role,
                       **{k: _median([s[k] for s in steps if k in s]) for k in
                          ("step_ms", "comm_busy_ms", "compute_busy_ms", "comm_overlapped_ms",
                           "idle_ms")},
                       "detail": steps}
    return {"modes": modes}


def markdown(summary: dict, title: str = "", argv: Optional[Sequence[str]] = None) -> str:
    """The summary as markdown: per mode, medians over its inner steps, then one step's
    collectives in execution order."""
    lines = [f"# {title or 'Per-collective timings'}", ""]
    if argv:
        lines += ["```", " ".join(argv), "```", ""]
    lines += ["Times in ms, medians over the inner steps; rank 0's view (Horovod's coordinator",
              "and rank 0's TensorFlow profile). `start`: execution start from the step's",
              "start; `skew`: last rank ready minus first; `queued`: execution start minus the",
              "last rank ready (waiting for Horovod's one background thread); `exec`: the",
              "execution; `transfer`: its Gloo data exchange.", ""]
    for mode, m in summary["modes"].items():
        lines += [f"## {mode}", "",
                  f"step {m['step_ms']} ms; Horovod busy executing {m['comm_busy_ms']} ms; "
                  f"rank 0 computing {m['compute_busy_ms']} ms; both at once "
                  f"{m['comm_overlapped_ms']} ms; neither {m['idle_ms']} ms "
                  f"({m['steps']} steps)", "",
                  "| collective | kind | per step | start | skew | queued | exec | transfer | MB |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for role, c in sorted(m["collectives"].items(), key=lambda kv: kv[1]["start_ms"]):
            lines.append(f"| {role} | {c['kind']} | {c['count_per_step']} | {c['start_ms']} | "
                         f"{c['skew_ms']} | {c['queued_ms']} | {c['exec_ms']} | "
                         f"{c['transfer_ms']} | {c['mbyte'] or '-'} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def plot_steps(summary: dict, path: str, title: str = "") -> str:
    """PNG of one inner step per mode (the median-length one): rank 0's compute and
    Horovod's executions (colour by role: rows, keys, gradient AlltoAlls, AllReduces) on
    a common time axis from the step's start; returns ``path``."""
    # matplotlib is optional (requirements.txt): only the plot needs it.
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional, as above # pylint: disable=import-outside-toplevel
    modes = summary["modes"]
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 1.9 * len(modes) + 0.8), squeeze=False)
    colours = {"keys": "tab:orange", "rows": "tab:blue", "grad": "tab:red",
               "loss_stats": "tab:gray", "dense_grads": "tab:purple"}
    for ax, (mode, m) in zip(axes[:, 0], modes.items()):
        steps = sorted(m["detail"], key=lambda s: s["step_ms"])
        step = steps[len(steps) // 2]
        for c in step["collectives"]:
            kind = (c["role"] if c["role"] in colours else
                    "grad" if c["role"].endswith("_grad") else
                    next((k for k in ("keys", "rows") if k in c["role"]), "loss_stats"))
            ax.broken_barh([(c["start_ms"], c["exec_ms"])], (1.1, 0.8), color=colours[kind],
                           edgecolor="black", linewidth=0.3)
            if c["exec_ms"] > 4:
                ax.text(c["start_ms"] + c["exec_ms"] / 2, 1.5, c["role"].split("/")[-1],
                        ha="center", va="center", fontsize=6, rotation=90)
        busy = step.get("compute_spans_ms") or []
        ax.broken_barh([(a, b - a) for a, b in busy], (0.1, 0.8), color="tab:green")
        ax.set_yticks([0.5, 1.5], ["rank 0 compute", "Horovod (link)"], fontsize=8)
        ax.set_xlim(0, max(s["step_ms"] for s in steps) * 1.02)
        ax.axvline(step["step_ms"], color="black", linestyle="--", linewidth=0.8)
        ax.set_title(f"{mode}: step {step['step_ms']:.0f} ms, Horovod executing "
                     f"{step['comm_busy_ms']:.0f} ms, computing {step.get('compute_busy_ms')} ms, "
                     f"both {step.get('comm_overlapped_ms')} ms", fontsize=9)
    axes[-1, 0].set_xlabel("ms from the step's start")
    handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in colours.items()]
    fig.legend(handles=handles, loc="upper right", fontsize=7, ncol=5)
    fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

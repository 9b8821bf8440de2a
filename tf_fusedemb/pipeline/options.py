"""PipelineOptions: which of NestPipe's and EmbRace's schedules, and which exchange, a training
loop uses."""
import dataclasses
from typing import Any, Dict, Optional, Union

from tf_fusedemb.layers.exchange import EXCHANGES

EXCHANGE_OPTIONS = (None, *EXCHANGES, "auto")  # None: each group's own exchange


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """How :class:`~tf_fusedemb.pipeline.NestedPipeline` schedules a training step.

    None of the options changes a computed value (NestPipe Section VI); they change when
    work happens.

    Attributes:
      prefetch: NestPipe's dual-buffer pipelining (DBP): the key routing and row
        retrieval of batch t+1 run during batch t's step; before t+1's forward the rows
        of K(B_t) ∩ K(B_t+1) in the prefetch buffer are replaced by their values after
        t's update.
      micro_batches: N of NestPipe's frozen-window pipelining (FWP): each rank's batch
        is split into N micro-batches whose lookups, forward/backward and gradient
        AlltoAlls are independent, so TensorFlow overlaps one micro-batch's
        communication with another's compute; gradients are applied once per batch.
        "auto": chosen among 1, 2, 4 by timing the first training steps
        (``tf_fusedemb.pipeline.auto``).
      vertical: EmbRace's vertical sparse scheduling, needs ``prefetch``: the coalesced
        row gradients of K(B_t) ∩ K(B_t+1) are applied first (they feed the next
        forward); the others are applied during the next step, overlapped with its
        forward. Default: on with ``prefetch``.
      exchange: the key/row exchange of every fused group: "flat", "hierarchical"
        (TawPipe; several nodes of several ranks), or "auto": both measured on the first
        training steps and the faster kept (``tf_fusedemb.pipeline.auto``), where the
        cost model of ``FusedEmbedding(exchange="auto")`` only predicts. Default None:
        each group's own choice. Either computes the same values.
      sync_buffers: keep True. False drops DBP's synchronisation and makes batch t+1
        use rows read before t's update: the stale pipeline the synchronisation
        prevents, kept only so tests can show that it differs.
    """
    prefetch: bool = False
    micro_batches: Union[int, str] = 1  # int >= 1 or "auto"
    vertical: Optional[bool] = None
    sync_buffers: bool = True
    exchange: Optional[str] = None  # None, "flat", "hierarchical" or "auto"

    def __post_init__(self) -> None:
        n = self.micro_batches
        if n != "auto" and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"PipelineOptions: micro_batches must be an int >= 1 or 'auto', "
                             f"got {n!r}")
        if self.exchange not in EXCHANGE_OPTIONS:
            raise ValueError(f"PipelineOptions: exchange must be one of "
                             f"{EXCHANGE_OPTIONS[1:]} or None, got {self.exchange!r}")
        if self.vertical and not self.prefetch:
            raise ValueError("PipelineOptions: vertical scheduling needs prefetch=True (the "
                             "prior rows are those the prefetched next batch uses)")
        if not self.sync_buffers and not self.prefetch:
            raise ValueError("PipelineOptions: sync_buffers=False only applies with prefetch")

    @property
    def num_micro_batches(self) -> int:
        """``micro_batches`` of options that run one schedule (not "auto")."""
        if isinstance(self.micro_batches, str):
            raise ValueError(f"PipelineOptions {self.label!r}: micro_batches is left to "
                             "measurement (an AutoPipeline chooses it)")
        return self.micro_batches

    @property
    def is_measured(self) -> bool:
        """Whether a choice is left to measurement (``micro_batches`` or ``exchange``
        "auto"): ``tf_fusedemb.pipeline.AutoPipeline`` runs these options."""
        return self.micro_batches == "auto" or self.exchange == "auto"

    @property
    def uses_vertical(self) -> bool:
        return self.prefetch if self.vertical is None else bool(self.vertical)

    @property
    def label(self) -> str:
        """The options as :meth:`parse` reads them, e.g. "sync", "dbp,fwp=4"."""
        parts = (["dbp"] if self.prefetch else []) + \
            ([f"fwp={self.micro_batches}"] if self.micro_batches != 1 else []) + \
            (["novertical"] if self.prefetch and not self.uses_vertical else []) + \
            ([f"exchange={self.exchange}"] if self.exchange else [])
        return ",".join(parts) or "sync"

    @classmethod
    def parse(cls, text: str) -> "PipelineOptions":
        """From a command-line string: "sync", or comma-separated "dbp", "fwp=N" (or "fwp=auto"),
        "novertical", "exchange=KIND" (flat, hierarchical, auto), e.g. "dbp,fwp=4"."""
        kwargs: Dict[str, Any] = {}  # PipelineOptions' fields by name
        for part in filter(None, (p.strip() for p in text.split(","))):
            if part == "sync":
                continue
            if part == "dbp":
                kwargs["prefetch"] = True
            elif part.startswith("fwp="):
                kwargs["micro_batches"] = "auto" if part[4:] == "auto" else int(part[4:])
            elif part == "novertical":
                kwargs["vertical"] = False
            elif part.startswith("exchange="):
                kwargs["exchange"] = part[len("exchange="):]
            else:
                raise ValueError(f"unknown pipeline option {part!r}; use sync, dbp, fwp=N, "
                                 "novertical, exchange=KIND (comma-separated)")
        return cls(**kwargs)

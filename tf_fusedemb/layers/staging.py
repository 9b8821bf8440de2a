"""Staged lookups: routing and retrieval of a (micro-)batch done ahead of its forward pass.

A pipeline (``tf_fusedemb.pipeline``) routes a batch's keys and retrieves their rows on
the owner before the batch's forward pass (NestPipe's DBP), and splits a batch into
micro-batches whose collectives need distinct names (FWP). Inside ``staged_lookups``
each ``GroupLookup`` call takes its prepared lookup from the block instead of routing
anew, and every collective name gets the block's suffix.

A prepared lookup is the dict of :meth:`GroupLookup.route` plus ``"rows"``: the owner's
rows (float32[u_l, dim]) of the routed keys, already synchronised by the pipeline.
"""
import contextlib
import threading

_state = threading.local()


@contextlib.contextmanager
def staged_lookups(prepared=None, suffix=""):
    """Within the block, a GroupLookup ``g`` uses ``prepared[id(g)]`` when present and
    appends ``suffix`` to its collective names.

    Args:
      prepared: {id(GroupLookup): dict of route() tensors + "rows"}, or None.
      suffix: str appended to collective names, e.g. "/mb2" for micro-batch 2.
    """
    previous = getattr(_state, "active", None)
    _state.active = (dict(prepared or {}), suffix)
    try:
        yield
    finally:
        _state.active = previous


def prepared_for(lookup):
    """The prepared lookup of ``lookup`` in the innermost block, or None."""
    active = getattr(_state, "active", None)
    return None if active is None else active[0].get(id(lookup))


def name_suffix():
    """The collective-name suffix of the innermost block ("" outside any)."""
    active = getattr(_state, "active", None)
    return "" if active is None else active[1]

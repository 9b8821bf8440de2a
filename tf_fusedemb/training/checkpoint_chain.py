"""Chains of incremental checkpoints: which checkpoints a restore reads, whether they are
all there, and which ones a kept checkpoint needs.

A checkpoint directory ``ckpt-<step>`` is a *link*. A full link holds every block; a
delta link holds the blocks changed since the link it builds on, its ``base`` (named in
its meta.json with the base's ``id``, so a base written again since is told apart), and
deletions of the keys removed meanwhile. A chain is a full link and the deltas that
follow it, in order: restoring the last link reads all of them. meta.json of a link
(written last, by rank 0, before the atomic rename) also lists the ``files`` every rank
wrote into it with their sizes, so a link damaged afterwards (a file missing or cut short)
is told from a complete one before anything is loaded. Checkpoints of earlier versions
have neither field: they are full links, checked as before.
"""
import dataclasses
import json
import os
from typing import Any, Dict, Iterable, List, Optional, Set

META = "meta.json"
FULL, DELTA = "full", "delta"
PREFIX = "ckpt-"


class BrokenChainError(ValueError):
    """A link of a checkpoint's chain is missing or damaged (a one-line message naming
    the link and the newest checkpoint that still restores)."""


@dataclasses.dataclass(frozen=True)
class Link:
    """One checkpoint directory as a link of a chain.

    Fields: ``path`` (the directory), ``kind`` (FULL or DELTA), ``base`` (the name of the
    link a delta builds on, None for a full link), ``base_id`` (that link's ``id`` when
    the delta was written), ``id`` (this link's; "" in checkpoints of earlier versions),
    ``world_size`` (ranks that wrote it) and ``meta`` (its meta.json, as restore returns
    it)."""
    path: str
    kind: str
    base: Optional[str]
    base_id: Optional[str]
    id: str
    world_size: int
    meta: Dict[str, Any]

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


@dataclasses.dataclass(frozen=True)
class WrittenFile:
    """A file a link must hold: ``name`` (relative to the link), ``size`` in bytes (None:
    a directory, e.g. a block database, which must exist)."""
    name: str
    size: Optional[int]


def checkpoint_name(step: int) -> str:
    """The directory name of checkpoint ``step``."""
    return f"{PREFIX}{step}"


def steps_in(directory: str) -> List[int]:
    """Steps of the complete (renamed) checkpoints in ``directory``, ascending."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(d[len(PREFIX):]) for d in os.listdir(directory)
                  if d.startswith(PREFIX) and d[len(PREFIX):].isdigit())


def written_files(path: str, block_dir: str) -> List[WrittenFile]:
    """What the ranks wrote into link ``path`` (meta.json aside): its regular files with
    their sizes and the directories under ``block_dir`` (block databases, whose files
    RocksDB may add to when it opens them)."""
    files = [WrittenFile(n, os.path.getsize(os.path.join(path, n)))
             for n in sorted(os.listdir(path)) if os.path.isfile(os.path.join(path, n))
             and n != META]
    blocks = os.path.join(path, block_dir)
    if os.path.isdir(blocks):
        files += [WrittenFile(os.path.join(block_dir, n), None) for n in sorted(os.listdir(blocks))]
    return files


def link_meta(kind: str, base: Optional[Link], link_id: str,
              files: Iterable[WrittenFile]) -> Dict[str, Any]:
    """The chain's fields of a new link's meta.json: ``kind``, ``id``, ``base`` and
    ``base_id`` (a delta's base), ``files`` ([name, size or None])."""
    return {"kind": kind, "id": link_id, "base": base.name if base else None,
            "base_id": base.id if base else None,
            "files": [[f.name, f.size] for f in files]}


def read_link(path: str) -> Link:
    """The link at ``path``; raises BrokenChainError naming it when it is missing or
    damaged (meta.json unreadable, a file it lists missing or of another size)."""
    name = os.path.basename(path)
    if not os.path.isdir(path):
        raise BrokenChainError(f"checkpoint {name} is missing")
    try:
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise BrokenChainError(f"checkpoint {name} is half-written: its {META} cannot be "
                               f"read ({type(e).__name__})") from None
    for file, size in meta.get("files", []):
        where = os.path.join(path, file)
        if not os.path.exists(where):
            raise BrokenChainError(f"checkpoint {name} is half-written: {file} is missing")
        if size is not None and os.path.getsize(where) != size:
            raise BrokenChainError(f"checkpoint {name} is half-written: {file} has "
                                   f"{os.path.getsize(where)} bytes, {size} were written")
    kind = meta.get("kind", FULL)
    return Link(path, kind, meta.get("base"), meta.get("base_id"), meta.get("id", ""),
                int(meta["world_size"]), meta)


def chain_of(path: str) -> List[Link]:
    """The links a restore of ``path`` reads, the full one first, each checked
    (read_link) and each delta's base the very checkpoint it was written on. Raises
    BrokenChainError naming the first bad link and the newest checkpoint in the same
    directory that still restores."""
    try:
        return _links_back(path)[::-1]
    except BrokenChainError as e:
        directory = os.path.dirname(os.path.abspath(path))
        usable = newest_restorable(directory)
        hint = (f"{os.path.basename(usable)} is the newest complete checkpoint (restore it "
                "by its path)" if usable else "no complete checkpoint is left in " + directory)
        raise BrokenChainError(f"cannot restore {os.path.basename(path)}: {e}; {hint}") from None


def newest_restorable(directory: str) -> Optional[str]:
    """The path of the newest checkpoint in ``directory`` whose whole chain is there and
    complete, or None."""
    for step in reversed(steps_in(directory)):
        path = os.path.join(directory, checkpoint_name(step))
        try:
            _links_back(path)
        except BrokenChainError:
            continue
        return path
    return None


def _links_back(path: str) -> List[Link]:
    """The chain of ``path`` from it back to its full link; raises BrokenChainError naming
    the first bad link."""
    directory = os.path.dirname(os.path.abspath(path))
    chain = [read_link(path)]
    while chain[-1].kind == DELTA:
        link = chain[-1]
        if link.base in {c.name for c in chain}:
            raise BrokenChainError(f"checkpoint {link.name} builds on itself ({link.base})")
        base = read_link(os.path.join(directory, str(link.base)))
        if base.id != link.base_id:
            raise BrokenChainError(f"checkpoint {base.name} is not the one {link.name} was "
                                   "written on (it was written again since)")
        chain.append(base)
    return chain


def needed_by(directory: str, kept: Iterable[str]) -> Set[str]:
    """The names of the checkpoints ``kept`` (names) and every link they build on,
    transitively: what pruning must leave. A base that is missing or unreadable ends its
    chain here (restoring it fails anyway, naming it)."""
    needed: Set[str] = set()
    for name in kept:
        while name and name not in needed:
            needed.add(name)
            try:
                with open(os.path.join(directory, name, META)) as f:
                    name = json.load(f).get("base")
            except (OSError, ValueError):
                break
    return needed

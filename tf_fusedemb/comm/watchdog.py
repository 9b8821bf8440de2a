"""Peer watchdog: a rank that dies is noticed at once, named, and cannot leave the others
hanging.

When a Horovod worker is killed (SIGKILL, the OOM killer, a crash), the survivors learn
it from Gloo only as "Horovod has been shut down ..." or "Connection reset by peer
[ip]:port", without the rank, and then spend up to ``HOROVOD_GLOO_TIMEOUT_SECONDS``
(30 s) in Horovod's shutdown before the process ends; a survivor that is not inside a
collective (writing its checkpoint shard, evaluating) notices nothing until its next one.

The watchdog keeps one TCP connection to every other rank, beside Horovod's. The
kernel closes the sockets of a process that dies, so a peer that disappears without
saying goodbye is seen within milliseconds, whatever this rank is doing. Then it:

1. prints ``tf_fusedemb: rank 1 of 2 (host) was lost during <activity> ...`` to stderr
   (the activity is what the main thread declared with :meth:`PeerWatchdog.watch`:
   "training step 31", "checkpoint save 40 > barrier fusedemb/ckpt_written");
2. lets the main thread turn its failing collective into a :class:`PeerLostError`
   naming the lost rank(s) (in :meth:`PeerWatchdog.watch`);
3. ends the process with exit status 75 (``EXIT_PEER_LOST``, EX_TEMPFAIL: rerun to
   resume) at interpreter exit, skipping Horovod's shutdown that would wait for the
   dead peer, or ``TF_FUSEDEMB_PEER_LOSS_TIMEOUT_S`` seconds (default 20) after the
   loss if the process is still alive then (stuck in a collective, or busy elsewhere).

A rank that exits normally says goodbye first (at interpreter exit, before Horovod's own
shutdown), and one that exits with an uncaught exception says so with the exception, so
finishing or failing is told apart from being lost. Connections use TCP keep-alive, so
a peer whose host vanishes is noticed too (within about 25 s).

The end of a job. When the job uses Horovod process sets (the hierarchical exchange's
node and rail sets), Horovod's shutdown on one rank aborts the collectives still running
in process sets it is not part of, so a rank done with its last exchange must not shut
Horovod down while another node still runs that exchange's intra-node stage. The ranks
therefore agree on the end over these connections:

* :meth:`PeerWatchdog.end_of_job` (``Communicator.end_job()``; ``train.py`` calls it
  after its last collective): this rank tells every peer it has run its last collective
  ("end", before any goodbye) and waits until every peer has said the same (or exited
  normally). Then no collective runs anywhere, so each rank shuts Horovod down at its exit
  at once, whatever the others still do outside Horovod (rank 0's export, tearing down
  tf.data iterators): the job ends together and promptly. A peer lost or failed
  meanwhile is named at once (:class:`PeerLostError`), as in any collective.
* A job that never calls it agrees at interpreter exit: a rank that exits normally waits
  until every peer has ended or is gone (at most ``TF_FUSEDEMB_EXIT_WAIT_S`` s, default
  120), then shuts Horovod down.

Environment: ``TF_FUSEDEMB_WATCHDOG=0`` disables the watchdog; it is off under Horovod
elastic (``HOROVOD_ELASTIC=1``), where losing a worker is survivable.
``TF_FUSEDEMB_PEER_LOSS_TIMEOUT_S`` sets the delay before the forced exit ("none":
never force it). The Gloo timeout of Horovod itself stays at its default.
"""
import atexit
import contextlib
import os
import re
import selectors
import socket
import struct
import sys
import threading
import time
from typing import (Any, Callable, Collection, Dict, Iterable, Iterator, List, Mapping,
                    Optional, Set, Tuple)

EXIT_PEER_LOST = 75  # EX_TEMPFAIL: the job can be rerun and resumes from its checkpoint
TIMEOUT_ENV = "TF_FUSEDEMB_PEER_LOSS_TIMEOUT_S"
ENABLE_ENV = "TF_FUSEDEMB_WATCHDOG"
DEFAULT_TIMEOUT_S = 20.0
EXIT_WAIT_ENV = "TF_FUSEDEMB_EXIT_WAIT_S"
DEFAULT_EXIT_WAIT_S = 120.0
_CONNECT_TIMEOUT_S = 120.0  # every rank reaches the mesh set-up within this (slow starts)
_EXPLAIN_WAIT_S = 5.0  # a collective's error may arrive before the watchdog's notice
_BYE = b"B"  # first byte of the goodbye message; the rest is a failure reason (or empty)
_END = b"E"  # "my last collective is done" (end_of_job), sent before the goodbye
_STOPPED = "stopped after losing a peer"  # the reason of a rank that lost one too: not news
_NODE = re.compile(r"\{\{node ([^}]+)\}\}")


class PeerLostError(RuntimeError):
    """A peer rank died (or failed, or finished early) while this rank needed it.

    Attributes:
      lost: ranks that died without shutting down (killed, crashed).
      failed: {rank: reason} of ranks that exited with an uncaught exception.
      finished: ranks that exited normally while this rank still needed them.
      world_size, activity: the job's size and what this rank was doing.
      collective: the collective (graph node) that failed, when known.
    """

    def __init__(self, world_size: int, activity: str, lost: Collection[int] = (),
                 failed: Optional[Mapping[int, str]] = None, finished: Collection[int] = (),
                 collective: Optional[str] = None):
        self.world_size, self.activity = world_size, activity
        self.lost, self.failed = sorted(lost), dict(failed or {})
        self.finished, self.collective = sorted(finished), collective
        parts = []
        if self.lost:
            parts.append(f"{_ranks(self.lost, world_size)} {_was(self.lost)} lost "
                         "(the process ended without shutting down: killed or crashed)")
        for r, reason in sorted(self.failed.items()):
            parts.append(f"rank {r} of {world_size} failed ({reason})")
        if self.finished:
            parts.append(f"{_ranks(self.finished, world_size)} finished early")
        where = f"during {activity}" + (f" (collective {collective})" if collective else "")
        super().__init__(f"{'; '.join(parts)} {where}. This rank cannot continue; rerun the "
                         "job to resume from its last complete checkpoint.")


def _ranks(ranks, size):
    return f"rank {ranks[0]} of {size}" if len(ranks) == 1 else \
        f"ranks {', '.join(map(str, ranks))} of {size}"


def _was(ranks):
    return "was" if len(ranks) == 1 else "were"


def _local_address():
    """The address the other ranks reach this one at: that of Gloo's interface
    (HOROVOD_GLOO_IFACE) when known, else this host's name resolved, else loopback."""
    iface = os.environ.get("HOROVOD_GLOO_IFACE")
    if iface:
        try:
            import psutil  # pylint: disable=import-outside-toplevel  (a Horovod dependency)
            for a in psutil.net_if_addrs().get(iface, []):
                if a.family == socket.AF_INET:
                    return a.address
        except ImportError:
            pass
    for name in (os.environ.get("HOROVOD_HOSTNAME"), socket.gethostname()):
        if name:
            try:
                return socket.gethostbyname(name)
            except OSError:
                pass
    return "127.0.0.1"


def _keepalive(sock):
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def timeout_from_env(name: str = TIMEOUT_ENV,
                     default: Optional[float] = DEFAULT_TIMEOUT_S) -> Optional[float]:
    """Seconds from the environment variable ``name`` (TF_FUSEDEMB_PEER_LOSS_TIMEOUT_S,
    default 20, or TF_FUSEDEMB_EXIT_WAIT_S); None for "none"."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("none", "never", "off"):
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds or 'none', "
                         f"got {value!r}") from None
    if seconds < 0:
        raise ValueError(f"{name} must be >= 0, got {seconds}")
    return seconds


def _listen(size: int) -> Tuple[Optional[socket.socket], Optional[Tuple[str, int, str]], str]:
    """A socket listening for the higher ranks' watchdog connections and this rank's
    (address, port, host name) to tell the others; (None, None, the error) when it cannot
    listen."""
    try:
        address = _local_address()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((address, 0))
        listener.listen(max(1, size))
        return listener, (address, listener.getsockname()[1], socket.gethostname()), ""
    except OSError as e:
        return None, None, f"{type(e).__name__}: {e}"


def _connect_mesh(rank: int, size: int, peers: List[Any],
                  listener: socket.socket) -> Dict[int, socket.socket]:
    """Collective: connects to every lower rank (at its ``peers`` entry: address, port,
    host) and accepts every higher one on ``listener``, which it closes. Returns {peer:
    socket}.

    Raises:
      RuntimeError: a connection failed; the peers reached so far were told not to watch
        this rank.
    """
    conns: Dict[int, socket.socket] = {}
    try:
        for peer in range(rank):  # connect to lower ranks, accept the higher ones
            sock = socket.create_connection(peers[peer][:2], timeout=_CONNECT_TIMEOUT_S)
            sock.sendall(struct.pack("!I", rank))
            conns[peer] = sock
        listener.settimeout(_CONNECT_TIMEOUT_S)
        for _ in range(size - 1 - rank):
            sock, _ = listener.accept()
            sock.settimeout(_CONNECT_TIMEOUT_S)
            conns[_read_rank(sock)] = sock
    except OSError as e:
        # Not fatal for the job: tell the peers reached so far not to watch us.
        _say_goodbye(conns.values(), b"")
        raise RuntimeError(f"peer watchdog of rank {rank} could not connect: {e}") from e
    finally:
        listener.close()
    return conns


def _read_rank(sock: socket.socket) -> int:
    """The rank a peer that just connected sends first (4 bytes, network order)."""
    header = b""
    while len(header) < 4:
        chunk = sock.recv(4 - len(header))
        if not chunk:
            raise ConnectionError("a peer closed its watchdog connection at set-up")
        header += chunk
    return struct.unpack("!I", header)[0]


def _say_goodbye(socks: Iterable[socket.socket], reason: bytes) -> None:
    """Sends the goodbye (``reason``: empty for a normal exit) on every socket and closes
    its sending side; a peer already gone is skipped."""
    for sock in list(socks):
        try:
            sock.setblocking(True)
            sock.settimeout(1.0)
            sock.sendall(_BYE + reason)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class PeerWatchdog:
    """Watches every other rank over its own TCP connections (see the module doc).

    Made by :meth:`connect`, a collective; the constructor takes the connections made.

    Args:
      rank, size: this rank and the world size.
      conns: {peer: its connected socket}, one for every other rank.
      hosts: every rank's host name (named in loss messages).
      timeout_s: seconds from a loss to the forced exit; None: never forced.
      exit_process: whether to end the process (at exit, or after ``timeout_s``) once a
        peer is lost; False in tests that run several watchdogs in one process.
      exit_wait_s: at a normal exit, seconds to wait for every peer to be gone before
        Horovod's shutdown (0: no wait; None: no limit). Needed with process sets only.
    """

    def __init__(self, rank: int, size: int, conns: Dict[int, socket.socket], hosts: List[str],
                 timeout_s: Optional[float] = DEFAULT_TIMEOUT_S, exit_process: bool = True,
                 exit_wait_s: Optional[float] = 0.0):
        self.rank, self.size, self.hosts = rank, size, hosts
        self.timeout_s, self._exit_process = timeout_s, exit_process
        self.exit_wait_s = exit_wait_s
        self._lock = threading.Lock()
        self._lost: Dict[int, float] = {}  # rank -> when its loss was noticed (monotonic)
        self._failed: Dict[int, str] = {}  # rank -> the reason it gave
        self._finished: Set[int] = set()
        self._stopped: Set[int] = set()
        self._gone: Set[int] = set()  # peers whose connection closed, for any reason
        self._ended: Set[int] = set()  # peers that said their last collective is done (end_of_job)
        self._all_ended = threading.Event()  # every peer ended or gone
        self._end_news = threading.Condition(self._lock)  # an end, goodbye or loss arrived
        self._job_ended = False  # every rank agreed on the end (end_of_job returned True)
        self._changed = threading.Event()
        self._activity: List[str] = []
        self._last_activity = "start-up"
        self._closing = False
        self._timer: Optional[threading.Timer] = None
        self._pid = os.getpid()  # a forked child inherits the sockets: it must not use them
        self._conns = conns
        for sock in self._conns.values():
            _keepalive(sock)
            sock.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="tf_fusedemb-peer-watchdog",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def connect(cls, rank: int, size: int, allgather_object: Callable[[Any], List[Any]],
                timeout_s: Optional[float] = DEFAULT_TIMEOUT_S, exit_process: bool = True,
                exit_wait_s: Optional[float] = 0.0) -> "PeerWatchdog":
        """Collective (every rank must call it at the same point of its program): connects
        this rank to every other and starts watching them. ``allgather_object``: ``obj ->
        [obj of rank 0, ..., obj of rank size-1]``, called once, to exchange the addresses;
        the other arguments are the constructor's.

        Raises:
          RuntimeError: some rank could not listen, or this one could not connect (the
            peers it had reached are told not to watch it).
        """
        listener, mine, error = _listen(size)
        peers = allgather_object(mine)  # every rank takes part, even one that failed
        if any(p is None for p in peers):
            if listener is not None:
                listener.close()
            bad = [r for r, p in enumerate(peers) if p is None]
            raise RuntimeError(f"peer watchdog: rank(s) {bad} could not listen" + (
                f" ({error})" if mine is None else ""))
        assert listener is not None  # every rank listens: checked just above
        conns = _connect_mesh(rank, size, peers, listener)
        return cls(rank, size, conns, [p[2] for p in peers], timeout_s, exit_process,
                   exit_wait_s)

    # ---- what the main thread does ---------------------------------------------------
    @contextlib.contextmanager
    def watch(self, activity: str) -> Iterator[None]:
        """Declares what this rank does (named in loss messages); turns an exception
        raised inside because a peer was lost into :class:`PeerLostError`."""
        self._activity.append(activity)
        try:
            yield
        except PeerLostError:
            raise
        except Exception as e:  # pylint: disable=broad-except
            error = self.explain(e)
            if error is None:
                raise
            raise error from e
        finally:
            self._last_activity = "after " + " > ".join(self._activity)
            self._activity.pop()

    def activity(self) -> str:
        return " > ".join(self._activity) if self._activity else self._last_activity

    def explain(self, error: BaseException) -> Optional[PeerLostError]:
        """A PeerLostError for ``error`` if a peer's loss (or failure or early exit)
        explains it, else None. Waits a few seconds for the watchdog's notice when
        ``error`` looks like a failed collective."""
        looks_collective = any(s in str(error) for s in (
            "Horovod", "gloo", "Gloo", "Connection reset", "Connection closed"))
        if looks_collective and not self.peers_gone():
            self._changed.wait(_EXPLAIN_WAIT_S)
        with self._lock:
            lost, failed, finished = dict(self._lost), dict(self._failed), set(self._finished)
        if not (lost or ((failed or finished) and looks_collective)):
            return None
        node = _NODE.search(str(error))
        return PeerLostError(self.size, self.activity(), lost=lost, failed=failed,
                             finished=finished, collective=node.group(1) if node else None)

    def lost(self) -> List[int]:
        """Ranks lost so far (died without shutting down)."""
        with self._lock:
            return sorted(self._lost)

    def peers_gone(self) -> bool:
        with self._lock:
            return bool(self._lost or self._failed or self._finished or self._stopped)

    # ---- the end of the job ----------------------------------------------------------
    def end_of_job(self, timeout_s: Optional[float] = None) -> bool:
        """Collective, after this rank's last collective: tells every peer so and waits
        until every peer has too (or has exited normally). Returns True then: Horovod's
        shutdown at this rank's exit no longer waits for the others (module doc), and no
        collective may follow. Returns False (a warning on stderr) when some peer has not
        ended ``timeout_s`` s later (None: TF_FUSEDEMB_EXIT_WAIT_S, or 120 s); the exit
        then waits as a job without this call does.

        Raises:
          PeerLostError: a peer died, failed or stopped before it ended.
        """
        if self._job_ended:
            return True
        if os.getpid() != self._pid or self._closing:
            return False
        if timeout_s is None:
            timeout_s = self.exit_wait_s or DEFAULT_EXIT_WAIT_S
        for sock in list(self._conns.values()):
            try:  # one byte into an idle socket's buffer: never blocks
                sock.send(_END)
            except OSError:
                pass  # a peer gone: its loss (or goodbye) is what the wait below reports
        deadline = time.monotonic() + timeout_s
        peers = set(range(self.size)) - {self.rank}
        with self._lock:
            while True:
                if self._lost or self._failed or self._stopped:
                    failed = dict(self._failed)
                    failed.update({r: _STOPPED for r in self._stopped})
                    error = PeerLostError(self.size, "the end of the job (end_of_job)",
                                          lost=self._lost, failed=failed)
                    break
                if peers <= self._ended | self._finished:
                    self._job_ended = True
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    running = sorted(peers - self._ended - self._finished)
                    _stderr(f"tf_fusedemb: rank {self.rank} ended its job; "
                            f"{_ranks(running, self.size)} had not after {timeout_s:g} s: "
                            "its exit waits for them (TF_FUSEDEMB_EXIT_WAIT_S)")
                    return False
                self._end_news.wait(min(left, 1.0))
        raise error

    # ---- exit ------------------------------------------------------------------------
    def close(self, reason: str = "") -> None:
        """Says goodbye to every peer (``reason``: why this rank stops, empty for a
        normal exit) and stops watching."""
        if os.getpid() != self._pid or self._closing:
            return
        self._closing = True
        _say_goodbye(self._conns.values(), reason.encode("utf-8", "replace")[:1000])

    def at_exit(self) -> None:
        """Interpreter exit: goodbye (with the uncaught exception, if any), then, when a
        peer was lost, end at once with EXIT_PEER_LOST instead of running Horovod's
        shutdown, which would wait for the dead peer."""
        if os.getpid() != self._pid:
            return
        error = getattr(sys, "last_value", None)
        if self.lost() or isinstance(error, PeerLostError):
            self.close(_STOPPED)
        else:
            self.close("" if error is None else f"{type(error).__name__}: {error}"[:500])
        if self._exit_process and self.lost():
            if self._job_ended and error is None:  # its work was complete: not a failure
                _stderr(f"tf_fusedemb: rank {self.rank} finished; {_ranks(self.lost(), self.size)}"
                        f" {_was(self.lost())} lost after the end of the job; exiting without "
                        "Horovod's shutdown")
                _flush_std()
                os._exit(0)  # pylint: disable=protected-access
            _flush_std()
            os._exit(EXIT_PEER_LOST)  # pylint: disable=protected-access
        if error is None and self.exit_wait_s != 0 and not self._job_ended:
            self._wait_for_peers_to_exit()

    def _wait_for_peers_to_exit(self):
        """A normal exit of a job that did not agree on its end (:meth:`end_of_job`) waits
        until every peer has ended or is gone (see the module doc: process sets). A peer
        lost meanwhile: this rank's own work is complete, so it exits 0 without Horovod's
        shutdown, which would wait for the dead peer."""
        if not self._all_ended.wait(self.exit_wait_s):
            with self._lock:
                running = sorted(set(range(self.size)) - self._gone - self._ended - {self.rank})
            _stderr(f"tf_fusedemb: rank {self.rank} finished; {_ranks(running, self.size)} "
                    f"still running after {self.exit_wait_s:g} s ({EXIT_WAIT_ENV}): shutting "
                    "Horovod down now aborts their collectives in progress")
        elif self.lost():
            _stderr(f"tf_fusedemb: rank {self.rank} finished; {_ranks(self.lost(), self.size)}"
                    f" {_was(self.lost())} lost afterwards; exiting without Horovod's shutdown")
            _flush_std()
            os._exit(0)  # pylint: disable=protected-access

    # ---- the watching thread ---------------------------------------------------------
    def _run(self):
        selector = selectors.DefaultSelector()
        for peer, sock in self._conns.items():
            selector.register(sock, selectors.EVENT_READ, peer)
        received = {peer: b"" for peer in self._conns}
        while selector.get_map():
            for key, _ in selector.select():
                peer = key.data
                sock = self._conns[peer]  # the socket registered for that peer
                try:
                    data = sock.recv(4096)
                except (BlockingIOError, InterruptedError, socket.timeout):
                    continue
                except OSError:
                    data = b""  # reset by the peer's kernel: as good as closed
                if data:
                    received[peer] = self._take_ends(peer, received[peer] + data[:2000])
                    continue
                selector.unregister(sock)
                self._on_gone(peer, received[peer])

    def _take_ends(self, peer, received):
        """Records a peer's "end" (it leads the stream, before any goodbye); returns the
        rest of what was received."""
        if received.startswith(_END):
            with self._lock:
                self._ended.add(peer)
                self._note_end_news()
            received = received.lstrip(_END)
        return received

    def _note_end_news(self):
        """(Lock held.) Wakes end_of_job; sets _all_ended when every peer ended or left."""
        if len(self._gone | self._ended) == self.size - 1:
            self._all_ended.set()
        self._end_news.notify_all()

    def _on_gone(self, peer, message):
        with self._lock:
            self._gone.add(peer)
            self._note_end_news()
            if self._closing:  # this rank is exiting: a goodbye is no news, and a loss
                if not message.startswith(_BYE):  # is recorded, not announced
                    self._lost[peer] = time.monotonic()
                return
        if message.startswith(_BYE):
            reason = message[1:].decode("utf-8", "replace")
            with self._lock:
                if reason == _STOPPED:
                    self._stopped.add(peer)
                elif reason:
                    self._failed[peer] = reason
                else:
                    self._finished.add(peer)
                self._end_news.notify_all()
            self._changed.set()
            return
        forced = "" if not self._exit_process or self.timeout_s is None else \
            f"; it exits (status {EXIT_PEER_LOST}) within {self.timeout_s:g} s"
        # Printed before the main thread is told: it may end the process at once.
        _stderr(f"tf_fusedemb: rank {peer} of {self.size} (host {self.hosts[peer]}) was lost "
                f"while rank {self.rank} was in {self.activity()}: its process ended without "
                f"shutting down (killed or crashed). Rank {self.rank} cannot continue{forced}; "
                "rerun the job to resume from its last complete checkpoint.")
        with self._lock:
            self._lost[peer] = time.monotonic()
            first = len(self._lost) == 1
            self._end_news.notify_all()
        self._changed.set()
        if first and self._exit_process and self.timeout_s is not None:
            timer = self._timer = threading.Timer(self.timeout_s, self._force_exit)
            timer.daemon = True
            timer.start()

    def _force_exit(self):
        _stderr(f"tf_fusedemb: rank {self.rank} still running {self.timeout_s:g} s after "
                f"losing {_ranks(self.lost(), self.size)} (during {self.activity()}); "
                f"exiting with status {EXIT_PEER_LOST}")
        self.close(_STOPPED)
        _flush_std()
        os._exit(EXIT_PEER_LOST)  # pylint: disable=protected-access


def _stderr(text):
    try:
        os.write(2, (text + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def _flush_std():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # pylint: disable=broad-except
            pass


_WATCHDOG: Optional[PeerWatchdog] = None


def start_watchdog(rank: int, size: int, allgather_object: Callable[[Any], List[Any]],
                   wait_at_exit: bool = False) -> Optional[PeerWatchdog]:
    """The process's watchdog, started on the first call (every rank must make it at the
    same point); None in one process, under Horovod elastic, with TF_FUSEDEMB_WATCHDOG=0,
    or when it could not connect (a warning says why; the job goes on without it).
    ``wait_at_exit``: the job has process sets, so a normal exit waits for the peers
    (TF_FUSEDEMB_EXIT_WAIT_S)."""
    global _WATCHDOG
    if _WATCHDOG is not None or size < 2:
        return _WATCHDOG
    if os.environ.get(ENABLE_ENV, "1").strip().lower() in ("0", "false", "off", "no") or \
            os.environ.get("HOROVOD_ELASTIC") == "1":
        return None
    try:
        exit_wait = timeout_from_env(EXIT_WAIT_ENV, DEFAULT_EXIT_WAIT_S) if wait_at_exit else 0
        _WATCHDOG = PeerWatchdog.connect(rank, size, allgather_object, timeout_from_env(),
                                         exit_wait_s=exit_wait)
    except RuntimeError as e:
        _stderr(f"tf_fusedemb: WARNING: {e}; running without the peer watchdog")
        return None
    atexit.register(_WATCHDOG.at_exit)  # after hvd.init's atexit: runs before its shutdown
    return _WATCHDOG

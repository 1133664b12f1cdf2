"""Exceptions torch_afdep raises (besides ValueError/TypeError for bad arguments)."""


class AfdepError(RuntimeError):
    """Base class of torch_afdep's runtime errors."""


class AfdepTimeoutError(AfdepError):
    """A receiver waited longer than ``Config.timeout_s`` for a peer.

    Attributes: ``peer`` (group rank waited for, or -1 when unknown), ``phase``
    (``"dispatch"`` or ``"combine"``), ``rank`` (the rank that waited).
    """

    def __init__(self, message: str, *, peer: int = -1, phase: str = "", rank: int = -1):
        super().__init__(message)
        self.peer = peer
        self.phase = phase
        self.rank = rank


class AfdepRouteError(AfdepError, ValueError):
    """An expert id outside [-1, num_experts) (or another routing value out of range).

    Raised before anything is sent wherever the values can be read (eager calls, and the CPU
    path inside compiled code too); inside CUDA graph replays and compiled CUDA code the kernels
    skip the offending entries (nothing is written out of bounds), the exchange completes, and
    the slot's next dispatch (Attention) or receive (FFN) raises it. A
    ``ValueError``, so ``except ValueError`` catches it on every path. The buffer stays
    usable."""


class AfdepStateError(AfdepError):
    """Calls out of order (two dispatches without a collect, a reply before a receive, a
    stale receipt) or use of a closed buffer."""


class AfdepPeerLostError(AfdepTimeoutError):
    """A peer's process exited or its connection closed in the middle of an exchange (a kind
    of ``AfdepTimeoutError``: the exchange cannot finish). Same attributes."""


class AfdepBucketError(AfdepRouteError):
    """Ranks of one exchange used different buckets (a kind of ``AfdepRouteError``, so a
    ``ValueError``). Reported on every rank of the exchange, CPU and CUDA; nothing was
    exchanged for the mismatched pair and the buffer stays usable. ``peer``: a rank with the
    other bucket; ``phase``; ``rank``: the reporting rank."""

    def __init__(self, message: str, *, peer: int = -1, phase: str = "", rank: int = -1):
        super().__init__(message)
        self.peer = peer
        self.phase = phase
        self.rank = rank

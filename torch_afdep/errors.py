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


class AfdepRouteError(AfdepError):
    """The device saw an expert id outside [-1, num_experts) (e.g. inside a graph replay);
    the offending entries were skipped, nothing was written out of bounds."""


class AfdepStateError(AfdepError):
    """Calls out of order (two dispatches without a collect, a reply before a receive, a
    stale receipt) or use of a closed buffer."""

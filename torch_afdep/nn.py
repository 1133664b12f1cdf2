"""``torch.nn`` building blocks for an AFD MoE layer that hide the exchange.

``AfdMoE(buffer, intermediate_size)`` is one MoE layer split across the roles of ``buffer``:

- on Attention ranks it holds the router (linear -> softmax -> top-k, optionally renormalized
  over the chosen experts) and ``forward(x, slot=)`` routes ``x``, dispatches it and returns
  the combined expert output (``dispatch`` / ``combine`` split the two halves, so two
  micro-batches can overlap: dispatch slot 0, compute, dispatch slot 1, combine slot 0 ...);
- on FFN ranks it holds this rank's SwiGLU experts (``SwiGLUExperts``) and ``forward(slot=)``
  receives, runs the experts, applies each routing weight once, and replies. The buffer's
  ``Config.receive_layout`` picks what it receives: ``"experts"`` (default; expert-major rows,
  ``SwiGLUExperts.forward``) or ``"tokens"`` (one row per token with its local expert ids
  and weights, ``SwiGLUExperts.forward_tokens``; the reply is one weighted sum per token).

Both roles trace under ``torch.compile(fullgraph=True)`` and capture in CUDA graphs (no host
reads on the default path; static shapes from ``bucket``). Weights load from full stacked
tensors ``[E, ...]`` (each FFN rank keeps its experts) or from DTensors sharded over the FFN
mesh (``torch_afdep.distributed.shard_experts``): ``AfdMoE.load_weights``.

Expert compute (``SwiGLUExperts(method=)``) on the received rows ``x[N, H]`` (N = A*bucket*R,
capacity-sized; rows past ``expert_offsets[-1]`` are padding):

- ``"grouped"``: ``torch._grouped_mm`` with ``offs = expert_offsets[1:]`` (two grouped GEMMs,
  gate+up fused). No host reads; compiled and graph-capturable. Used when a probe shows it
  runs for the weights' device and dtype (on CPU it runs for float32 and bfloat16 in torch
  2.13, but traces only for bfloat16; on CUDA it needs bfloat16 and sm90+).
- ``"dense"``: every local expert runs on every row and a per-row mask keeps the right one
  (the row's expert comes from ``searchsorted(expert_offsets[1:], row)``). No host reads, so
  also compiled and graph-capturable, but E_local times the FLOPs: the fallback.
- ``"loop"``: a Python loop over the local experts slicing ``x`` with the offsets. Exact work,
  but it reads ``expert_offsets`` on the host (``.tolist()``): one device-to-host copy and
  stream synchronization per layer call on CUDA, a graph break under ``torch.compile`` and
  not capturable in a CUDA graph. Eager only.
- ``"auto"`` (default): grouped when available, else dense when compiling or capturing,
  else loop.

The token layout (``SwiGLUExperts.forward_tokens`` on a ``TokenReceived``: x [N, H] with
N = ``Config.token_rows(bucket)``, expert_ids [N, k] local or -1, weights [N, k]) runs the
same formulations on fixed-size buffers (no host reads on the grouped and dense paths): the
N*k (row, column) entries are sorted by local expert (entries with id -1 last), giving
expert-major rows ``x[entry's row]`` and their ``expert_offsets``; grouped and loop run on
those N*k rows exactly as above, each result is multiplied by its entry's weight, and the
entries are summed back into their rows with ``index_add`` in fp32. ``"dense"`` needs no
sort: every local expert runs on the N token rows, each row scaled by that expert's weight
in the row (N*E_local rows of work, not N*k*E_local). Rows without a token come out zero.

``reference_moe`` is the same layer computed in float64 in one process (tests, examples).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from . import reference as _ref
from .config import ATTENTION, FFN, FP8_BLOCK, Config
from .functional import afd_combine, afd_dispatch, afd_receive, afd_reply

METHODS = ("auto", "grouped", "dense", "loop")

#: Parameter dtypes of the experts (``SwiGLUExperts``, ``AfdMoE(dtype=)``) and the router
#: (``TopKRouter``, ``AfdMoE(router_dtype=)``): the float dtypes their initialization and
#: every expert method run in on CPU and CUDA ("dense" and "loop" everywhere; "grouped" only
#: where ``grouped_mm_supported`` says so, which "auto" respects). FP8 is a payload dtype
#: (``Config.dtype``), not a parameter dtype.
PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

_GROUPED_OK: Dict[Tuple[str, torch.dtype], bool] = {}


# ---- argument checks (TypeError / ValueError naming the argument, before any work) ----------
def _check_count(name: str, value, low: int = 1) -> int:
    """An int (not bool) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {low}, got {type(value).__name__} "
                        f"{value!r}")
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value}")
    return value


def _check_method(method) -> str:
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method


def _check_param_dtype(name: str, dtype) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or dtype not in PARAM_DTYPES:
        allowed = ", ".join(str(d) for d in PARAM_DTYPES)
        raise TypeError(f"{name} must be one of {allowed} (parameter dtypes the experts and "
                        f"the router run in), got {dtype!r}")
    return dtype


def _check_weight(name: str, t, shape: Tuple[int, ...], what: str) -> torch.Tensor:
    """A floating-point tensor of ``shape``."""
    want = "[" + ", ".join(str(s) for s in shape) + "]"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {want} ({what}), got "
                        f"{type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {want} ({what}), got {list(t.shape)}")
    return t


# ---- helpers -------------------------------------------------------------------------------
def grouped_mm_supported(device, dtype: torch.dtype, traced: bool = False) -> bool:
    """Whether ``torch._grouped_mm`` runs (and is right) for ``dtype`` on ``device``'s type;
    with ``traced``, also whether it traces (its meta kernel, which ``torch.compile`` uses,
    accepts only bfloat16 in torch 2.9-2.13 even where the CPU kernel takes float32).

    Probed once per (device type, dtype) with a tiny problem; never call it while a CUDA
    graph is being captured (``SwiGLUExperts`` probes at construction)."""
    device = torch.device(device)
    key = (device.type, dtype)
    if key not in _GROUPED_OK:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                g = torch.Generator().manual_seed(0)
                a = torch.randn(6, 16, generator=g).to(device=device, dtype=dtype)
                b = torch.randn(2, 32, 16, generator=g).to(device=device, dtype=dtype)
                offs = torch.tensor([2, 5], dtype=torch.int32, device=device)
                y = torch._grouped_mm(a, b.transpose(1, 2), offs=offs)
                want = torch.cat([a[:2] @ b[0].T, a[2:5] @ b[1].T]).float()
                ok = bool(torch.allclose(y[:5].float(), want, rtol=5e-2, atol=5e-2))
            except Exception:  # noqa: BLE001 - unsupported device/dtype/arch
                ok = False
        _GROUPED_OK[key] = ok
    if not traced or not _GROUPED_OK[key]:
        return _GROUPED_OK[key]
    tkey = ("meta", dtype)
    if tkey not in _GROUPED_OK:
        try:
            a = torch.empty(6, 16, dtype=dtype, device="meta")
            b = torch.empty(2, 32, 16, dtype=dtype, device="meta")
            torch._grouped_mm(a, b.transpose(1, 2),
                              offs=torch.empty(2, dtype=torch.int32, device="meta"))
            _GROUPED_OK[tkey] = True
        except Exception:  # noqa: BLE001
            _GROUPED_OK[tkey] = False
    return _GROUPED_OK[tkey]


def topk_route(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool = True
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k router: logits = x @ weight.T in float32 -> softmax -> top-k.

    Returns (expert_ids [T, k] int64, weights [T, k] float32); with ``renormalize`` the k
    weights of a token sum to 1."""
    logits = F.linear(x.to(weight.dtype), weight).float()
    probs = logits.softmax(dim=-1)
    w, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w.to(torch.float32)


quantize_fp8 = _ref.quantize_fp8  # the contract's FP8 payload (torch_afdep.reference)


def dequantize_rows(x: torch.Tensor, x_scales: Optional[torch.Tensor], dtype: torch.dtype
                    ) -> torch.Tensor:
    """Received rows in ``dtype``: FP8 rows times their per-128 scales, BF16 rows cast."""
    if x_scales is None or x_scales.numel() == 0 or x.dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    return (x.float() * x_scales.repeat_interleave(FP8_BLOCK, dim=1)).to(dtype)


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
           ) -> torch.Tensor:
    """[n, H] -> [n, H]: w2 (silu(w1 x) * w3 x), weights w1, w3 [I, H], w2 [H, I]."""
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def reference_moe(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                  w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The MoE layer in float64 in one process: out[t] = sum_j weights[t, j] *
    swiglu_{expert_ids[t, j]}(x[t]) over entries >= 0 (a repeated id counts once, as in the
    exchange). Full stacked weights: w1, w3 [E, I, H], w2 [E, H, I]."""
    from .reference import dedupe

    xd = x.detach().to(torch.float64).cpu()
    ids = dedupe(expert_ids.cpu())
    w = weights.detach().cpu().to(torch.float64)
    out = torch.zeros_like(xd)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        y = swiglu(xd[tok], *(t[e].detach().cpu().to(torch.float64) for t in (w1, w3, w2)))
        out.index_add_(0, tok, y * w[tok, j, None])
    return out


def reference_layer(x: torch.Tensor, router_weight: torch.Tensor, w1: torch.Tensor,
                    w3: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool = True
                    ) -> torch.Tensor:
    """Router (``topk_route``, float32 as in ``TopKRouter``) and experts (float64) of one MoE
    layer in one process."""
    ids, w = topk_route(x, router_weight, top_k, renormalize)
    return reference_moe(x, ids, w, w1, w3, w2)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of an expert-sharded DTensor (``shard_experts``), else ``t``."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return t
    if isinstance(t, DTensor):
        from .distributed.mesh import local_experts

        return local_experts(t)
    return t


# ---- modules -------------------------------------------------------------------------------
class TopKRouter(torch.nn.Module):
    """linear (no bias) -> softmax (float32) -> top-k (-> renormalize).

    Parameter: ``weight`` [E, H] in ``dtype`` (one of ``PARAM_DTYPES``). ``forward(x [T, H]``,
    any float dtype) returns (expert_ids [T, k] int64, weights [T, k] float32)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *,
                 renormalize: bool = True, dtype: torch.dtype = torch.float32, device=None):
        _check_count("hidden_size", hidden_size)
        _check_count("num_experts", num_experts)
        _check_count("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}] (num_experts), got {top_k}")
        _check_param_dtype("dtype", dtype)
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.weight = torch.nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=dtype, device=device),
            requires_grad=False)
        torch.nn.init.normal_(self.weight, std=hidden_size ** -0.5)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return topk_route(x, self.weight, self.top_k, self.renormalize)


class SwiGLUExperts(torch.nn.Module):
    """This FFN rank's SwiGLU experts applied to received rows.

    Parameters: ``w13`` [E_local, 2I, H] (gate w1 and up w3 stacked), ``w2`` [E_local, H, I],
    both in ``dtype`` (one of ``PARAM_DTYPES``). The constructor checks num_local_experts,
    hidden_size, intermediate_size (ints >= 1), first_expert (int >= 0), method and dtype
    before allocating (TypeError / ValueError naming the argument).
    ``forward(x, weights, expert_offsets, x_scales=None)`` takes a ``Received``'s fields
    (expert layout) and returns the reply rows [N, H] bfloat16: row i = weights[i] *
    swiglu_{e(i)}(x[i]) for i < expert_offsets[-1], zeros past it.
    ``forward_tokens(x, expert_ids, weights, x_scales=None)`` takes a ``TokenReceived``'s
    fields (token layout) and returns one row per token: the weighted sum of its local
    experts' outputs. ``method``: see the module docstring."""

    def __init__(self, num_local_experts: int, hidden_size: int, intermediate_size: int, *,
                 first_expert: int = 0, dtype: torch.dtype = torch.bfloat16, device=None,
                 method: str = "auto"):
        _check_count("num_local_experts", num_local_experts)
        _check_count("hidden_size", hidden_size)
        _check_count("intermediate_size", intermediate_size)
        _check_count("first_expert", first_expert, 0)
        _check_method(method)
        _check_param_dtype("dtype", dtype)
        super().__init__()
        self.num_local_experts = num_local_experts
        self.first_expert = first_expert
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.method = method
        e, h, i = num_local_experts, hidden_size, intermediate_size
        self.w13 = torch.nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype, device=device),
                                      requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.empty(e, h, i, dtype=dtype, device=device),
                                     requires_grad=False)
        torch.nn.init.normal_(self.w13, std=h ** -0.5)
        torch.nn.init.normal_(self.w2, std=i ** -0.5)
        if method in ("auto", "grouped"):
            ok = grouped_mm_supported(self.w13.device, dtype)
            grouped_mm_supported(self.w13.device, dtype, traced=True)  # probe now, not later
            if method == "grouped" and not ok:
                raise ValueError(f"method='grouped' needs torch._grouped_mm, which does not "
                                 f"run for {dtype} on {self.w13.device.type} here; use "
                                 f"method='auto', 'dense' or 'loop'")

    @torch.no_grad()
    def load(self, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> None:
        """Copy this rank's experts in: w1, w3 [E_local, I, H], w2 [E_local, H, I] (local
        tensors, or DTensors sharded over the FFN mesh whose local shard has those shapes)."""
        e, i, h = self.num_local_experts, self.intermediate_size, self.hidden_size
        for name, t in (("w1", w1), ("w3", w3), ("w2", w2)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor (this rank's experts), got "
                                f"{type(t).__name__}")
        w1, w3, w2 = _local(w1), _local(w3), _local(w2)
        for name, t, shape in (("w1", w1, (e, i, h)), ("w3", w3, (e, i, h)),
                               ("w2", w2, (e, h, i))):
            _check_weight(name, t, shape, "this rank's experts")
        self.w13[:, :i].copy_(w1)
        self.w13[:, i:].copy_(w3)
        self.w2.copy_(w2)

    def resolved_method(self) -> str:
        """The method ``forward`` uses now (``"auto"`` resolved for eager, compiled or
        captured execution)."""
        if self.method != "auto":
            return self.method
        compiling = torch.compiler.is_compiling()
        if grouped_mm_supported(self.w13.device, self.w13.dtype, traced=compiling):
            return "grouped"
        capturing = self.w13.is_cuda and torch.cuda.is_current_stream_capturing()
        return "dense" if compiling or capturing else "loop"

    def _expert_rows(self, xc: torch.Tensor, expert_offsets: torch.Tensor, method: str
                     ) -> torch.Tensor:
        """Every expert-major row through its expert, unweighted.

        Arguments:
            xc: [n, H] in the parameters' dtype, rows grouped by local expert.
            expert_offsets: [E_local + 1] int32 prefix sums (rows of local expert e are
                ``xc[expert_offsets[e]:expert_offsets[e+1]]``).
            method: ``"grouped"``, ``"dense"`` or ``"loop"`` (resolved).
        Returns:
            y: [n, H] float32 (rows past ``expert_offsets[-1]`` unspecified: mask them).
        """
        n = xc.shape[0]
        i = self.intermediate_size
        if method == "grouped":
            ends = expert_offsets[1:]
            gu = torch._grouped_mm(xc, self.w13.transpose(1, 2), offs=ends)  # [n, 2I]
            a = F.silu(gu[:, :i]) * gu[:, i:]
            return torch._grouped_mm(a, self.w2.transpose(1, 2), offs=ends).float()  # [n, H]
        if method == "dense":
            rows = torch.arange(n, device=xc.device, dtype=expert_offsets.dtype)
            expert = torch.searchsorted(expert_offsets[1:], rows, right=True)
            y = torch.zeros(n, self.hidden_size, dtype=torch.float32, device=xc.device)
            for e in range(self.num_local_experts):
                ye = swiglu(xc, self.w13[e, :i], self.w13[e, i:], self.w2[e]).float()
                y = torch.where((expert == e)[:, None], ye, y)
            return y
        if method == "loop":
            offs = expert_offsets.tolist()  # host read: a device->host sync on CUDA
            y = torch.zeros(n, self.hidden_size, dtype=torch.float32, device=xc.device)
            for e in range(self.num_local_experts):
                lo, hi = offs[e], offs[e + 1]
                if hi > lo:
                    y[lo:hi] = swiglu(xc[lo:hi], self.w13[e, :i], self.w13[e, i:],
                                      self.w2[e]).float()
            return y
        raise ValueError(f"unknown method {method!r}")  # pragma: no cover

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_offsets: torch.Tensor,
                x_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The expert layout's reply rows.

        Arguments:
            x: [N, H] payload dtype (bfloat16 or float8_e4m3fn), rows grouped by local expert
                (a ``Received.x``; rows past ``expert_offsets[-1]`` may hold anything).
            weights: [N] float32, each row's routing weight.
            expert_offsets: [E_local + 1] int32 prefix sums of the rows per local expert.
            x_scales: [N, H/128] float32 for FP8 rows, else None.
        Returns:
            rows: [N, H] bfloat16, row i = weights[i] * swiglu_{e(i)}(x[i]) for
            i < expert_offsets[-1], zeros past it.
        """
        n = x.shape[0]
        xc = dequantize_rows(x, x_scales, self.w13.dtype)
        y = self._expert_rows(xc, expert_offsets, self.resolved_method())
        valid = torch.arange(n, device=x.device) < expert_offsets[-1]
        # where(), not a multiply: padding rows may hold anything (NaN included).
        out = torch.where(valid[:, None], y * weights[:, None], 0.0)
        return out.to(torch.bfloat16)

    def forward_tokens(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                       x_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The token layout's reply rows (fixed-size buffers, no host reads except ``"loop"``;
        see the module docstring). ``x`` is only read (it may be a view of the receive
        window).

        Arguments:
            x: [N, H] payload dtype (bfloat16 or float8_e4m3fn), one row per token (a
                ``TokenReceived.x``; rows whose ids are all -1 may hold anything).
            expert_ids: [N, k] int32 (or int64), local expert ids in [0, E_local), -1 for
                columns this rank does not serve.
            weights: [N, k] float32, the routing weight of each column (ignored where the id
                is -1).
            x_scales: [N, H/128] float32 for FP8 rows, else None.
        Returns:
            rows: [N, H] bfloat16, row r = sum over columns j with expert_ids[r, j] >= 0 of
            weights[r, j] * swiglu_{expert_ids[r, j]}(x[r]), summed in fp32; zero for rows
            without a local id.
        """
        n, k = expert_ids.shape
        el, h, i = self.num_local_experts, self.hidden_size, self.intermediate_size
        xc = dequantize_rows(x, x_scales, self.w13.dtype)
        ids = expert_ids.to(torch.int64)
        valid = (ids >= 0) & (ids < el)  # [N, k]
        w = torch.where(valid, weights.to(torch.float32), 0.0)  # poisoned weights stay out
        method = self.resolved_method()
        if method == "dense":
            # coef[r, e]: the weight of local expert e in row r (0: the row does not use it).
            coef = torch.zeros(n, el, dtype=torch.float32, device=x.device)
            coef = coef.scatter_add(1, torch.where(valid, ids, 0), w)
            out = torch.zeros(n, h, dtype=torch.float32, device=x.device)
            for e in range(el):
                ye = swiglu(xc, self.w13[e, :i], self.w13[e, i:], self.w2[e]).float()
                ce = coef[:, e:e + 1]
                out = out + torch.where(ce != 0, ye * ce, 0.0)
        else:
            # The N*k entries sorted by local expert (invalid ones last): expert-major rows.
            key = torch.where(valid, ids, el).reshape(-1)  # [N*k]
            order = torch.argsort(key, stable=True)
            key = key[order]
            offsets = torch.searchsorted(
                key, torch.arange(el + 1, device=x.device, dtype=key.dtype), out_int32=True)
            rows = order // k  # [N*k]: the token row of each sorted entry
            y = self._expert_rows(xc[rows], offsets, method)  # [N*k, H] float32
            contrib = torch.where((key < el)[:, None], y * w.reshape(-1)[order][:, None], 0.0)
            out = torch.zeros(n, h, dtype=torch.float32, device=x.device).index_add(
                0, rows, contrib)
        # Rows without a token may hold anything (NaN included): zero them.
        out = torch.where(valid.any(dim=1)[:, None], out, 0.0)
        return out.to(torch.bfloat16)


class AfdMoE(torch.nn.Module):
    """One AFD MoE layer on ``buffer``'s group: router + dispatch/combine on Attention ranks,
    receive + SwiGLU experts + reply on FFN ranks.

    Arguments:
        buffer: an open ``torch_afdep.Buffer`` (create it first: it is collective). Its role
            picks what this module holds; its config gives H, E, k, the layout and the
            receive layout (``"experts"`` or ``"tokens"``: which expert path the FFN runs).
        intermediate_size: I of every expert, an int >= 1.
        bucket: static token bucket of every exchange, an int in [1, capacity] (default: the
            capacity); Attention ranks pass at most this many tokens.
        renormalize: renormalize the top-k weights of a token to sum to 1.
        dtype: expert parameter dtype, one of ``PARAM_DTYPES`` (bfloat16, float16, float32,
            float64); expert computation runs in it, the exchange in ``config.dtype`` (FP8
            payloads are quantized per 128 elements on Attention ranks).
        router_dtype: router parameter dtype, one of ``PARAM_DTYPES`` (logits and softmax are
            float32 either way).
        device: parameter device (default: the buffer's).
        method: expert computation, one of ``METHODS``, see the module docstring.

    Every rank checks buffer, intermediate_size, bucket, method, dtype and router_dtype first,
    whatever its role (TypeError / ValueError naming the argument; nothing allocated, nothing
    sent).

    Attention: ``forward(x [T, H], slot=0) -> [T, H]`` (x's dtype), or ``dispatch(x, slot=)``
    then ``combine(route, slot=)`` to overlap micro-batches. FFN: ``forward(slot=0)`` serves
    one exchange and returns the reply's dependency token.
    """

    def __init__(self, buffer, intermediate_size: int, *, bucket: Optional[int] = None,
                 renormalize: bool = True, dtype: torch.dtype = torch.bfloat16, device=None,
                 method: str = "auto", router_dtype: torch.dtype = torch.float32):
        from .buffer import Buffer

        # The same checks on every rank, before anything else (the FFN ranks' experts would
        # otherwise fail deep inside torch, the Attention ranks' not at all).
        if not isinstance(buffer, Buffer):
            raise TypeError(f"buffer must be a torch_afdep.Buffer (create it first, on every "
                            f"rank of the group), got {type(buffer).__name__}")
        _check_count("intermediate_size", intermediate_size)
        cfg: Config = buffer.config
        bucket = cfg.capacity_tokens_per_rank if bucket is None else cfg.check_bucket(bucket)
        _check_method(method)
        _check_param_dtype("dtype", dtype)
        _check_param_dtype("router_dtype", router_dtype)
        super().__init__()
        self.config = cfg
        self.group_name = buffer.group_name
        self.buffer_id = buffer.buffer_id
        self.role = buffer.role
        self.role_index = buffer.role_index
        self.intermediate_size = intermediate_size
        self.bucket = bucket
        #: Where inputs must live: the exchange runs on the buffer's device.
        self.buffer_device = torch.device(buffer.device)
        device = buffer.device if device is None else torch.device(device)
        if self.role == ATTENTION:
            self.router = TopKRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k,
                                     renormalize=renormalize, dtype=router_dtype,
                                     device=device)
            self.experts = None
        else:
            el = cfg.experts_per_rank
            self.router = None
            self.experts = SwiGLUExperts(el, cfg.hidden_size, intermediate_size,
                                         first_expert=self.role_index * el, dtype=dtype,
                                         device=device, method=method)

    # ---- weights ----------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, router_weight: Optional[torch.Tensor] = None,
                     w1: Optional[torch.Tensor] = None, w3: Optional[torch.Tensor] = None,
                     w2: Optional[torch.Tensor] = None) -> None:
        """Load the layer's weights; each rank takes what its role holds (and checks it:
        TypeError / ValueError naming the argument and the expected shape, nothing copied).

        Arguments (any floating-point dtype, cast to the parameters'):
            router_weight: [E, H] (Attention ranks).
            w1, w3: [E, I, H], and w2: [E, H, I] (FFN ranks): full stacks in global expert
                order (FFN index f keeps experts [f*E/F, (f+1)*E/F)), or this rank's experts
                ([E_local, I, H] / [E_local, H, I]), or DTensors from ``shard_experts`` (this
                rank's shard is used as is).
        """
        cfg = self.config
        e, h, i = cfg.num_experts, cfg.hidden_size, self.intermediate_size
        if self.role == ATTENTION:
            if router_weight is None:
                raise ValueError(f"Attention ranks need router_weight [{e}, {h}]")
            _check_weight("router_weight", router_weight, (e, h), "[num_experts, hidden_size]")
            self.router.weight.copy_(router_weight)
            return
        if w1 is None or w3 is None or w2 is None:
            raise ValueError(f"FFN ranks need w1, w3 [{e}, {i}, {h}] and w2 [{e}, {h}, {i}]")
        el, lo = cfg.experts_per_rank, self.experts.first_expert
        mine = {}
        for name, t, tail in (("w1", w1, (i, h)), ("w3", w3, (i, h)), ("w2", w2, (h, i))):
            full, local = (e,) + tail, (el,) + tail
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor {list(full)}, got "
                                f"{type(t).__name__}")
            t = _local(t)
            if tuple(t.shape) not in (full, local):
                raise ValueError(f"{name} must have shape {list(full)} (all experts) or "
                                 f"{list(local)} (this rank's experts), got {list(t.shape)}")
            mine[name] = t[lo:lo + el] if t.shape[0] == e and e != el else t
        self.experts.load(mine["w1"], mine["w3"], mine["w2"])

    # ---- Attention ----------------------------------------------------------------------------
    def _check_x(self, x) -> None:
        """x must be a floating-point [T, H] tensor on the buffer's device, T <= bucket.
        Static metadata only (no host reads of values): traceable under
        ``torch.compile(fullgraph=True)`` and free in CUDA graph capture."""
        h = self.config.hidden_size
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor [T, {h}] (hidden states), got "
                            f"{type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"x must have a floating-point dtype (hidden states [T, {h}]), "
                            f"got {x.dtype}")
        if x.dim() != 2 or x.shape[1] != h:
            raise ValueError(f"x must have shape [T, {h}] (T tokens, hidden_size {h}), got "
                             f"{list(x.shape)}")
        if x.shape[0] > self.bucket:
            raise ValueError(f"x has {x.shape[0]} tokens but bucket is {self.bucket}: need "
                             f"T <= bucket")
        if x.device != self.buffer_device:
            raise ValueError(f"x must be on {self.buffer_device} (the buffer's device), got "
                             f"{x.device}")

    def _payload(self, x: torch.Tensor):
        if self.config.dtype == torch.float8_e4m3fn:
            return quantize_fp8(x)
        return x.to(torch.bfloat16).contiguous(), None

    def dispatch(self, x: torch.Tensor, *, slot: int = 0, return_routing: bool = False):
        """Attention: route ``x`` and dispatch it on ``slot``.

        Arguments:
            x: [T, H], T <= bucket, any float dtype, on the buffer's device (checked before
                routing: TypeError / ValueError naming x; cast to the buffer's payload dtype,
                FP8 quantized here in blocks of 128).
            slot: the micro-batch slot.
            return_routing: also return the router's choice.
        Returns:
            route: [T] int64, the handle for ``combine`` (bit f: the token reached FFN
                index f); with ``return_routing`` the tuple (route, expert_ids [T, k] int64,
                weights [T, k] float32).
        """
        if self.role != ATTENTION:
            raise TypeError("dispatch is for Attention ranks; FFN ranks call moe(slot=...)")
        self._check_x(x)
        ids, w = self.router(x)
        payload, scales = self._payload(x)
        route = afd_dispatch(payload, ids, w, group=self.group_name, buffer_id=self.buffer_id,
                             bucket=self.bucket, x_scales=scales, slot=slot)
        return (route, ids, w) if return_routing else route

    def combine(self, route: torch.Tensor, *, slot: int = 0) -> torch.Tensor:
        """[T, H] bfloat16: the combined expert output of the exchange on ``slot``."""
        return afd_combine(route, group=self.group_name, buffer_id=self.buffer_id, slot=slot)

    # ---- FFN ----------------------------------------------------------------------------------
    def serve(self, *, slot: int = 0) -> torch.Tensor:
        """FFN: receive the exchange on ``slot``, run the experts (expert-major rows, or one
        row per token in the token layout), reply.

        Arguments:
            slot: the micro-batch slot.
        Returns:
            done: [0] int32, the reply's dependency token.
        """
        rec = afd_receive(group=self.group_name, buffer_id=self.buffer_id, bucket=self.bucket,
                          slot=slot)
        if self.config.receive_layout == "tokens":
            rows = self.experts.forward_tokens(rec.x, rec.expert_ids, rec.weights,
                                               rec.x_scales)
        else:
            rows = self.experts(rec.x, rec.weights, rec.expert_offsets, rec.x_scales)
        return afd_reply(rows, rec.receipt, group=self.group_name, buffer_id=self.buffer_id)

    def forward(self, x: Optional[torch.Tensor] = None, *, slot: int = 0,
                return_routing: bool = False):
        """Attention: ``moe(x, slot=)`` with x [T, H] (T <= bucket, any float dtype, on the
        buffer's device; checked before routing) returns the layer's output [T, H] in ``x``'s
        dtype (with ``return_routing``: (out, expert_ids [T, k] int64, weights [T, k]
        float32)). FFN: ``moe(slot=)`` serves the exchange (``serve``) and returns its
        dependency token, [0] int32."""
        if self.role == FFN:
            if x is not None:
                raise TypeError("on FFN ranks AfdMoE takes no input: call it as moe(slot=...)")
            return self.serve(slot=slot)
        if x is None:
            raise TypeError("on Attention ranks AfdMoE needs x [T, H]")
        route, ids, w = self.dispatch(x, slot=slot, return_routing=True)
        out = self.combine(route, slot=slot).to(x.dtype)
        return (out, ids, w) if return_routing else out

    def extra_repr(self) -> str:
        return (f"role={self.role}, index={self.role_index}, bucket={self.bucket}, "
                f"group={self.group_name!r}, buffer_id={self.buffer_id}")


__all__ = ["AfdMoE", "SwiGLUExperts", "TopKRouter", "topk_route", "quantize_fp8",
           "dequantize_rows", "swiglu", "reference_moe", "reference_layer",
           "grouped_mm_supported", "METHODS", "PARAM_DTYPES"]

"""Argument checks shared by the role API (``Buffer``) and the functional API (``afd_*``):
each raises TypeError / ValueError naming the argument and what is allowed, before anything
is sent. Checks that need tensor values on the host (expert id ranges) run where the data
is: on the CPU inside the transport (so compiled code gets them too), on CUDA eagerly here
unless ``AFDEP_CHECK_INPUTS=0`` (inside CUDA graphs the kernels check and report)."""

from __future__ import annotations

from typing import Optional

import torch

from . import env
from .config import Config
from .errors import AfdepRouteError
from .types import Receipt, TokenReceipt

ID_DTYPES = (torch.int32, torch.int64)


def check_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def python_types(device: torch.device, ints=(), tensors=(), optional_tensors=()) -> None:
    """The checks that must happen before an op is called: Python types (the op's schema would
    refuse them with torch's own error) and tensor devices (the dispatcher picks the kernel by
    device: a meta or wrong-device tensor would never reach our checks). ``ints`` and
    ``tensors`` are (name, value) pairs."""
    for name, v in ints:
        check_int(name, v)
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in optional_tensors:
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    for name, t in tuple(tensors) + tuple(optional_tensors):
        if t is not None and t.device != device:
            raise ValueError(f"{name} must be on {device} (the buffer's device), got {t.device}")


def check_tensor(name: str, t, dtypes, shape, device) -> None:
    """TypeError/ValueError naming ``name`` unless t is a contiguous tensor of one of
    ``dtypes`` with ``shape`` (None entries match any size) on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (the buffer's device), got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")
    if t.requires_grad:
        raise ValueError(f"{name} requires grad, but the exchange has no autograd: pass "
                         f"{name}.detach()")


def expert_id_error(bad: int, num_experts: int) -> AfdepRouteError:
    """The error for an expert id outside [-1, num_experts) (one text on every path)."""
    return AfdepRouteError(
        f"expert_ids must be in [-1, {num_experts}) (num_experts={num_experts}; -1 = no "
        f"expert), got {bad}")


def check_expert_id_values(expert_ids: torch.Tensor, num_experts: int) -> None:
    """AfdepRouteError (a ValueError) naming expert_ids and its range when an id is outside
    [-1, num_experts). Reads the values (a host sync on CUDA)."""
    if expert_ids.numel() == 0:
        return
    lo, hi = int(expert_ids.min()), int(expert_ids.max())
    if lo < -1 or hi >= num_experts:
        raise expert_id_error(lo if lo < -1 else hi, num_experts)


def check_values_eagerly(device: torch.device) -> bool:
    """Whether an eager caller should ask the dispatch to read expert ids on the host: on
    CUDA outside compiled code and graph capture, unless AFDEP_CHECK_INPUTS=0."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return False
    if torch.cuda.is_current_stream_capturing():
        return False
    return bool(env.current().check_inputs)


def dispatch_args(config: Config, device: torch.device, x, expert_ids, weights, x_scales,
                  bucket, check_values: bool = False) -> None:
    """The arguments of a dispatch (shapes: ``Buffer.source_dispatch``); ``check_values``
    also reads expert_ids on the host (eager CUDA)."""
    check_int("bucket", bucket)
    check_tensor("x", x, (config.dtype,), (None, config.hidden_size), device)
    t = x.shape[0]
    config.check_bucket(bucket, t)
    check_tensor("expert_ids", expert_ids, ID_DTYPES, (t, config.top_k), device)
    check_tensor("weights", weights, (torch.float32,), (t, config.top_k), device)
    if config.scale_cols:
        if x_scales is None:
            raise ValueError("x_scales [T, hidden_size/128] float32 is required for FP8 x")
        check_tensor("x_scales", x_scales, (torch.float32,), (t, config.scale_cols), device)
    elif x_scales is not None:
        raise ValueError("x_scales must be None for BF16 payloads")
    if t and check_values and device.type == "cuda":
        check_expert_id_values(expert_ids, config.num_experts)


def route(config: Config, device: torch.device, route) -> None:
    check_tensor("route", route, (torch.int64,), (None,), device)
    if route.shape[0] > config.capacity_tokens_per_rank:
        raise ValueError(f"route has {route.shape[0]} tokens, more than "
                         f"capacity_tokens_per_rank ({config.capacity_tokens_per_rank})")


def receive_args(config: Config, bucket) -> None:
    check_int("bucket", bucket)
    config.check_bucket(bucket)


def receipt(config: Config, buffer_key, receipt, slot: Optional[int], rows=None) -> int:
    """The Python-side checks of a reply's receipt; returns the slot (the receipt's; an
    explicit ``slot`` must agree with it). These run in the caller, so inside compiled code
    torch reports them as a tracing error (docs/contract.md)."""
    from .errors import AfdepStateError

    want = TokenReceipt if config.receive_layout == "tokens" else Receipt
    if not isinstance(receipt, want):
        raise TypeError(f"receipt must be the {want.__name__} from worker_receive "
                        f"(receive_layout={config.receive_layout!r}), got "
                        f"{type(receipt).__name__}")
    if slot is not None:
        config.check_slot(check_int("slot", slot))
        if slot != receipt.slot:
            raise AfdepStateError(f"receipt is from slot {receipt.slot}, not slot {slot}: "
                                  f"reply on the slot the rows were received on")
    if receipt.buffer_key != buffer_key:
        raise ValueError(f"receipt belongs to buffer {receipt.buffer_key}, not to this "
                         f"buffer {buffer_key}")
    config.check_bucket(check_int("receipt.bucket", receipt.bucket))
    if rows is not None and isinstance(rows, torch.Tensor):
        n = (config.token_rows(receipt.bucket) if config.receive_layout == "tokens"
             else config.recv_rows(receipt.bucket))
        if rows.dim() != 2 or rows.shape[0] != n:
            raise ValueError(f"rows must have shape [{n}, {config.hidden_size}] for the "
                             f"receipt's bucket {receipt.bucket}, got {list(rows.shape)}")
    return config.check_slot(receipt.slot)


def reply_tensors(config: Config, device: torch.device, rows, token_rows, token_index,
                  num_tokens) -> None:
    """The tensors of a reply: rows [A*bucket*R, H] bfloat16 and the receipt's int32
    token_rows [A, bucket, R], token_index [A, bucket], num_tokens [A]."""
    a, r = config.attention_ranks, config.rows_per_token
    check_tensor("receipt.token_index", token_index, (torch.int32,), (a, None), device)
    b = token_index.shape[1]
    config.check_bucket(b)
    check_tensor("rows", rows, (torch.bfloat16,), (config.recv_rows(b), config.hidden_size),
                 device)
    check_tensor("receipt.token_rows", token_rows, (torch.int32,), (a, b, r), device)
    check_tensor("receipt.num_tokens", num_tokens, (torch.int32,), (a,), device)


def token_reply_tensors(config: Config, device: torch.device, rows, src_token,
                        num_tokens) -> None:
    """The tensors of a token-layout reply: rows [N, H] bfloat16 with N =
    ``config.token_rows(bucket)`` for some bucket, the receipt's src_token [N] int32 and
    num_tokens [A] int32."""
    check_tensor("rows", rows, (torch.bfloat16,), (None, config.hidden_size), device)
    n = rows.shape[0]
    a = config.attention_ranks
    if n % a or n // a % config.num_sms or not 0 < n <= config.token_rows(
            config.capacity_tokens_per_rank):
        raise ValueError(f"rows must have Config.token_rows(bucket) rows (A * num_sms * "
                         f"ceil(bucket / num_sms)) for the receipt's bucket, got {n}")
    check_tensor("receipt.src_token", src_token, (torch.int32,), (n,), device)
    check_tensor("receipt.num_tokens", num_tokens, (torch.int32,), (a,), device)

"""Argument helpers shared by ``python -m torch_afdep.demo`` and the scripts in ``examples/``.

One spelling per concept, parsed by ``torch_afdep.config``: a *layout* (how many ranks of each
role) is ``--layout 2A2F`` (``parse_layout``: Attention ranks, then FFN ranks); *roles* (the
role of each group rank, in order) are ``--roles FFAA`` (``parse_roles``, which also takes
``ffn,ffn,attention,attention``). Anything a script cannot run (a bad spelling, a layout whose
``Config`` is invalid, e.g. 8 experts over 3 FFN ranks, or ranks sharing a GPU without CUDA
MPS) ends in an argparse error (usage, the reason, exit status 2), never a traceback.
"""

from __future__ import annotations

import argparse
import collections
import sys
from typing import Callable, List, Optional, Tuple, TypeVar

import torch

from .. import mps
from ..config import FFN, RECEIVE_LAYOUTS, Config, parse_layout, parse_roles

T = TypeVar("T")


def layout(text: str) -> Tuple[int, int]:
    """argparse ``type=`` for ``--layout``.

    Arguments:
        text: a layout such as ``"2A2F"`` (Attention ranks, then FFN ranks).
    Returns:
        (attention_ranks, ffn_ranks); a malformed layout raises ``ArgumentTypeError``.
    """
    try:
        return parse_layout(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def roles(text: str) -> Tuple[str, ...]:
    """argparse ``type=`` for ``--roles``.

    Arguments:
        text: roles per group rank, e.g. ``"FFAA"`` or ``"ffn,attention"``.
    Returns:
        A tuple of ``"ffn"`` / ``"attention"``; a malformed spec raises ``ArgumentTypeError``.
    """
    try:
        return parse_roles(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_layout_arguments(parser: argparse.ArgumentParser, default: str = "2A2F",
                         with_roles: bool = True) -> None:
    """Add ``--layout`` (default ``default``) and, when ``with_roles``, ``--roles``."""
    parser.add_argument("--layout", type=layout, default=None,
                        help=f"Attention and FFN rank counts, e.g. 2A2F, 3A1F (default "
                             f"{default})")
    parser.set_defaults(_layout_default=default)
    if with_roles:
        parser.add_argument("--roles", type=roles, default=None,
                            help="the role of every rank in order, e.g. FFAA or AFAF "
                                 "(default: FFN ranks first); implies the layout")


def resolve_layout(parser: argparse.ArgumentParser, args: argparse.Namespace
                   ) -> Tuple[int, int, Optional[Tuple[str, ...]]]:
    """The layout the arguments ask for.

    Arguments:
        parser: the parser (its ``error`` reports a contradiction).
        args: parsed arguments of a parser set up by ``add_layout_arguments``.
    Returns:
        (attention_ranks, ffn_ranks, roles or None). ``--roles`` alone gives the counts;
        with ``--layout`` too, the two must agree.
    """
    given = getattr(args, "roles", None)
    if given is None:
        a, f = args.layout or parse_layout(args._layout_default)
        return a, f, None
    a, f = len(given) - given.count(FFN), given.count(FFN)
    if a < 1 or f < 1:
        parser.error(f"--roles {''.join(r[0].upper() for r in given)} needs at least one "
                     f"Attention and one FFN rank")
    if args.layout is not None and args.layout != (a, f):
        parser.error(f"--layout {args.layout[0]}A{args.layout[1]}F and --roles "
                     f"{''.join(r[0].upper() for r in given)} ({a}A{f}F) disagree")
    return a, f, given


def build_or_error(parser: argparse.ArgumentParser, attention_ranks: int, ffn_ranks: int,
                   build: Callable[[], T]) -> T:
    """``build()``, with the ValueError / TypeError of an unsupported layout or size reported
    as an argparse error naming the layout (exit status 2).

    Arguments:
        parser: the parser whose ``error`` reports it.
        attention_ranks, ffn_ranks: the layout, for the message.
        build: makes what the script needs (a Config, or settings that make one).
    Returns:
        What ``build`` returned.
    """
    try:
        return build()
    except (ValueError, TypeError) as e:
        parser.error(f"cannot run layout {attention_ranks}A{ffn_ranks}F with these "
                     f"arguments: {e}")
        raise  # parser.error exits; this line only tells readers so


def make_config(parser: argparse.ArgumentParser, **kwargs) -> Config:
    """``Config(**kwargs)``, with an invalid layout or size reported as an argparse error.

    Arguments:
        parser: the parser whose ``error`` reports it (exit status 2).
        kwargs: ``Config`` fields (``attention_ranks`` and ``ffn_ranks`` among them).
    Returns:
        The Config.
    """
    return build_or_error(parser, kwargs.get("attention_ranks"), kwargs.get("ffn_ranks"),
                          lambda: Config(**kwargs))


def cuda_ready() -> bool:
    """Whether a GPU and the built CUDA extension (``torch_afdep._cuda``) are present."""
    if not torch.cuda.is_available():
        return False
    try:
        from .. import _cuda  # noqa: F401
    except ImportError:
        return False
    return True


def device_kind(parser: argparse.ArgumentParser, choice: str) -> str:
    """``"cpu"`` or ``"cuda"`` for a ``--device`` choice (``auto``: CUDA when ``cuda_ready()``);
    ``cuda`` without a GPU and the built extension is an argparse error."""
    if choice == "auto":
        return "cuda" if cuda_ready() else "cpu"
    if choice == "cuda" and not cuda_ready():
        parser.error("--device cuda needs a GPU and the built CUDA extension")
    return choice


def add_receive_layout_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--receive-layout experts|tokens`` (default experts): the ``Config.receive_layout``
    of the script's buffer, i.e. what its FFN ranks receive."""
    parser.add_argument("--receive-layout", choices=RECEIVE_LAYOUTS, default="experts",
                        help="what FFN ranks receive: rows grouped by local expert (experts, "
                             "the default) or one row per token with its local expert ids "
                             "and weights (tokens)")


def add_shared_gpu_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--allow-shared-gpu`` (run even when ranks would share a GPU without CUDA MPS)."""
    parser.add_argument("--allow-shared-gpu", action="store_true",
                        help="run even when several ranks share a GPU without CUDA MPS "
                             "(correct, but each exchange takes tens of ms)")


def gpu_placement(parser: argparse.ArgumentParser, world: int, allow_shared: bool
                  ) -> List[int]:
    """One GPU per rank, round robin over the visible GPUs, checked for sharing without MPS.

    Arguments:
        parser: the parser whose ``error`` refuses a shared GPU without MPS.
        world: the ranks to place.
        allow_shared: print the problem as a warning and go on instead of refusing.
    Returns:
        device_ids [world] (ints): the CUDA device of each rank.
    """
    n = torch.cuda.device_count()
    device_ids = [r % n for r in range(world)]
    per_gpu = max(collections.Counter(device_ids).values())
    problem = mps.shared_gpu_problem(per_gpu)
    if problem and not allow_shared:
        parser.error(problem + " (--allow-shared-gpu runs anyway)")
    if problem:
        print(f"warning: {problem}", file=sys.stderr, flush=True)
    return device_ids


__all__ = ["layout", "roles", "add_layout_arguments", "resolve_layout", "build_or_error",
           "make_config", "cuda_ready", "device_kind", "add_receive_layout_argument",
           "add_shared_gpu_argument",
           "gpu_placement"]

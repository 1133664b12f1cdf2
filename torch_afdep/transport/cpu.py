"""CPU implementation of the exchange over gloo point-to-point messages.

Directional, like the CUDA path: in dispatch Attention ranks only send and FFN ranks only
receive; in combine the reverse. Per (Attention a, FFN f) pair and exchange:

- dispatch: a -> f a header ``[2] int64`` (tokens n, a's bucket) and, when n > 0, one
  ``[n, B] uint8`` blob; each token's B bytes are its payload row, its FP8 scales, its
  source token index and its ``R`` local expert ids and weights;
- combine: f -> a ``[1 + n, H]`` int16: a status row (its first 16 bytes: int64 status,
  int64 f's bucket), then n BF16 rows, one per token a sent to f, in the order a sent them;
  a already knows n from its own routing, so no counts flow back. The status row is how a
  bucket mismatch, which only f can see, reaches a.

Gloo delivers messages of one (pair, tag) in order, so consecutive exchanges never mix.
Every micro-batch slot of a buffer has its own ``CpuTransport`` with its own tag range
(``tag_base``: buffer id and slot, ``_TAGS_PER_SLOT`` tags each; ranges of different buffers
and slots never overlap, and process groups have separate gloo contexts), so exchanges in
different slots can be in flight at once and complete in any order. Sends complete in the
background; a transport finishes its pending sends before it starts its next phase (only its
own slot's). Every wait is bounded by ``Config.timeout_s``.
"""

from __future__ import annotations

import datetime
from typing import List, Optional

import torch
import torch.distributed as dist

from .. import reference as ref
from ..config import MAX_SLOTS, Config
from ..errors import AfdepBucketError, AfdepPeerLostError, AfdepTimeoutError
from ..validate import check_expert_id_values
from .base import Transport

_TAG_BASE = 0x5AF0
_TAGS_PER_SLOT = 6
_DISPATCH_HEADER, _DISPATCH_BLOB, _COMBINE, _PAYLOAD, _SCALES = 0, 1, 2, 3, 4
_OK, _BUCKET_MISMATCH = 0, 1  # combine status


def bucket_mismatch(rank: int, peer: int, peer_bucket: int, bucket: int, slot: int,
                    phase: str) -> AfdepBucketError:
    return AfdepBucketError(
        f"rank {rank}: bucket mismatch in {phase} on slot {slot}: group rank {peer} used "
        f"bucket {peer_bucket}, this rank {bucket}; every rank of an exchange must use the "
        f"same bucket (nothing was exchanged; the buffer stays usable)",
        peer=peer, phase=phase, rank=rank)


def tag_base(buffer_id: int, slot: int) -> int:
    """First gloo tag of (buffer, slot) on its group; the range is ``_TAGS_PER_SLOT`` tags.

    Every buffer reserves ``MAX_SLOTS`` ranges whatever its ``num_slots``, so ranges of
    different buffers and slots are disjoint."""
    if not 0 <= slot < MAX_SLOTS:
        raise ValueError(f"slot must be in [0, {MAX_SLOTS}), got {slot}")
    return _TAG_BASE + (buffer_id * MAX_SLOTS + slot) * _TAGS_PER_SLOT


def local_routes(config: Config, expert_ids: torch.Tensor, weights: torch.Tensor, f: int):
    """``reference.compact_local_routes`` for FFN index ``f`` of ``config``."""
    return ref.compact_local_routes(expert_ids, weights, f, config.experts_per_rank,
                                    config.rows_per_token)


class CpuTransport(Transport):
    """The CPU exchange of one slot of one Buffer (``base.Transport``)."""

    def __init__(self, config: Config, group_rank: int, group, buffer_id: int, slot: int = 0):
        self.config = config
        self.rank = group_rank
        self.group = group
        self.role = config.role_of(group_rank)
        self.slot = slot
        self._tag0 = tag_base(buffer_id, slot)
        self._pending: List = []
        self._bucket = 0  # the last dispatch's bucket (named by a mismatch in combine)
        self._peer_buckets: List[int] = []  # FFN: the senders' buckets of this exchange
        self._token_window: Optional[torch.Tensor] = None  # token layout (FFN)
        self._scale_window: Optional[torch.Tensor] = None
        self._view: Optional[torch.Tensor] = None  # combine_view's [C, H] result buffer
        self._timeout = datetime.timedelta(seconds=float(config.timeout_s))
        h, s = config.hidden_size, config.scale_cols
        self._payload_bytes = h * torch.empty(0, dtype=config.dtype).element_size()
        self._scale_bytes = 4 * s
        self._token_bytes = (
            self._payload_bytes + self._scale_bytes + 4 + 8 * config.rows_per_token
        )

    # ---- bookkeeping ------------------------------------------------------------------
    @property
    def registered_bytes(self) -> int:
        return 0  # messages, not registered memory

    @property
    def union_bytes(self) -> int:
        return 0

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def _wait(self, work, peer: int, phase: str) -> None:
        try:
            ok = work.wait(self._timeout)
        except RuntimeError as e:
            # gloo's own text stays in __cause__; the message says what happened.
            if "Connection closed" in str(e) or "Connection reset" in str(e):
                raise AfdepPeerLostError(
                    f"rank {self.rank}: {phase} lost group rank {peer} (its process exited or "
                    f"its connection closed); this Buffer cannot finish the exchange: close "
                    f"it, and continue on a new process group", peer=peer, phase=phase,
                    rank=self.rank) from e
            raise self._timed_out(peer, phase) from e
        if ok is False:
            raise self._timed_out(peer, phase)

    def _timed_out(self, peer: int, phase: str) -> AfdepTimeoutError:
        return AfdepTimeoutError(
            f"rank {self.rank}: {phase} waited more than {self.config.timeout_s} s for group "
            f"rank {peer} (slot {self.slot}); this Buffer is unusable: close it and continue "
            f"on a new process group (docs/contract.md, Failures)", peer=peer, phase=phase,
            rank=self.rank)

    def _finish_sends(self) -> None:
        pending, self._pending = self._pending, []
        for work, peer, phase, _keep in pending:
            self._wait(work, peer, phase)

    def _isend(self, t: torch.Tensor, peer: int, tag: int, phase: str) -> None:
        work = dist.isend(t, self._global(peer), group=self.group, tag=self._tag0 + tag)
        self._pending.append((work, peer, phase, t))

    def _irecv(self, t: torch.Tensor, peer: int, tag: int):
        return dist.irecv(t, self._global(peer), group=self.group, tag=self._tag0 + tag)

    def check_error(self, mid_exchange: bool = False) -> None:
        pass  # CPU errors raise where they happen

    def close(self, clean: bool = True) -> None:
        """Finish pending sends; after a failure (``clean=False``) drop them instead, so a
        dead peer cannot make close hang."""
        if clean:
            self._finish_sends()
        else:
            self._pending = []

    # ---- Attention side ---------------------------------------------------------------
    def dispatch(self, x, expert_ids, weights, x_scales, bucket: int, route) -> None:
        cfg = self.config
        # The values are on the host here, eager or compiled: refuse before sending anything.
        check_expert_id_values(expert_ids, cfg.num_experts)
        self._bucket = bucket
        self._finish_sends()
        route.copy_(ref.route_mask(cfg, expert_ids))
        if cfg.receive_layout == "tokens":
            self._dispatch_tokens(x, expert_ids, weights, x_scales, bucket)
            return
        for f, peer in enumerate(cfg.ffn_group_ranks):
            local_ids, local_w, hits = local_routes(cfg, expert_ids, weights, f)
            toks = hits.nonzero().flatten()
            n = int(toks.numel())
            self._isend(torch.tensor([n, bucket], dtype=torch.int64), peer, _DISPATCH_HEADER,
                        "dispatch")
            if n == 0:
                continue
            parts = [x[toks].contiguous().view(torch.uint8).reshape(n, -1)]
            if x_scales is not None and cfg.scale_cols:
                parts.append(x_scales[toks].contiguous().view(torch.uint8).reshape(n, -1))
            parts.append(toks.to(torch.int32).view(torch.uint8).reshape(n, 4))
            parts.append(local_ids[toks].view(torch.uint8).reshape(n, -1))
            parts.append(local_w[toks].view(torch.uint8).reshape(n, -1))
            blob = torch.cat(parts, dim=1).contiguous()
            assert blob.shape[1] == self._token_bytes
            self._isend(blob, peer, _DISPATCH_BLOB, "dispatch")

    def _dispatch_tokens(self, x, expert_ids, weights, x_scales, bucket: int) -> None:
        """Token layout: per FFN rank the payload rows and the scales as messages of their
        own (the FFN receives them straight into its window), then a metadata blob of
        [n, 4 + 8k] bytes: source token index, the k local ids (-1 elsewhere) and weights."""
        cfg = self.config
        for f, peer in enumerate(cfg.ffn_group_ranks):
            lid = ref.local_expert_ids(expert_ids, f, cfg.experts_per_rank)
            toks = (lid >= 0).any(dim=1).nonzero().flatten()
            n = int(toks.numel())
            self._isend(torch.tensor([n, bucket], dtype=torch.int64), peer, _DISPATCH_HEADER,
                        "dispatch")
            if n == 0:
                continue
            self._isend(x[toks].contiguous().view(torch.uint8), peer, _PAYLOAD, "dispatch")
            if cfg.scale_cols:
                self._isend(x_scales[toks].contiguous(), peer, _SCALES, "dispatch")
            ids = lid[toks].to(torch.int32)
            w = torch.where(ids >= 0, weights[toks].to(torch.float32), 0.0)
            blob = torch.cat([toks.to(torch.int32)[:, None].view(torch.uint8),
                              ids.view(torch.uint8), w.view(torch.uint8)], dim=1)
            self._isend(blob.contiguous(), peer, _DISPATCH_BLOB, "dispatch")

    def combine(self, route, out) -> None:
        cfg = self.config
        self._finish_sends()
        acc = torch.zeros(out.shape, dtype=torch.float32)
        recvs = []
        for f, peer in enumerate(cfg.ffn_group_ranks):
            toks = ((route >> f) & 1).nonzero().flatten()
            buf = torch.empty(1 + toks.numel(), cfg.hidden_size, dtype=torch.int16)
            recvs.append((self._irecv(buf, peer, _COMBINE), peer, toks, buf))
        mismatch = None
        for work, peer, toks, buf in recvs:  # every message, so the next exchange lines up
            self._wait(work, peer, "combine")
            status = buf[0].view(torch.int64)
            if int(status[0]) == _BUCKET_MISMATCH:
                mismatch = mismatch or (peer, int(status[1]))
            elif toks.numel():
                acc.index_add_(0, toks, buf[1:].view(torch.bfloat16).to(torch.float32))
        if mismatch is not None:
            raise bucket_mismatch(self.rank, mismatch[0], mismatch[1], self._bucket,
                                  self.slot, "combine")
        out.copy_(acc.to(torch.bfloat16))

    def combine_view(self, route) -> torch.Tensor:
        """One FFN rank: the combine result in this transport's own [C, H] buffer, returned as
        rows [0, T) (overwritten by the next combine_view: the CUDA view's lifetime)."""
        if self._view is None:
            c = self.config
            self._view = torch.empty(c.capacity_tokens_per_rank, c.hidden_size,
                                     dtype=torch.bfloat16)
        out = self._view[:route.shape[0]]
        self.combine(route, out)
        return out

    # ---- FFN side ---------------------------------------------------------------------
    def receive(self, bucket: int, x, x_scales, weights, expert_offsets, src_rank,
                src_token, token_rows, token_index, num_tokens) -> None:
        cfg = self.config
        self._finish_sends()
        a_ranks = cfg.attention_group_ranks
        counts = self._headers(bucket)
        blobs = [torch.empty(n, self._token_bytes, dtype=torch.uint8) for n in counts]
        works = [(self._irecv(b, peer, _DISPATCH_BLOB), peer)
                 for b, peer, n in zip(blobs, a_ranks, counts) if n > 0]
        for w, peer in works:
            self._wait(w, peer, "dispatch")
        self._check_buckets(bucket, counts)

        r, h, el = cfg.rows_per_token, cfg.hidden_size, cfg.experts_per_rank
        pb, sb = self._payload_bytes, self._scale_bytes
        tok_x, tok_s, tok_idx, tok_ids, tok_w, tok_src = [], [], [], [], [], []
        for a, (blob, n) in enumerate(zip(blobs, counts)):
            if n == 0:
                continue
            o = 0
            tok_x.append(blob[:, o:o + pb].contiguous().view(cfg.dtype).reshape(n, h))
            o += pb
            if sb:
                tok_s.append(blob[:, o:o + sb].contiguous().view(torch.float32))
                o += sb
            tok_idx.append(blob[:, o:o + 4].contiguous().view(torch.int32).flatten())
            o += 4
            tok_ids.append(blob[:, o:o + 4 * r].contiguous().view(torch.int32))
            o += 4 * r
            tok_w.append(blob[:, o:o + 4 * r].contiguous().view(torch.float32))
            tok_src.append(torch.full((n,), a, dtype=torch.int64))
            token_index[a, :n] = tok_idx[-1]

        num_tokens.copy_(torch.tensor(counts, dtype=torch.int32))
        # Padding gets defined values on CPU (the contract leaves it unspecified).
        src_rank.fill_(-1)
        src_token.fill_(-1)
        token_rows.fill_(-1)
        token_index[:, :].masked_fill_(
            torch.arange(bucket)[None, :] >= torch.tensor(counts)[:, None], -1)
        weights.zero_()
        if x_scales.numel():
            x_scales.zero_()
        x.view(torch.uint8).zero_()
        if not tok_x:
            expert_offsets.zero_()
            return
        all_x = torch.cat(tok_x)
        all_ids = torch.cat(tok_ids)  # [N, R]
        all_w = torch.cat(tok_w)
        all_src = torch.cat(tok_src)  # Attention index per token
        all_idx = torch.cat(tok_idx)
        slot = torch.cat([torch.arange(n) for n in counts if n > 0])
        tok, j = (all_ids >= 0).nonzero(as_tuple=True)  # one row per (token, local expert)
        e = all_ids[tok, j].to(torch.int64)
        # Expert-major, then (source, slot, j): a stable sort by expert keeps the rest.
        order = torch.argsort(e, stable=True)
        tok, j, e = tok[order], j[order], e[order]
        nrows = tok.numel()
        x[:nrows] = all_x[tok]
        if x_scales.numel():
            x_scales[:nrows] = torch.cat(tok_s)[tok]
        weights[:nrows] = all_w[tok, j]
        src_rank[:nrows] = torch.tensor(a_ranks, dtype=torch.int32)[all_src[tok]]
        src_token[:nrows] = all_idx[tok]
        token_rows[all_src[tok], slot[tok], j] = torch.arange(nrows, dtype=torch.int32)
        counts_e = torch.bincount(e, minlength=el)
        expert_offsets[0] = 0
        expert_offsets[1:] = torch.cumsum(counts_e, 0).to(torch.int32)

    def _headers(self, bucket: int) -> List[int]:
        """Every Attention rank's dispatch header: its token count (returned) and bucket (kept
        for ``_check_buckets``, which runs once every message of the exchange is in)."""
        a_ranks = self.config.attention_group_ranks
        headers = [torch.zeros(2, dtype=torch.int64) for _ in a_ranks]
        works = [self._irecv(hd, peer, _DISPATCH_HEADER) for hd, peer in zip(headers, a_ranks)]
        for w, peer in zip(works, a_ranks):
            self._wait(w, peer, "dispatch")
        self._peer_buckets = [int(hd[1]) for hd in headers]
        return [int(hd[0]) for hd in headers]

    def _check_buckets(self, bucket: int, counts: List[int]) -> None:
        """After draining an exchange: on a bucket mismatch, tell every Attention rank (the
        status row of its combine message), then raise here."""
        cfg = self.config
        a_ranks = cfg.attention_group_ranks
        bad = [(peer, b) for peer, b in zip(a_ranks, self._peer_buckets) if b != bucket]
        if not bad:
            return
        status = torch.tensor([_BUCKET_MISMATCH, bucket], dtype=torch.int64)
        for peer, n in zip(a_ranks, counts):
            msg = torch.zeros(1 + n, cfg.hidden_size, dtype=torch.int16)
            msg[0].view(torch.int64)[:2] = status
            self._isend(msg, peer, _COMBINE, "combine")
        raise bucket_mismatch(self.rank, bad[0][0], bad[0][1], bucket, self.slot, "dispatch")

    # ---- FFN side, token layout ---------------------------------------------------------
    def _windows(self):
        """The token layout's receive windows, [A * rows_per_source(capacity), H] payload and
        [.., H/128] float32 scales, made on first use and kept: receive returns views."""
        if self._token_window is None:
            cfg = self.config
            n = cfg.token_rows(cfg.capacity_tokens_per_rank)
            self._token_window = torch.empty(n, cfg.hidden_size, dtype=cfg.dtype)
            self._scale_window = torch.empty(n, cfg.scale_cols, dtype=torch.float32)
        return self._token_window, self._scale_window

    def receive_tokens(self, bucket: int, expert_ids, weights, src_rank, src_token,
                       num_tokens):
        """Token layout: every Attention rank's tokens into rows a * rows_per_source(bucket)
        + [0, n_a) of the window; writes the metadata outputs ([N, k] int32 ids, [N, k]
        float32 weights, [N] int32 src_rank / src_token, [A] int32 num_tokens) and returns
        (x [N, H], x_scales [N, H/128]) views of the window."""
        cfg = self.config
        self._finish_sends()
        a_ranks = cfg.attention_group_ranks
        k, rps = cfg.top_k, cfg.rows_per_source(bucket)
        n_rows = cfg.attention_ranks * rps
        window, scales = self._windows()
        counts = self._headers(bucket)
        recvs = []
        for a, (peer, n) in enumerate(zip(a_ranks, counts)):
            if n == 0:
                continue
            fits = n <= rps and self._peer_buckets[a] == bucket
            # A mismatched sender's rows are drained into scratch, never into the window.
            dst = (window[a * rps:a * rps + n] if fits
                   else torch.empty(n, cfg.hidden_size, dtype=cfg.dtype))
            parts = [dst.view(torch.uint8)]
            if cfg.scale_cols:
                parts.append(scales[a * rps:a * rps + n] if fits
                             else torch.empty(n, cfg.scale_cols, dtype=torch.float32))
            meta = torch.empty(n, 4 + 8 * k, dtype=torch.uint8)
            works = [self._irecv(parts[0], peer, _PAYLOAD)]
            if cfg.scale_cols:
                works.append(self._irecv(parts[1], peer, _SCALES))
            works.append(self._irecv(meta, peer, _DISPATCH_BLOB))
            recvs.append((a, peer, n, works, meta))
        for _a, peer, _n, works, _meta in recvs:
            for w in works:
                self._wait(w, peer, "dispatch")
        self._check_buckets(bucket, counts)
        expert_ids.fill_(-1)
        weights.zero_()
        src_rank.fill_(-1)
        src_token.fill_(-1)
        for a, peer, n, _works, meta in recvs:
            rows = slice(a * rps, a * rps + n)
            src_token[rows] = meta[:, :4].contiguous().view(torch.int32).flatten()
            expert_ids[rows] = meta[:, 4:4 + 4 * k].contiguous().view(torch.int32)
            weights[rows] = meta[:, 4 + 4 * k:].contiguous().view(torch.float32)
            src_rank[rows] = peer
        num_tokens.copy_(torch.tensor(counts, dtype=torch.int32))
        return window[:n_rows], scales[:n_rows]

    def reply_tokens(self, rows, src_token, num_tokens) -> None:
        """Token layout: row a * rows_per_source + i goes back to Attention index a as the
        reply of the i-th token it sent here (rows [N, H] bfloat16)."""
        cfg = self.config
        self._finish_sends()
        rps = rows.shape[0] // cfg.attention_ranks
        for a, peer in enumerate(cfg.attention_group_ranks):
            n = int(num_tokens[a].item())
            msg = torch.zeros(1 + n, cfg.hidden_size, dtype=torch.int16)  # row 0: status OK
            if n:
                msg[1:] = rows[a * rps:a * rps + n].view(torch.int16)
            self._isend(msg, peer, _COMBINE, "combine")

    def reply(self, rows, token_rows, token_index, num_tokens) -> None:
        cfg = self.config
        self._finish_sends()
        for a, peer in enumerate(cfg.attention_group_ranks):
            n = int(num_tokens[a].item())
            msg = torch.zeros(1 + n, cfg.hidden_size, dtype=torch.int16)  # row 0: status OK
            if n:
                tr = token_rows[a, :n].to(torch.int64)  # [n, R]
                valid = tr >= 0
                gathered = rows[tr.clamp(min=0)].to(torch.float32)  # [n, R, H]
                # where(), not a multiply: a NaN in an unused row must not leak in.
                summed = torch.where(valid[:, :, None], gathered, 0.0).sum(dim=1)
                msg[1:] = summed.to(torch.bfloat16).view(torch.int16)
            self._isend(msg, peer, _COMBINE, "combine")

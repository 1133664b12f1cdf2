"""Randomized exchange contract: many small configurations, each drawn from one seed, checked
against independent references (the enumerated cases are in test_exchange.py,
test_token_layout.py and test_slots.py).

What a seed draws (tests/helpers/fuzz_bodies.py: ``draw_config``, ``draw_plan``,
``exchange_inputs``): A + F in {2, 3, 4} in a random role order (``Config(roles=...)``),
E = F * E_local with E_local in 1..6, top_k in 1..min(8, E) (so top_k > E_local, R < top_k,
happens), BF16 at hidden 8 / 16 / 136 / 256 or FP8 at 128 / 256, capacity 1..12, num_sms 1..4
(the token layout's rows per source), the expert or token receive layout, one or two slots;
then a plan of 3-5 exchanges, each with its own bucket in [1, capacity], T in [0, bucket] per
Attention rank (0, 1 and the bucket often), random / skewed / partial routing, in about half
of them duplicated ids (later columns repeating an earlier one, with other weights), in some
tokens with every id -1, int32 or int64 ids per Attention rank, a slot, the Buffer role API or
the afd_* ops per rank, and on two slots sometimes two exchanges in flight at once (every rank
dispatches / receives both, then collects / replies in its own order).

What is checked, every exchange: each FFN rank's receive exactly (expert layout:
``checks.check_received``; token layout: ``fuzz_bodies.check_token_rows``: every routed token
once in its source's block, exact payload and scales, local ids in column order, first
occurrences' weights, rows without a token all -1 with weights 0), then it replies with
``tanh_expert`` outputs, unused rows poisoned with NaN; each Attention rank's output ([T, H]
bfloat16, and the ops' route) against the fp64 reference ``reference.moe_output`` (relative
error < 1e-2, allclose 3e-2, zeros for tokens without an expert, nothing non-finite). Every
slot is idle after each exchange.

``NUM_CONFIGS`` = 64 seeds (0..63: 256 exchanges) plus ``REGRESSION_SEEDS`` run on CPU, and
on CUDA (the GPU suite: ranks share one GPU under MPS, or one GPU each) the first
``GPU_CONFIGS`` = 24 of them, where the kernels meet sizes the enumerated GPU cases do not
(E_local 1, 2, 3, 5, 6; hidden 8, 16, 136; num_sms 1..4), grouped by world size: one spawned world per size (one test each) runs its configurations one after
another (a Buffer each, closed after it); about 10 s in all on 2 CPUs, most of it world
starts (200 seeds: about 14 s). ``test_default_seeds_cover_the_edges`` asserts, from the
draws alone, that the default seeds reach every feature above. A failure names the seed, the
exchange and the rank, with the seed's configuration and plan; an exception on a rank is
re-raised naming them too (its peers then time out after ``timeout_s`` = 30 s). To reproduce
one seed:
``AFDEP_FUZZ_SEED=17 .venv/bin/python -m pytest -q tests/contract/test_fuzz.py``
(comma-separated seeds also work), print its plan with
``python -c "from tests.helpers.fuzz_bodies import describe; print(describe(17))"``; a larger
run: ``AFDEP_FUZZ_SEEDS=200`` (seeds 0..199).
"""

from __future__ import annotations

import pytest

from torch_afdep import env

from tests.helpers import fuzz_bodies as fz
from tests.helpers.devices import spawn_on

#: Configurations of a default run: seeds 0..NUM_CONFIGS-1.
NUM_CONFIGS = 64

#: Configurations of a default run on CUDA (seeds 0..GPU_CONFIGS-1): each builds its own
#: registered buffers, and the ranks share one GPU under MPS on the lent machine.
GPU_CONFIGS = 24

#: Seeds kept because they once failed (run in every default run).
REGRESSION_SEEDS: list = []


def _seeds() -> list:
    only = env.get("AFDEP_FUZZ_SEED").strip()
    if only:
        return [int(s) for s in only.split(",") if s.strip()]
    n = env.get("AFDEP_FUZZ_SEEDS") or NUM_CONFIGS
    return sorted(set(range(n)) | set(REGRESSION_SEEDS))


def _by_world_size(seeds) -> dict:
    out = {}
    for s in seeds:
        out.setdefault(fz.draw_config(s).world_size, []).append(s)
    return out


SEEDS = _seeds()
WORLDS = _by_world_size(SEEDS)


def test_default_seeds_cover_the_edges():
    """The default seeds reach every feature the fuzz is meant to mix (drawing only, no
    world): a change of the draws that loses one fails here, not silently."""
    seeds = sorted(set(range(NUM_CONFIGS)) | set(REGRESSION_SEEDS))
    seen = set()
    for s in seeds:
        cfg = fz.draw_config(s)
        plan = fz.draw_plan(s, cfg)
        seen |= {f"world{cfg.world_size}", cfg.receive_layout, str(cfg.dtype),
                 f"slots{cfg.num_slots}"}
        if cfg.top_k > cfg.experts_per_rank:
            seen.add("top_k > E_local")
        if cfg.attention_group_ranks[0] < cfg.ffn_group_ranks[-1]:
            seen.add("an Attention rank before an FFN rank")
        if cfg.rows_per_source(cfg.capacity_tokens_per_rank) > cfg.capacity_tokens_per_rank:
            seen.add("padded token rows")
        for ex in plan:
            seen |= set(ex["apis"]) | set(ex["id_dtypes"]) | {ex["routing"]}
            seen |= {n for n in ("dups", "empty", "overlap") if ex[n]}
            if 0 in ex["tokens"]:
                seen.add("T = 0")
            if ex["bucket"] in ex["tokens"] and ex["bucket"] > 1:
                seen.add("T = bucket > 1")
    want = {"world2", "world3", "world4", "experts", "tokens", "torch.bfloat16",
            "torch.float8_e4m3fn", "slots1", "slots2", "top_k > E_local",
            "an Attention rank before an FFN rank", "padded token rows", "buffer", "ops",
            "int32", "int64", "random", "skewed", "partial", "dups", "empty", "overlap",
            "T = 0", "T = bucket > 1"}
    assert want <= seen, sorted(want - seen)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fuzz_exchanges(world, device):
    seeds = WORLDS.get(world, [])
    if device == "cuda" and not (env.get("AFDEP_FUZZ_SEEDS") or env.get("AFDEP_FUZZ_SEED")):
        seeds = [s for s in seeds if s < GPU_CONFIGS or s in REGRESSION_SEEDS]
    if not seeds:
        pytest.skip(f"no seed of this run has world size {world}")
    results = spawn_on(device, fz.fuzz_world, world, seeds,
                       timeout=120 + 15 * len(seeds))
    problems = []
    for rank, per_seed in enumerate(results):
        assert [r["seed"] for r in per_seed] == seeds
        for r in per_seed:
            for step, text in r["problems"]:
                problems.append((r["seed"], step, rank, text))
    if problems:
        first = sorted({p[0] for p in problems})
        lines = [f"seed {s}, exchange {i}, rank {rank}: {text}"
                 for s, i, rank, text in problems[:20]]
        raise AssertionError(
            f"{len(problems)} contract violations in seeds {first} "
            f"(reproduce: AFDEP_FUZZ_SEED={first[0]} pytest tests/contract/test_fuzz.py)\n"
            + "\n".join(lines) + "\n" + fz.describe(first[0]))
    # something was routed and returned in this world
    assert sum(r["rows"] for per in results for r in per if r["role"] == "ffn") > 0
    assert sum(r["rows"] for per in results for r in per if r["role"] == "attention") > 0

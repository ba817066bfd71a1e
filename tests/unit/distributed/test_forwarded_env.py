"""The environment every worker gets (``bandpo.distributed.forwarded_env``), an actor rank's on top of it
(``bandpo.actor.group.rank_env``), and the job's runtime_env, alone and under Ray's Jobs API: pure
functions of a given environment, no Ray started (the merge is Ray's own function)."""

import json
import os

import pytest

from bandpo.actor.group import rank_device, rank_env
from bandpo.distributed import forwarded_env, job_runtime_env, ray_init_options, without_job_keys


def test_forwards_by_prefix_and_name_and_never_the_per_node_variables():
    environ = {
        "HF_TOKEN": "t",
        "HF_ENDPOINT": "e",
        "HUGGING_FACE_HUB_TOKEN": "t",
        "NCCL_DEBUG": "INFO",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "VLLM_ATTENTION_BACKEND": "x",
        "WANDB_API_KEY": "k",
        "TRANSFORMERS_OFFLINE": "1",
        "DS_SKIP_CUDA_CHECK": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "CUDA_LAUNCH_BLOCKING": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        # per node: its caches, its network interfaces and adapters, its threads and paths
        "HF_HOME": "/driver/hf",
        "HF_HUB_CACHE": "/driver/hf/hub",
        "NCCL_SOCKET_IFNAME": "ib0",
        "NCCL_IB_HCA": "mlx5",
        "GLOO_SOCKET_IFNAME": "eth0",
        "OMP_NUM_THREADS": "4",
        "PYTHONPATH": "/driver/src",
        # per rank: the driver's DeepSpeed accelerator (train.sh's cpu on a head without GPUs)
        "DS_ACCELERATOR": "cpu",
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
        "HF_TOKEN",
        "HF_ENDPOINT",
        "HUGGING_FACE_HUB_TOKEN",
        "NCCL_DEBUG",
        "TORCH_NCCL_BLOCKING_WAIT",
        "VLLM_ATTENTION_BACKEND",
        "WANDB_API_KEY",
        "TRANSFORMERS_OFFLINE",
        "DS_SKIP_CUDA_CHECK",
        "PYTORCH_CUDA_ALLOC_CONF",
        "CUDA_LAUNCH_BLOCKING",
        "TOKENIZERS_PARALLELISM",
        "TORCH_DISTRIBUTED_DEBUG",
    }
    assert set(forwarded_env(environ)) == want
    assert forwarded_env(environ)["HF_TOKEN"] == "t"


@pytest.mark.parametrize("num_gpus,device", [(0.5, "cuda"), (1.0, "cuda"), (0, "cpu")])
def test_a_rank_gets_its_plans_accelerator_never_the_drivers(num_gpus, device):
    # train.sh on a head without GPUs: DS_ACCELERATOR=cpu in the driver's shell
    driver = {"DS_ACCELERATOR": "cpu", "HF_TOKEN": "t", "NCCL_SOCKET_IFNAME": "eth0"}
    options = {"num_cpus": 1, "num_gpus": num_gpus}  # bandpo.distributed.placement.actor_options' keys
    assert rank_device(options) == device
    assert rank_env(rank_device(options), driver) == {"DS_ACCELERATOR": device, "HF_TOKEN": "t"}


def test_the_job_ships_the_package_only_when_it_joins_a_cluster():
    import bandpo

    assert "py_modules" not in ray_init_options()["runtime_env"]
    env = ray_init_options(ship_code=True)["runtime_env"]
    assert env["py_modules"] == [os.path.dirname(os.path.abspath(bandpo.__file__))]
    assert "__pycache__" in env["excludes"]


def _job(monkeypatch, runtime_env: dict) -> None:
    """This process as Ray's job supervisor starts an entrypoint: the job's runtime_env as JSON, and its
    variables in the environment (ray/dashboard/modules/job/job_supervisor.py)."""
    config = {"runtime_env": runtime_env, "metadata": {}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(config))
    for k, v in runtime_env.get("env_vars", {}).items():
        monkeypatch.setenv(k, v)


def test_under_the_jobs_api_ray_merges_the_job_env_with_ours(monkeypatch, tmp_path):
    from ray.runtime_env.runtime_env import _merge_runtime_env  # what ray.init calls (ray/_private/worker.py)

    job = {
        "working_dir": "gcs://_ray_pkg_0123.zip",
        "excludes": ["*.ckpt"],
        "env_vars": {"HF_TOKEN": "job-token", "VLLM_LOGGING_LEVEL": "INFO"},
    }
    _job(monkeypatch, job)
    monkeypatch.setenv("WANDB_PROJECT", "p")  # the driver's own, not the job's
    assert job_runtime_env() == job
    ours = ray_init_options(tmp_path / "logs", ship_code=True)["runtime_env"]
    merged = _merge_runtime_env(job, ours)  # None: Ray's "Failed to merge the Job's runtime env"
    assert merged is not None
    assert merged["env_vars"]["HF_TOKEN"] == "job-token" and merged["env_vars"]["WANDB_PROJECT"] == "p"
    assert merged["excludes"] == ["*.ckpt"] and merged["working_dir"] == job["working_dir"]
    assert merged["py_modules"] == ours["py_modules"] and "worker_process_setup_hook" in merged
    # what ray.init was given before: the job's variables and fields again, which Ray refuses
    unfiltered = dict(ours, excludes=["__pycache__", "*.pyc"], env_vars={**ours["env_vars"], "HF_TOKEN": "t"})
    assert _merge_runtime_env(job, unfiltered) is None


def test_without_job_keys_drops_only_what_the_job_sets():
    ours = {"py_modules": ["/b"], "excludes": ["x"], "env_vars": {"A": "1", "B": "2"}}
    kept, dropped = without_job_keys(ours, {"py_modules": ["/j"], "env_vars": {"B": "9"}})
    assert kept == {"excludes": ["x"], "env_vars": {"A": "1"}}
    assert dropped == ["py_modules", "B"]
    assert without_job_keys(ours, {}) == (ours, [])
    assert job_runtime_env({}) is None


# Each node's own paths (caches, config roots, token files, vLLM's IPC folder, libraries), vLLM's
# port (colocated engines would race for one) and its per-process ranks and addresses: never forwarded.
NEVER = {
    "HF_HOME": "/driver/hf",
    "HF_MODULES_CACHE": "/driver/hf/modules",
    "HF_TOKEN_PATH": "/driver/hf/token",
    "HF_STORED_TOKENS_PATH": "/driver/hf/stored_tokens",
    "TRANSFORMERS_CACHE": "/driver/hf/hub",
    "VLLM_CACHE_ROOT": "/driver/vllm",
    "VLLM_CONFIG_ROOT": "/driver/vllm-config",
    "VLLM_ASSETS_CACHE": "/driver/vllm/assets",
    "VLLM_XLA_CACHE_PATH": "/driver/vllm/xla",
    "VLLM_RPC_BASE_PATH": "/tmp/driver",
    "VLLM_NCCL_SO_PATH": "/driver/lib/libnccl.so",
    "VLLM_PORT": "29600",
    "VLLM_DP_MASTER_IP": "10.0.0.1",
    "VLLM_DP_MASTER_PORT": "29601",
}


def test_per_node_paths_and_vllms_port_are_never_forwarded():
    kept = {"VLLM_LOGGING_LEVEL": "INFO", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    assert forwarded_env({**NEVER, **kept}) == kept


def test_the_lists_of_what_stays_behind_are_pinned():
    from bandpo.distributed import NOT_FORWARDED, PER_NODE

    assert set(NEVER) <= {*NOT_FORWARDED, *PER_NODE}
    assert NOT_FORWARDED == (
        "VLLM_HOST_IP",
        "VLLM_PORT",
        "VLLM_DP_RANK",
        "VLLM_DP_RANK_LOCAL",
        "VLLM_DP_MASTER_IP",
        "VLLM_DP_MASTER_PORT",
    )
    assert PER_NODE == (
        "HF_HOME",
        "HF_HUB_CACHE",
        "HF_ASSETS_CACHE",
        "HF_DATASETS_CACHE",
        "HF_XET_CACHE",
        "HF_MODULES_CACHE",
        "HF_TOKEN_PATH",
        "HF_STORED_TOKENS_PATH",
        "TRANSFORMERS_CACHE",
        "VLLM_CACHE_ROOT",
        "VLLM_CONFIG_ROOT",
        "VLLM_ASSETS_CACHE",
        "VLLM_XLA_CACHE_PATH",
        "VLLM_RPC_BASE_PATH",
        "VLLM_NCCL_SO_PATH",
        "VLLM_CUDART_SO_PATH",
        "NCCL_SOCKET_IFNAME",
        "NCCL_IB_HCA",
        "NCCL_TOPO_FILE",
    )


def test_a_local_model_path_goes_to_the_workers_absolute(tmp_path, monkeypatch):
    from bandpo.config.schema import ModelConfig
    from bandpo.errors import ConfigError
    from bandpo.parts import ensure_model

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "q").mkdir(parents=True)
    assert ensure_model(ModelConfig(name="q", path="models/q")) == str(tmp_path / "models" / "q")
    assert ensure_model(ModelConfig(name="q", path="Qwen/Qwen2.5-3B")) == "Qwen/Qwen2.5-3B"  # a hub id
    # plainly a folder (./, ../, ~, or more than one "/"), missing on the driver: named, never a hub id
    for path in ("./models/missing", "models/q/missing", "../missing"):
        with pytest.raises(ConfigError, match=r"model\.path=.*is a local folder .* no folder at /"):
            ensure_model(ModelConfig(name="q", path=path))

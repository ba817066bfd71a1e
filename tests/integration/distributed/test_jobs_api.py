"""A driver started by Ray's Jobs API (``ray job submit``): the job's runtime_env and bandpo's, merged by Ray.

Ray's job supervisor starts the entrypoint with the job's runtime_env as JSON in
``RAY_JOB_CONFIG_JSON_ENV_VAR`` and the job's variables in its environment
(ray/dashboard/modules/job/job_supervisor.py); the driver's ``ray.init`` merges its own runtime_env
into the job's and refuses any field or variable the two share ("Failed to merge the Job's runtime
env", ray/_private/worker.py). The Jobs API server needs Ray's dashboard packages, which the CPU venv
lacks, so this test starts the driver as the supervisor would (that variable, those variables) and
lets Ray's own ``ray.init`` do the merge, joining a running cluster as a submitted job does (the
package shipped). The job sets a variable bandpo forwards (``HF_TOKEN``) and a field bandpo sets
(``excludes``), as a user's ``ray job submit --runtime-env-json`` does, and ``DS_ACCELERATOR=cpu``,
which an actor rank's own runtime_env overrides with its plan's device (Ray merges a child's
variables over its job's).
"""

import json
import os
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

# DS_ACCELERATOR=cpu: a job submitted from a head without GPUs may carry it to every worker
JOB = {"env_vars": {"HF_TOKEN": "job-token", "DS_ACCELERATOR": "cpu"}, "excludes": ["*.ckpt"]}


def _seen():
    return os.environ.get("HF_TOKEN"), os.environ.get("WANDB_PROJECT"), os.environ.get("DS_ACCELERATOR")


class _Rank:
    def seen(self):
        return _seen()


def test_a_job_whose_runtime_env_shares_keys_with_bandpos_starts(monkeypatch):
    import ray
    from ray.cluster_utils import Cluster

    from bandpo.actor.group import rank_env
    from bandpo.distributed import init_ray

    # the task below travels by value: the workers import the bandpo the job shipped, not the tests
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": JOB, "metadata": {}}))
        # the supervisor's environment carries the job's variables; WANDB_PROJECT is the driver's own
        monkeypatch.setenv("HF_TOKEN", "job-token")
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")
        monkeypatch.setenv("WANDB_PROJECT", "p")
        assert init_ray(c.address, "cpu") == "cpu"  # raised "Failed to merge the Job's runtime env"
        assert ray.get(ray.remote(_seen).remote()) == ("job-token", "p", "cpu")
        # an actor rank's own variables (bandpo.actor.group.rank_env) win over the job's
        rank = ray.remote(_Rank).options(num_cpus=0, runtime_env={"env_vars": rank_env("cuda")}).remote()
        assert ray.get(rank.seen.remote()) == ("job-token", "p", "cuda")
        job_env = ray.get_runtime_context().runtime_env  # the merged one (Ray consumed "excludes" uploading)
        assert job_env["py_modules"] and job_env["env_vars"]["HF_TOKEN"] == "job-token"
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        ray.shutdown()
        c.shutdown()

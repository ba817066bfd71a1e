"""Checkpoint files load with ``weights_only=True`` (``bandpo.checkpoint.safe_load``): a file whose pickle would
run code is refused by name in one line and nothing of it runs, in every reader of a checkpoint
(the run's batch drawn ahead, the RNG states, the actor's error path, the fault checks, DeepSpeed's
own loader); the RNG states hold only tensors and plain data and still restore exactly."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from bandpo.checkpoint import actor_state as ckpt
from bandpo.checkpoint import safe_load
from bandpo.errors import InputError, UnsafeCheckpoint


class MakeDir:
    """Unpickling it calls ``os.mkdir(path)``: the marker a crafted checkpoint would leave."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


class Shell:
    """Unpickling it runs a shell command that creates ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"mkdir {self.path}",)


def craft(file, payload) -> None:
    """A checkpoint-looking file (tensors under "module") that also pickles ``payload``."""
    file.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"module": {"w": torch.ones(2)}, "extra": payload}, file)


def assert_refused(error: pytest.ExceptionInfo, file, marker, global_name: str) -> None:
    """One line naming the file and the pickled global, saying it is refused; the marker never appeared."""
    msg = str(error.value)
    assert isinstance(error.value, InputError)  # the CLIs print it as their one-line input error
    assert len(msg.splitlines()) == 1, msg
    assert f"unsafe checkpoint: {file} holds pickled code ({global_name})" in msg
    assert "bandpo refuses to run it" in msg
    assert not marker.exists()


@pytest.fixture(params=[MakeDir, Shell], ids=["os.mkdir", "os.system"])
def payload(request, tmp_path):
    marker = tmp_path / "pwned"
    name = {MakeDir: "posix.mkdir", Shell: "posix.system"}[request.param]
    return request.param(marker), marker, name


def test_the_batch_drawn_ahead_holding_code_is_refused(tmp_path, payload):
    from bandpo.checkpoint.run_folders import load_in_flight
    from bandpo.trainer.overlap import in_flight_types

    obj, marker, name = payload
    file = tmp_path / "step_000002" / "in_flight.pt"
    craft(file, obj)
    with pytest.raises(UnsafeCheckpoint) as e:
        load_in_flight(file, in_flight_types())  # the trainer's dataclasses are allowed, os.* never
    assert_refused(e, file, marker, name)


def test_rng_file_holding_code_is_refused(tmp_path, payload):
    obj, marker, name = payload
    file = tmp_path / "rng_rank0.pt"
    craft(file, obj)
    with pytest.raises(UnsafeCheckpoint) as e:
        ckpt.load_rng(tmp_path, 0)
    assert_refused(e, file, marker, name)


def test_actor_error_path_and_fault_checks_refuse_a_shard_holding_code(tmp_path, payload):
    """The file naming after a failed DeepSpeed load, and the fault test's weight reader, load the
    ZeRO shards themselves: with DeepSpeed's classes allowed, and nothing else."""
    from bandpo.tools.fault_test.checks import final_weights

    obj, marker, name = payload
    step = tmp_path / "run" / "checkpoints" / "step_000001"
    file = step / "actor" / "state" / "mp_rank_00_model_states.pt"
    craft(file, obj)
    (tmp_path / "run" / "checkpoints" / "latest").write_text(step.name)
    with pytest.raises(UnsafeCheckpoint) as e:
        ckpt.raise_naming_unreadable_file(step / "actor" / "state", ValueError("DeepSpeed's error"))
    assert_refused(e, file, marker, name)
    with pytest.raises(UnsafeCheckpoint) as e:
        final_weights(tmp_path / "run")
    assert_refused(e, file, marker, name)


def test_deepspeeds_own_loader_is_held_to_weights_only(tmp_path, payload):
    """zero_to_fp32 calls ``torch.load(..., weights_only=False)`` itself; inside ``weights_only_loads`` that
    is overridden. The crafted file sits outside the checked folder, as one swapped in after the check
    would: the load itself refuses it."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    obj, marker, name = payload
    craft(tmp_path / "actor" / "state" / "mp_rank_00_model_states.pt", obj)
    (tmp_path / "checked").mkdir()
    before = os.environ.get(safe_load.FORCE_WEIGHTS_ONLY)
    with pytest.raises(UnsafeCheckpoint) as e:
        with safe_load.weights_only_loads(tmp_path / "checked", safe_load.deepspeed_globals()):
            get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "actor"), tag="state")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and "refuses to run it" in msg and name in msg, msg
    assert not marker.exists()
    assert os.environ.get(safe_load.FORCE_WEIGHTS_ONLY) == before  # the override ends with the block


def test_deepspeed_classes_load_only_where_allowed(tmp_path):
    """What DeepSpeed pickles into its ZeRO optimizer files loads with its allow-list and is refused
    without it (no other reader trusts DeepSpeed's classes)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    file = tmp_path / "optim_states.pt"
    torch.save(
        {
            "loss_scaler": LossScaler(1.0),
            "zero_stage": ZeroStageEnum.gradients,
            "param_slice_mappings": [{"w": fragment_address(numel=4, start=0)}],
        },
        file,
    )
    state = safe_load.load(file, safe_load.deepspeed_globals())
    assert state["loss_scaler"].cur_scale == 1.0 and state["zero_stage"] == ZeroStageEnum.gradients
    assert state["param_slice_mappings"][0]["w"] == fragment_address(numel=4, start=0)
    with pytest.raises(UnsafeCheckpoint, match="LossScaler"):
        safe_load.load(file)


def test_rng_states_restore_exactly_from_tensors_and_plain_data(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # Python's and numpy's Gaussian caches are part of the state
    np.random.standard_normal()
    ckpt.save_rng(tmp_path, 0)
    assert safe_load.unsafe_globals(tmp_path / "rng_rank0.pt") == []  # nothing beyond torch's safe types

    def draws():
        return [
            random.random(),
            random.gauss(0, 1),
            *np.random.standard_normal(3).tolist(),
            *torch.rand(3).tolist(),
        ]

    expected = draws()
    ckpt.load_rng(tmp_path, 0)
    assert draws() == expected  # bit-exact: the same generator states, not close ones


def test_rng_file_of_the_older_format_is_refused_as_such(tmp_path):
    """Older bandpo pickled numpy's state tuple (an ndarray inside): not loaded, and said why."""
    file = tmp_path / "rng_rank0.pt"
    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}, file
    )
    with pytest.raises(RuntimeError, match=rf"old checkpoint format: {file} holds numpy's RNG state") as e:
        ckpt.load_rng(tmp_path, 0)
    assert len(str(e.value).splitlines()) == 1


def test_the_drivers_check_allows_deepspeeds_classes_by_name_and_refuses_older_rng_files(tmp_path):
    """``check_files`` (the trainer's, before any rank loads) passes a folder of DeepSpeed's own shards and
    new RNG files, refuses an older RNG file as such and a shard holding code by name."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    optim = tmp_path / "state" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    optim.parent.mkdir()
    torch.save(
        {
            "loss_scaler": LossScaler(1.0),
            "zero_stage": ZeroStageEnum.weights,
            "param_slice_mappings": [{"w": fragment_address(numel=4, start=0)}],
        },
        optim,
    )
    ckpt.save_rng(tmp_path, 0)
    ckpt.check_files(tmp_path)

    torch.save({"numpy": np.random.get_state()}, tmp_path / "rng_rank1.pt")
    with pytest.raises(RuntimeError, match="old checkpoint format: .*rng_rank1.pt"):
        ckpt.check_files(tmp_path)
    (tmp_path / "rng_rank1.pt").unlink()
    shard = tmp_path / "state" / "mp_rank_00_model_states.pt"
    craft(shard, MakeDir(tmp_path / "pwned"))
    with pytest.raises(UnsafeCheckpoint) as e:
        ckpt.check_files(tmp_path)
    assert_refused(e, shard, tmp_path / "pwned", "posix.mkdir")

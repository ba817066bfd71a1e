"""A relative ``trainer.output_dir`` is the driver's folder: made absolute before any worker gets a path
from it (a raylet on another node has another working directory)."""


def test_a_relative_output_dir_is_made_absolute_on_the_driver(tmp_path, monkeypatch):
    from bandpo.config import compose
    from bandpo.trainer.launch import run_folder
    from bandpo.trainer.loop import Trainer
    from tests.helpers.parts import fake_parts

    monkeypatch.chdir(tmp_path)
    cfg = compose(["trainer.output_dir=runs/r"])
    out = run_folder(cfg)
    assert out == tmp_path / "runs" / "r" and out.is_absolute()
    assert (out / "config.yaml").is_file()  # the composed config, written before start-up
    trainer = Trainer(cfg, fake_parts(cfg, out))
    assert trainer.ckpt.root == tmp_path / "runs" / "r" / "checkpoints"  # the ranks' checkpoint folders


def test_a_resolved_model_path_goes_into_a_copy_and_the_config_stays_as_composed(tmp_path):
    """Start-up writes the weights it trained into <run>/config.yaml without changing the run's config."""
    from omegaconf import OmegaConf

    from bandpo.config import compose
    from bandpo.trainer.launch import with_model_path, write_config

    cfg = compose(["model.path=some/hub-id"])
    resolved = with_model_path(cfg, "/abs/built")
    assert (resolved.model.path, cfg.model.path) == ("/abs/built", "some/hub-id")
    assert resolved.model.build == cfg.model.build and resolved.rollout is cfg.rollout
    write_config(tmp_path, resolved)
    assert OmegaConf.load(tmp_path / "config.yaml").model.path == "/abs/built"

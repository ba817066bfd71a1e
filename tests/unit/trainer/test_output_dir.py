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

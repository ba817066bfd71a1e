"""A relative ``trainer.output_dir`` is the driver's folder: made absolute before any worker gets a path
from it (a raylet on another node has another working directory)."""


def test_a_relative_output_dir_is_made_absolute_on_the_driver(tmp_path, monkeypatch):
    from bandpo.config import compose
    from bandpo.trainer.loop import Trainer

    monkeypatch.chdir(tmp_path)
    trainer = Trainer(compose(["trainer.output_dir=runs/r"]))
    assert trainer.out == tmp_path / "runs" / "r" and trainer.out.is_absolute()
    assert trainer.ckpt.root == tmp_path / "runs" / "r" / "checkpoints"  # the ranks' checkpoint folders

"""`taperfold train` and taperfold.train: the schedule's least number of steps, the learning rate's bounds, and no
diverged model returned for saving."""

import pytest
import torch

from taperfold.errors import TaperfoldError


def test_train_steps_start_at_what_the_schedule_needs(cli, tmp_path):
    r = cli("train", "--steps", "29", "-o", tmp_path / "t.pt")
    assert r.exit_code == 2 and "'--steps': 29 is not in the range x>=30" in r.stderr
    assert "at least 30" in cli("train", "--help").stdout


@pytest.mark.parametrize("value", ["nan", "-1", "0", "inf"])
def test_train_lr_must_be_a_positive_finite_number(cli, tmp_path, value):
    r = cli("train", "--lr", value, "-o", tmp_path / "t.pt")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "'--lr'" in r.stderr
    assert not (tmp_path / "t.pt").exists()


@pytest.mark.parametrize("poison", ["validation loss", "weight"])
def test_a_model_that_diverged_by_its_last_step_is_not_returned_for_saving(monkeypatch, poison):
    """The per-step check sees the loss before the last update; the model after it can still be NaN (10 steps
    from scratch, as `train --steps 10` once saved). The last evaluation stands in for that here."""
    import taperfold.train
    from taperfold.models import preset_config
    from taperfold.train import TrainOptions, train

    def evaluate(model, tokens, opts, seq):
        if poison == "weight":
            with torch.no_grad():
                model.model.layers[1].mlp.up_proj.weight[0, 0] = float("inf")
            return 2.0
        return float("nan")

    monkeypatch.setattr(taperfold.train, "evaluate", evaluate)
    cfg = preset_config("tiny", arch="llama", taper="internal", n_layers=2, max_seq_len=32)
    with pytest.raises(TaperfoldError, match="diverged by its last step") as info:
        train(cfg, TrainOptions(steps=30, batch_size=2, eval_batches=1))
    assert ("model.layers.1.mlp.up_proj.weight" if poison == "weight" else "validation loss nan") in str(info.value)
    assert "nothing was saved" in str(info.value) and "\n" not in str(info.value)

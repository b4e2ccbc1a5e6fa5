"""transformers' own `Trainer` driving the taper through `trainer_callback`: a real run of a few optimizer
steps on a tiny tapered model (from a config, nothing downloaded), saved and exported with the fold."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # trains and exports a model
import accelerate  # noqa: E402,F401  Trainer needs it; the [hf] extra installs it with transformers, so no skip
from hf_models import tiny_config  # noqa: E402

from taperfold.hf import save_hf_directory, taper_model  # noqa: E402
from taperfold.hf.training import TaperHook, trainer_callback  # noqa: E402
from taperfold.nn import GateSchedule  # noqa: E402

STEPS, TAPER_START, TAPER_END = 8, 3, 6


def test_trainer_runs_the_schedule_and_saves_a_foldable_directory(cli, tmp_path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    tapering = taper_model(model, "internal")
    hook = TaperHook(model, GateSchedule(taper_start=TAPER_START, taper_end=TAPER_END))
    seen = []  # (global step, gate, c of every tapered norm) after the taper callback set the step's gate

    class Record(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            seen.append((state.global_step, tapering.gate.value, [float(n.c) for n in tapering.norms.values()]))

    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 256, (16, 12), generator=gen)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=STEPS,
        learning_rate=1e-3,
        per_device_train_batch_size=2,
        save_strategy="no",
        report_to=[],
        logging_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, callbacks=[trainer_callback(hook), Record()]
    )
    state = trainer.train()
    hook.remove()

    assert state.global_step == STEPS and [s for s, _, _ in seen] == list(range(STEPS))
    gates = [g for _, g, _ in seen]
    assert gates[: TAPER_START + 1] == [1.0] * (TAPER_START + 1) and 0 < gates[TAPER_START + 1] < 1
    assert gates[TAPER_END:] == [0.0] * (STEPS - TAPER_END) and tapering.gate.value == 0.0
    # c moved once, to c* at taper start, and never after (it is not trained)
    cs = [c for _, _, c in seen]
    assert cs[TAPER_START] != cs[TAPER_START - 1] and all(c == cs[TAPER_START] for c in cs[TAPER_START:])
    assert [float(n.c) for n in tapering.norms.values()] == cs[TAPER_START]
    assert all(int(n.ema_count) == TAPER_START and bool(n.calibrated) for n in tapering.norms.values())

    tapered = save_hf_directory(model.eval(), tmp_path / "tapered", step=state.global_step, schedule=hook.schedule)
    assert json.loads((tapered / "config.json").read_text())["taperfold"]["gate"] == 0.0
    result = cli("export", tapered, "-o", tmp_path / "out", "--no-baseline")  # one graph: keeps it fast
    assert result.exit_code == 0, result.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["artifacts"]["folded"]["reports"]["fold"]["summary"]["folded"] == len(tapering.norms) == 4

"""Training through the taper with transformers models: a step hook, a Trainer callback, and the loop
behind `taperfold train --from HF_DIR`.

The schedule is taperfold.train's (taperfold.nn.GateSchedule): gate 1 through warm-up while every tapered
norm accumulates its calibration EMAs, then at taper start c ← c* is frozen and γ̃ ← γ, then the gate is
cosine-decayed to 0 by taper end. With the scale-anchoring loss on (eq. 5), the target is frozen at
taper start too and λ·E[(s(h) − s_tgt)²] on the final norm's input is added to the loss the model returns
(`output.loss`, when labels are given) and kept in `hook.last_aux` for loops that compute their own loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from taperfold.errors import TaperfoldError
from taperfold.hf.model import HFCausalLM, HFModelInfo
from taperfold.hf.save import save_hf_directory
from taperfold.hf.source import CONFIG, HFCheckpoint, load_hf_directory
from taperfold.hf.taper import taper_model, tapering_of
from taperfold.hf.tokenizer import has_tokenizer, load_tokenizer
from taperfold.nn import GateSchedule
from taperfold.taper import GateDriver
from taperfold.train import TrainOptions, gate_schedule, load_corpus, train_through_taper


class TaperHook(GateDriver):
    """Drives a tapered model's gate from any training loop: call `hook.step(k)` before step k's forward.

    hook = TaperHook(model, GateSchedule(taper_start=25, taper_end=100))
    for k in range(steps):
        hook.step(k)
        loss = model(input_ids=x, labels=x).loss   # includes the scale-anchoring term when enabled
        ...
    hook.finish(steps)                             # the gate is exactly 0 once the schedule has ended
    """

    def __init__(self, model, schedule: GateSchedule):
        super().__init__(tapering_of(model), schedule)
        self.model = model
        self.last_aux = torch.zeros(())
        self._handles = []
        if self.tapering.scale_loss is not None:
            final = model.get_submodule(self.tapering.family.final)
            self._handles.append(final.register_forward_pre_hook(self._keep_final_input))
            self._handles.append(model.register_forward_hook(self._add_aux, with_kwargs=True))
        self._final_input = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _keep_final_input(self, module, args):
        self._final_input = args[0]

    def _add_aux(self, model, args, kwargs, output):
        h, self._final_input = self._final_input, None
        if not model.training or h is None:
            return output
        mask = kwargs.get("attention_mask")
        scale_loss = self.tapering.scale_loss
        self.last_aux = scale_loss.to(h.device)(h, mask, track=self.tapering.gate.calibrating)
        if getattr(output, "loss", None) is not None:
            output.loss = output.loss + self.last_aux
        return output


def schedule_for(
    steps: int, warmup_frac: float = 0.05, taper_start_frac: float = 0.1, taper_end_frac: float = 0.8
) -> GateSchedule:
    """The schedule `taperfold train` uses for `steps` optimizer steps."""
    return gate_schedule(
        TrainOptions(
            steps=steps, warmup_frac=warmup_frac, taper_start_frac=taper_start_frac, taper_end_frac=taper_end_frac
        )
    )


def trainer_callback(hook: TaperHook):
    """A transformers `TrainerCallback` that drives `hook` from `Trainer`'s optimizer steps."""
    from transformers import TrainerCallback

    class TaperCallback(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            hook.step(state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            hook.finish(state.global_step)

    return TaperCallback()


# ---- `taperfold train --from HF_DIR` -------------------------------------------------------------------


@dataclass
class HFTrainResult:
    model: nn.Module  # the tapered transformers model, at the schedule's end (g = 0)
    tokenizer: object | None
    schedule: GateSchedule | None  # None for a plain run (--taper none): no gate, nothing tapered
    val_loss: float
    source: Path  # the plain directory it was tapered from (its tokenizer files are copied along)
    steps: int
    history: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def gate(self) -> float:
        return tapering_of(self.model).gate.value if self.schedule is not None else 1.0

    @property
    def tokenizer_name(self) -> str:
        return "hf" if self.tokenizer is not None else "bytes"

    def save(self, out_dir: str | Path) -> Path:
        """A tapered save_pretrained directory (a plain one for a plain run), with the tokenizer files of the source
        when it had some."""
        return save_hf_directory(
            self.model,
            out_dir,
            step=self.steps,
            schedule=self.schedule,
            tokenizer_from=self.source if self.tokenizer is not None else None,
            plain=self.schedule is None,
        )


def _tokens(folder: Path, files: list[Path] | None, opts: TrainOptions, vocab_size: int):
    """The corpus as token ids: the directory's tokenizer when it has one, bytes otherwise."""
    raw, _ = load_corpus(files, opts.max_corpus_bytes)
    tokenizer = None
    if has_tokenizer(folder):
        tokenizer = load_tokenizer(folder)
        text = bytes(raw.to(torch.uint8).tolist()).decode("utf-8", errors="replace")
        tokens = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
        if len(tokens) < 2:
            raise TaperfoldError(f"{folder}: its tokenizer turned the training data into {len(tokens)} tokens")
    else:
        tokens = raw
        if vocab_size < 256:
            raise TaperfoldError(
                f"{folder / CONFIG}: key 'vocab_size' is {vocab_size}: byte tokens (0..255) do "
                "not fit and the directory has no tokenizer"
            )
    if int(tokens.max()) >= vocab_size:
        raise TaperfoldError(f"{folder}: token id {int(tokens.max())} does not fit vocab_size {vocab_size}")
    return tokens, tokenizer


def train_hf_directory(
    source: str | Path | HFCheckpoint,
    opts: TrainOptions,
    data_files: list[Path] | None = None,
    taper: str = "internal",
    aux: bool = True,
    on_step=None,
) -> HFTrainResult:
    """Taper the plain save_pretrained directory `source` and fine-tune it through the whole taper schedule
    (taperfold.train's loop, on windows of at most 128 tokens); `taper` "none": fine-tune it as it is, with the same
    loop and learning rate (the baseline a tapered run is compared with)."""
    ckpt = source if isinstance(source, HFCheckpoint) else load_hf_directory(source)
    if ckpt.tapered:
        raise TaperfoldError(
            f"{ckpt.path / CONFIG}: already tapered (key 'taperfold' present, gate "
            f"{ckpt.gate:g}); train from the plain model"
        )
    torch.manual_seed(opts.seed)
    hf = ckpt.hf_model(tapered=False)
    tokens, tokenizer = _tokens(ckpt.path, data_files, opts, ckpt.config.vocab_size)
    family = ckpt.family
    if taper != "none":
        family = taper_model(hf, taper, family=ckpt.family, aux=aux, where=str(ckpt.path)).family
    info = HFModelInfo(**{**ckpt.config.to_dict(), "taper": taper, "aux": aux and taper != "none"})
    model = HFCausalLM(hf, info, family)
    seq = min(opts.seq_len or 128, ckpt.config.max_seq_len)
    loop = train_through_taper(model, tokens, seq, opts, on_step)
    return HFTrainResult(
        hf.eval(), tokenizer, loop.schedule, loop.val_loss, ckpt.path, opts.steps, loop.history, loop.seconds
    )

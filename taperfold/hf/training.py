"""Training through the taper with transformers models: a step hook, a Trainer callback, and the loop
behind `taperfold train --from HF_DIR`.

The schedule is taperfold.train's (taperfold.nn.GateSchedule): gate 1 through warm-up while every tapered
norm accumulates its calibration EMAs, then at taper start c ← c* is frozen and γ̃ ← γ, then the gate is
cosine-decayed to 0 by taper end. With the scale-anchoring loss on (eq. 5), the target is frozen at
taper start too and λ·E[(s(h) − s_tgt)²] on the final norm's input is added to the loss the model returns
(`output.loss`, when labels are given) and kept in `hook.last_aux` for loops that compute their own loss.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from taperfold.errors import TaperfoldError
from taperfold.hf.taper import taper_model, tapering_of
from taperfold.nn import GateSchedule
from taperfold.train import TrainOptions, gate_schedule, load_corpus, lr_at, random_windows, split_corpus


class TaperHook:
    """Drives a tapered model's gate from any training loop: call `hook.step(k)` before step k's forward.

        hook = TaperHook(model, GateSchedule(taper_start=25, taper_end=100))
        for k in range(steps):
            hook.step(k)
            loss = model(input_ids=x, labels=x).loss   # includes the scale-anchoring term when enabled
            ...
        hook.finish(steps)                             # the gate is exactly 0 once the schedule has ended
    """

    def __init__(self, model, schedule: GateSchedule):
        self.model, self.schedule = model, schedule
        self.tapering = tapering_of(model)
        self.started = all(bool(norm.calibrated) for norm in self.tapering.norms.values())
        self.last_aux = torch.zeros(())
        self._handles = []
        if self.tapering.scale_loss is not None:
            final = model.get_submodule(self.tapering.family.final)
            self._handles.append(final.register_forward_pre_hook(self._keep_final_input))
            self._handles.append(model.register_forward_hook(self._add_aux, with_kwargs=True))
        self._final_input = None

    def step(self, step: int) -> float:
        """Set the gate for optimizer step `step` (0-based); at taper start, freeze c and the scale target."""
        if step >= self.schedule.taper_start and not self.started:
            self.tapering.start_taper()
            self.started = True
        gate = self.schedule(step)
        self.tapering.set_gate(gate, calibrating=step < self.schedule.taper_start)
        return gate

    def finish(self, steps: int) -> float:
        """After the last step: the gate the schedule gives at `steps` (0 when the taper has ended)."""
        gate = self.schedule(steps)
        self.tapering.set_gate(gate)
        return gate

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


def schedule_for(steps: int, warmup_frac: float = 0.05, taper_start_frac: float = 0.1,
                 taper_end_frac: float = 0.8) -> GateSchedule:
    """The schedule `taperfold train` uses for `steps` optimizer steps."""
    return gate_schedule(TrainOptions(steps=steps, warmup_frac=warmup_frac, taper_start_frac=taper_start_frac,
                                      taper_end_frac=taper_end_frac))


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
    model: object
    tokenizer: object | None
    schedule: GateSchedule
    val_loss: float
    history: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def _tokens(folder: Path, files: list[Path] | None, opts: TrainOptions, vocab_size: int):
    """The corpus as token ids: the directory's tokenizer when it has one, bytes otherwise."""
    from taperfold.hf.directory import CONFIG, TOKENIZER_FILES, read_json_object

    raw, _ = load_corpus(files, opts.max_corpus_bytes)
    tokenizer = None
    if any((folder / f).is_file() for f in TOKENIZER_FILES):
        tok_config = folder / "tokenizer_config.json"
        if tok_config.is_file() and "auto_map" in read_json_object(tok_config):
            raise TaperfoldError(f"{tok_config}: key 'auto_map' asks for the directory's own tokenizer code; "
                                 "taperfold never runs code from a checkpoint")
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        try:  # tokenizer.json describes the tokenizer completely; read it as it is
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json")) \
                if (folder / "tokenizer.json").is_file() else \
                AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False, local_files_only=True)
        except Exception as e:  # tokenizer loaders raise many types; one line names the directory
            raise TaperfoldError(f"{folder}: cannot load its tokenizer ({str(e).splitlines()[0]})") from None
        text = bytes(raw.to(torch.uint8).tolist()).decode("utf-8", errors="replace")
        tokens = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
        if len(tokens) < 2:
            raise TaperfoldError(f"{folder}: its tokenizer turned the training data into {len(tokens)} tokens")
    else:
        tokens = raw
        if vocab_size < 256:
            raise TaperfoldError(f"{folder / CONFIG}: key 'vocab_size' is {vocab_size}: byte tokens (0..255) do "
                                 "not fit and the directory has no tokenizer")
    if int(tokens.max()) >= vocab_size:
        raise TaperfoldError(f"{folder}: token id {int(tokens.max())} does not fit vocab_size {vocab_size}")
    return tokens, tokenizer


@torch.no_grad()
def _evaluate(model, tokens: torch.Tensor, opts: TrainOptions, seq: int) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(opts.eval_batches):
        x, y = random_windows(tokens, opts.batch_size, seq, gen)
        window = torch.cat([x, y[:, -1:]], dim=1)
        losses.append(float(model(input_ids=window, labels=window).loss))
    model.train()
    return sum(losses) / len(losses)


def train_hf_directory(source: str | Path, opts: TrainOptions, data_files: list[Path] | None = None,
                       taper: str = "internal", aux: bool = True, on_step=None) -> HFTrainResult:
    """Fine-tune the plain save_pretrained directory `source` through the whole taper schedule."""
    from taperfold.hf.directory import load_hf_directory

    source = Path(source)
    ckpt = load_hf_directory(source)
    if ckpt.tapered:
        raise TaperfoldError(f"{source / 'config.json'}: already tapered (key 'taperfold' present, gate "
                             f"{ckpt.gate:g}); train from the plain model")
    torch.manual_seed(opts.seed)
    model = ckpt.hf_model(tapered=False).train()
    tokens, tokenizer = _tokens(source, data_files, opts, ckpt.config.vocab_size)
    train_tokens, val_tokens = split_corpus(tokens)
    seq = min(opts.seq_len or 128, ckpt.config.max_seq_len - 1)
    if len(val_tokens) <= seq + 1:
        raise TaperfoldError(f"training data too small for windows of {seq} tokens")
    taper_model(model, taper, aux=aux, where=str(source))
    schedule = gate_schedule(opts)
    hook = TaperHook(model, schedule)
    optim = torch.optim.AdamW(model.parameters(), lr=opts.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(opts.seed)
    history, t0 = [], time.perf_counter()
    for step in range(opts.steps):
        gate = hook.step(step)
        for group in optim.param_groups:
            group["lr"] = lr_at(step, opts)
        x, y = random_windows(train_tokens, opts.batch_size, seq, gen)
        window = torch.cat([x, y[:, -1:]], dim=1)
        loss = model(input_ids=window, labels=window).loss  # cross-entropy (+ the scale-anchoring term)
        if not torch.isfinite(loss):
            raise TaperfoldError(f"training diverged at step {step + 1} (loss {loss.item():g}, gate {gate:.3f}); "
                                 "nothing was saved: a longer schedule (--steps) or a lower --lr gives the taper room")
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opts.grad_clip)
        optim.step()
        aux_value = float(hook.last_aux.detach())
        record = {"step": step + 1, "loss": loss.item() - aux_value, "aux": aux_value, "gate": gate,
                  "lr": optim.param_groups[0]["lr"]}
        if (step + 1) % opts.log_every == 0 or step + 1 == opts.steps:
            history.append(record)
        if on_step:
            on_step(step + 1, record)
    hook.finish(opts.steps)
    hook.remove()
    val_loss = _evaluate(model, val_tokens, opts, seq)
    return HFTrainResult(model.eval(), tokenizer, schedule, val_loss, history, time.perf_counter() - t0)

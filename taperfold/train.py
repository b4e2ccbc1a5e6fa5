"""Training through the taper: the one loop behind `taperfold train --preset` (a new model of taperfold's own)
and `taperfold train --from` (a plain model tapered, then fine-tuned; taperfold.sources).

The recipe is the paper's (Appendix C), shortened: AdamW β = (0.9, 0.95), no weight decay, gradient
clipping at 1.0, linear LR warm-up then cosine decay to 0. The gate is 1 through warm-up (tapered
layers accumulate their calibration EMAs), at taper start every layer freezes c and copies γ → γ̃,
then the gate is cosine-decayed to 0 by `taper_end`, and the last steps train at g = 0 exactly.

Data: byte-level tokens (vocab 256) of text files; with none given, the Python standard library's own
source files, which every machine with Python has. Nothing is downloaded.
"""

from __future__ import annotations

import math
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from taperfold.errors import TaperfoldError
from taperfold.models import ModelConfig, build_model
from taperfold.nn import GateSchedule
from taperfold.sources.builtin import Checkpoint, checkpoint_from_model, save_checkpoint
from taperfold.taper import GateDriver, TaperedLM


@dataclass
class TrainOptions:
    steps: int = 600
    batch_size: int = 16
    seq_len: int | None = None  # default: the model's context
    lr: float = 2e-3
    warmup_frac: float = 0.05  # LR warm-up; the gate is held at 1 at least this long
    taper_start_frac: float = 0.1
    taper_end_frac: float = 0.8  # then (1 - 0.8) of the steps train at g = 0 exactly
    grad_clip: float = 1.0
    seed: int = 0
    eval_batches: int = 16
    log_every: int = 50
    max_corpus_bytes: int = 4_000_000


@dataclass
class TrainResult:
    checkpoint: Checkpoint
    val_loss: float
    history: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    tokenizer_name = "bytes"

    @property
    def gate(self) -> float:
        return self.checkpoint.gate

    def save(self, path: str | Path) -> Path:
        return save_checkpoint(self.checkpoint, path)


def default_corpus_files() -> list[Path]:
    """The standard library's .py files, sorted so the corpus is the same on every run."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("*.py") if p.is_file())


def load_corpus(files: list[Path] | None, max_bytes: int) -> tuple[torch.Tensor, dict]:
    """Concatenate files as bytes (token ids 0..255), up to `max_bytes`."""
    files = list(files) if files else default_corpus_files()
    chunks, total = [], 0
    for f in files:
        try:
            data = Path(f).read_bytes()
        except OSError as e:
            raise TaperfoldError(f"{f}: cannot read training data ({e.strerror or e})") from None
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    corpus = b"".join(chunks)
    if len(corpus) < 10_000:
        raise TaperfoldError(f"training data too small: {len(corpus)} bytes (need at least 10000)")
    tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
    source = "python-stdlib" if len(files) and files == default_corpus_files() else "files"
    return tokens, {"source": source, "files": len(files), "bytes": len(corpus)}


def split_corpus(tokens: torch.Tensor, val_frac: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    cut = int(len(tokens) * (1 - val_frac))
    return tokens[:cut], tokens[cut:]


def random_windows(tokens: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(seq + 1)[None, :]
    window = tokens[idx]
    return window[:, :-1], window[:, 1:]


def lr_at(step: int, opts: TrainOptions) -> float:
    warm = max(1, int(opts.steps * opts.warmup_frac))
    if step < warm:
        return opts.lr * (step + 1) / warm
    progress = (step - warm) / max(1, opts.steps - warm)
    return opts.lr * 0.5 * (1 + math.cos(math.pi * progress))


def gate_schedule(opts: TrainOptions) -> GateSchedule:
    start = max(1, int(opts.steps * opts.taper_start_frac), int(opts.steps * opts.warmup_frac))
    end = max(start + 1, int(opts.steps * opts.taper_end_frac))
    if end > opts.steps:
        raise TaperfoldError(f"taper end ({end}) is after the last step ({opts.steps}): the gate would not reach 0")
    return GateSchedule(start, end)


@torch.no_grad()
def evaluate(model: TaperedLM, tokens: torch.Tensor, opts: TrainOptions, seq: int) -> float:
    """Mean cross-entropy on `opts.eval_batches` fixed windows of held-out tokens."""
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = [
        model.loss(*random_windows(tokens, opts.batch_size, seq, gen))[0].item() for _ in range(opts.eval_batches)
    ]
    model.train()
    return sum(losses) / len(losses)


@dataclass
class LoopResult:
    val_loss: float
    history: list[dict]  # a record every `log_every` steps and the last
    seconds: float
    schedule: GateSchedule | None  # None: a plain model, nothing tapered


def train_through_taper(
    model: TaperedLM, tokens: torch.Tensor, seq: int, opts: TrainOptions, on_step=None
) -> LoopResult:
    """Train `model` (tapered or plain) on windows of `seq` tokens through the whole gate schedule: the gate
    is 1 through warm-up, c and the scale target freeze at taper start, the gate reaches 0 before the last
    step. `on_step(step, record)` is called after every step (for progress)."""
    train_tokens, val_tokens = split_corpus(tokens)
    if len(val_tokens) <= seq + 1:
        raise TaperfoldError(f"training data too small for windows of {seq} tokens")
    model.train()
    tapering = model.tapering  # DyT (no gate) and a plain model train with no gate to drive
    driver = GateDriver(tapering, gate_schedule(opts)) if tapering is not None and tapering.kind.gated else None
    optim = torch.optim.AdamW(model.parameters(), lr=opts.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(opts.seed)
    history, t0 = [], time.perf_counter()
    for step in range(opts.steps):
        if driver is not None:
            driver.step(step)
        for group in optim.param_groups:
            group["lr"] = lr_at(step, opts)
        x, y = random_windows(train_tokens, opts.batch_size, seq, gen)
        ce, aux = model.loss(x, y)
        if not torch.isfinite(ce + aux):
            raise TaperfoldError(
                f"training diverged at step {step + 1} (loss {ce.item():g}, aux {aux.item():g}, "
                f"gate {model.gate.value:.3f}); nothing was saved: a longer schedule "
                "(--steps) or a lower --lr gives the taper room"
            )
        optim.zero_grad(set_to_none=True)
        (ce + aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opts.grad_clip)
        optim.step()
        record = {
            "step": step + 1,
            "loss": ce.item(),
            "aux": float(aux.detach()),
            "gate": model.gate.value,
            "lr": optim.param_groups[0]["lr"],
        }
        if (step + 1) % opts.log_every == 0 or step + 1 == opts.steps:
            history.append(record)
        if on_step:
            on_step(step + 1, record)
    if driver is not None:
        driver.finish(opts.steps)  # g = 0: the schedule ended before the last step
    val_loss = evaluate(model, val_tokens, opts, seq)
    bad = next(
        (name for name, t in model.state_dict().items() if t.is_floating_point() and not t.isfinite().all()), None
    )
    if bad is not None or not math.isfinite(val_loss):
        where = f"weight '{bad}' holds NaN or Inf" if bad else f"validation loss {val_loss:g}"
        raise TaperfoldError(
            f"training diverged by its last step ({where}); nothing was saved: a longer schedule "
            "(--steps) or a lower --lr gives the taper room"
        )
    return LoopResult(val_loss, history, time.perf_counter() - t0, driver.schedule if driver else None)


def train(cfg: ModelConfig, opts: TrainOptions, data_files: list[Path] | None = None, on_step=None) -> TrainResult:
    """Train a new model of `cfg` from scratch on byte tokens (`taperfold train --preset`)."""
    torch.manual_seed(opts.seed)
    tokens, corpus_info = load_corpus(data_files, opts.max_corpus_bytes)
    if int(tokens.max()) >= cfg.vocab_size:
        raise TaperfoldError(f"token id {int(tokens.max())} does not fit vocab_size {cfg.vocab_size}")
    model = build_model(cfg)
    loop = train_through_taper(model, tokens, opts.seq_len or cfg.max_seq_len, opts, on_step)
    schedule = loop.schedule
    meta = {
        "val_loss": loop.val_loss,
        "train_seconds": round(loop.seconds, 1),
        "corpus": corpus_info,
        "options": dict(vars(opts)),
        "history": loop.history,
        "schedule": {"taper_start": schedule.taper_start, "taper_end": schedule.taper_end} if schedule else None,
    }
    ckpt = checkpoint_from_model(model.eval(), opts.steps, meta)
    return TrainResult(ckpt, loop.val_loss, loop.history, loop.seconds)

"""What one `taperfold bench` asks for, as data: a `BenchRequest` (the command's options, normalised once) and the
list parsing the modes share. bench.command runs a request; bench.serve reads one (--mode serve)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from taperfold.bench.measure import (
    AUTO,
    DEFAULT_NEW_TOKENS,
    DEFAULT_PROMPT,
    DEFAULT_SEQS,
    FUSED,
    MAX_BATCH,
    UNFUSED,
    BenchOptions,
)
from taperfold.engines import ENGINES, all_options, changed_options
from taperfold.errors import TaperfoldError
from taperfold.exportdir import canonical_variants


@dataclass(frozen=True)
class BenchRequest:
    """What one `taperfold bench` asks for. None: not given, resolved against the source when the request runs (the
    defaults --help states). The comma-separated lists stay text until the mode that reads them parses them (--batch
    and --seq: prefill and decode; --concurrency: serve), so that a run refuses only the lists it uses."""

    export_dir: str | None = None  # exactly one of export_dir, checkpoint and preset (resolve_source)
    checkpoint: str | None = None
    preset: str | None = None
    arch: str = "llama"  # with preset
    engine: str | None = None  # None: ort for an export directory, torch for a checkpoint or preset
    variants: tuple[str, ...] | None = None  # canonical names; None: the engine's default (Engine.default_variants)
    batches: str = "1,4"
    seqs: str | None = None
    warmup: int = 10
    iters: int = 50
    rounds: int | None = None
    mode: str = "prefill"  # prefill | decode | serve
    concurrency: str | None = None  # serve
    requests: int | None = None  # serve
    prompt: int | None = None
    new_tokens: int | None = None
    kv_cache: str | None = None
    dtype: str | None = None
    against: tuple[str, ...] = ()  # contenders built by other tools (bench.against)
    precision: str | None = None
    device: str | None = None
    threads: int | None = None
    engine_options: Mapping[str, Any] = field(default_factory=dict)  # runner keyword -> value, only those set
    fuse_projections: bool | None = None  # torch engine; None: as the export did (unfused for a checkpoint, preset)
    seed: int = 0
    json_path: str | None = None  # --report ('-': stdout)
    csv_path: str | None = None
    plot_path: str | None = None

    @classmethod
    def from_cli(cls, params: Mapping[str, Any]) -> BenchRequest:
        """The request of `taperfold bench`'s parsed options, by click's names (an engine option by its runner
        keyword, engines.all_options): --variants made canonical (refused in one line naming the option), --against
        split, and only the engine options the user changed kept."""
        given = dict(params)
        # the engine options the command line offers (those registered before it was built: engines.register)
        engine_options = changed_options({name: given.pop(name) for name in all_options() if name in given})
        spelled = given.pop("variants")
        variants = None
        if spelled is not None:
            try:
                variants = tuple(canonical_variants([v.strip() for v in spelled.split(",") if v.strip()]))
            except TaperfoldError as e:
                raise TaperfoldError(f"--variants: {e}") from None
        against = tuple(name.strip() for name in (given.pop("against") or "").split(",") if name.strip())
        return cls(**given, variants=variants, against=against, engine_options=engine_options)

    @property
    def engine_name(self) -> str:
        return self.engine or ("ort" if self.export_dir else "torch")

    def options(self) -> BenchOptions:
        """The prefill or decode run's options, the lengths not given at their defaults (fit_to_context caps them)."""
        return BenchOptions(
            engine=self.engine_name,
            variants=list(self.variants if self.variants is not None else ENGINES[self.engine_name].default_variants),
            batches=int_list("--batch", self.batches, MAX_BATCH),
            seqs=int_list("--seq", self.seqs) if self.seqs else list(DEFAULT_SEQS),
            warmup=self.warmup,
            iters=self.iters,
            rounds=self.rounds or min(5, self.iters),
            mode=self.mode,
            prompt=self.prompt or DEFAULT_PROMPT,
            new_tokens=self.new_tokens or DEFAULT_NEW_TOKENS,
            kv_cache=self.kv_cache or AUTO,
            dtype=self.dtype,
            device=self.device or ENGINES[self.engine_name].default_device,
            threads=self.threads,
            engine_options=dict(self.engine_options),
            seed=self.seed,
            fuse_projections=AUTO if self.fuse_projections is None else FUSED if self.fuse_projections else UNFUSED,
            precision=self.precision,
            against=list(self.against),
        )


def int_list(option: str, text: str, maximum: int | None = None) -> list[int]:
    """A comma-separated list of positive integers, repeats dropped; refused in one line naming `option`."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise TaperfoldError(f"{option}: {text!r} is not a comma-separated list of positive integers")
    if maximum is not None and max(values) > maximum:
        raise TaperfoldError(f"{option}: {max(values)} is above the largest allowed, {maximum}")
    return list(dict.fromkeys(values))

"""Numeric comparison of logits: metrics for one (reference, candidate) pair, and the tolerances they are held to.

Logits are compared row by row (one row per position that has logits, vocabulary along the last axis):

- max_abs: largest |candidate - reference|
- max_rel: max_abs divided by the largest |reference| of the same batch (a scale-free error)
- mean_abs: mean |candidate - reference|
- cosine: the smallest per-row cosine similarity
- top1: fraction of rows where both pick the same token
- top1_decisive: the same over rows that are not near-ties: rows where the reference's top two logits
  are further apart than the absolute tolerance (rtol x max |reference|). At that precision either
  token of a near-tie is a right answer, so only decisive rows are held to `min_top1`.
- top5: mean of |top-5(reference) ∩ top-5(candidate)| / 5
- kl: mean over rows of KL(softmax(reference) ‖ softmax(candidate)), in float64 via log-softmax
- nll_reference, nll_candidate: on the user's own tokens (verify --text, --tokens), the mean negative log-likelihood
  each gives the token that follows, over the rows whose next token is known (`scored`); exp of it is the perplexity

A pair passes when max_rel ≤ rtol, top1_decisive ≥ min_top1 and kl ≤ max_kl (and, for a quantized candidate
scored on enough of the user's tokens, its perplexity ≤ max_ppl_ratio x the reference's); cosine, top5 and the
others are reported only. NaN or Inf anywhere in the candidate fails every bound.

A weight-quantized candidate (int4, int8) moves every logit a little by design, so no bound is put on max_rel
(rtol None): it is held to the checkpoint by what quantization is judged by, the agreement of its top-1 tokens and
the KL of its distributions, with a near-tie margin of its own (`near_tie`: rows whose top two logits are closer
than that fraction of the logits' scale are either token's). Its min_top1 bounds the rate its decisive rows agree at:
a sample fails it when it is evidence of a lower rate (TOP1_SIGNIFICANCE), not when a few rows fall short by chance.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Tolerance:
    rtol: float | None  # bound on max_rel (None: not bounded, a quantized candidate)
    min_top1: float  # bound on top1_decisive
    max_kl: float  # bound on the mean KL
    basis: str | None = None  # why the bounds differ from the dtype's defaults (see between_graphs)
    near_tie: float | None = None  # the near-tie margin (x max |reference|) where it is not rtol
    max_ppl_ratio: float | None = None  # bound on perplexity(candidate) / perplexity(reference); None: reported only
    # min_top1 as a rate the candidate's tokens are drawn at (a quantized candidate): a sample of decisive rows fails it
    # only when its agreements are fewer than that rate gives with this probability (one-sided exact binomial test);
    # None: the sample's own rate is held to min_top1 (a float pair, where one decisive flip is a bug, not a draw)
    top1_significance: float | None = None

    @property
    def tie_margin(self) -> float:
        """Rows whose reference's top two logits are closer than this (x max |reference|) are near-ties."""
        return self.near_tie if self.near_tie is not None else (self.rtol or 0.0)

    def override(
        self,
        rtol: float | None = None,
        min_top1: float | None = None,
        max_kl: float | None = None,
        max_ppl_ratio: float | None = None,
    ) -> Tolerance:
        return replace(
            self,
            rtol=self.rtol if rtol is None else rtol,
            min_top1=self.min_top1 if min_top1 is None else min_top1,
            max_kl=self.max_kl if max_kl is None else max_kl,
            max_ppl_ratio=self.max_ppl_ratio if max_ppl_ratio is None else max_ppl_ratio,
        )

    def to_dict(self) -> dict:
        return asdict(self)


# Reference: the fp32 checkpoint in PyTorch. fp32 exports differ from it only by kernel order, and
# folding only reassociates one multiply, so the fold's own pair is held 10x tighter. In fp16/bf16 each
# side carries its own rounding, so every pair gets the dtype's bound (bf16 keeps 8 mantissa bits to
# fp16's 11).
DEFAULT_TOLERANCES: dict[tuple[str, str], Tolerance] = {
    ("fp32", "export"): Tolerance(rtol=1e-4, min_top1=0.999, max_kl=1e-6),
    ("fp32", "fold"): Tolerance(rtol=1e-5, min_top1=0.999, max_kl=1e-8),
    ("fp16", "export"): Tolerance(rtol=2e-2, min_top1=0.99, max_kl=5e-3),
    ("fp16", "fold"): Tolerance(rtol=2e-2, min_top1=0.99, max_kl=5e-3),
    ("bf16", "export"): Tolerance(rtol=5e-2, min_top1=0.98, max_kl=3e-2),
    ("bf16", "fold"): Tolerance(rtol=5e-2, min_top1=0.98, max_kl=3e-2),
}


# A quantized candidate's top-1 agreement is a rate: each decisive row flips or not as rounding happens to fall, so
# a small sample's own rate says little (7 decisive rows of a tiny model's verify: one flip is 0.14). Its top-1 fails
# when the sample is evidence that the rate is below min_top1: P(X <= agreements | n rows, min_top1) under this, a
# one-sided exact binomial test. A large sample is held close to min_top1 itself (1,000 rows at int4: below 0.83); a
# wrong graph's few rows still fail (3 of 7 at int4: p 0.012); the KL, a mean over every row, binds either way.
TOP1_SIGNIFICANCE = 0.05

# Weight-only quantization against the fp32 checkpoint (onnxruntime's MatMulNBits, blocks of 32, symmetric: what
# onnxruntime-genai's builder makes). Round-to-nearest int4 costs small models a mean KL of a few 1e-2 on real text
# (llama.cpp's Q4_0 KL tables), int8 some 1e-4; the bounds leave room above that, and a wrong fold (a gain off by
# 1 %) or a broken graph lands far outside them. taperfold's tiny test models sit at 1e-6..1e-3 (int4). On the user's
# text, perplexity: llama.cpp measured Q8_0 at +0.01 % and Q4_0 at +4 % for a 7 B Llama, and small models lose more
# to int4 (docs/benchmarks.md: a trained tiny model); a wrong scale or a broken block moves it by far more.
QUANTIZED_TOLERANCES: dict[str, Tolerance] = {
    "int8": Tolerance(
        rtol=None, min_top1=0.97, max_kl=5e-3, near_tie=2e-2, max_ppl_ratio=1.02, top1_significance=TOP1_SIGNIFICANCE
    ),
    "int4": Tolerance(
        rtol=None, min_top1=0.85, max_kl=1e-1, near_tie=5e-2, max_ppl_ratio=1.15, top1_significance=TOP1_SIGNIFICANCE
    ),
}
# A perplexity over fewer of the user's tokens than this is too noisy to hold to a bound: reported, not judged
MIN_SCORED_TOKENS = 256


def default_tolerance(dtype: str, kind: str) -> Tolerance:
    """`kind`: "export" (checkpoint vs an exported model) or "fold" (unfolded.onnx vs model.onnx); `dtype` a float
    dtype, or a quantized precision (int4, int8: held to the checkpoint, whatever `kind`)."""
    if dtype in QUANTIZED_TOLERANCES:
        return QUANTIZED_TOLERANCES[dtype]
    return DEFAULT_TOLERANCES[(dtype, kind)]


# A pair of two exported graphs (unfolded -> folded, baseline-decomposed -> baseline) differs by rounding only, but
# how much rounding grows with the model: depth and width add kernel-order differences, and at 683 M parameters the
# unfolded graph sat 6.3e-5 from the checkpoint, the folded one 2.2e-5, and the two 4.3e-5 apart, 4x the fixed fp32
# bound. So the pair is also allowed what the exporter itself costs: this many times the first graph's own distance
# from its torch model (max rel; KL, which grows as the square of the error, this squared). A wrong fold (a gain off
# by 1 %) is orders of magnitude beyond either bound; checkpoint -> folded keeps the export bound.
EXPORT_SLACK = 2


def between_graphs(
    tol: Tolerance, export: Metrics, export_pair: str, rtol_given: bool = False, max_kl_given: bool = False
) -> Tolerance:
    """The bound of a pair of two exported graphs: `tol` (its dtype's), or EXPORT_SLACK x `export` (the metrics of
    `export_pair`: the pair's first graph against its torch model) where that is larger. A bound the user set
    (`rtol_given`, `max_kl_given`) stays as given."""
    if tol.rtol is None:  # a quantized pair: its bounds are the checkpoint's
        return tol
    rtol = EXPORT_SLACK * export.max_rel if not rtol_given and math.isfinite(export.max_rel) else 0.0
    max_kl = EXPORT_SLACK**2 * export.kl if not max_kl_given and math.isfinite(export.kl) else 0.0
    if rtol <= tol.rtol and max_kl <= tol.max_kl:
        return tol
    widened = [
        f"rtol {EXPORT_SLACK} x {export.max_rel:.3g}" if rtol > tol.rtol else "",
        f"max_kl {EXPORT_SLACK**2} x {export.kl:.3g}" if max_kl > tol.max_kl else "",
    ]
    return replace(
        tol,
        rtol=max(rtol, tol.rtol),
        max_kl=max(max_kl, tol.max_kl),
        basis=f"{' and '.join(w for w in widened if w)} ({export_pair}): the exporter's own rounding, "
        f"above the fixed bound (rtol {tol.rtol:g}, max_kl {tol.max_kl:g})",
    )


def tolerance_help() -> str:
    """The default table, one line per (dtype, pair kind), as `taperfold verify --help` shows it."""

    def sci(x: float) -> str:  # 1e-4 rather than 0.0001
        return f"{x:.0e}".replace("e-0", "e-")

    pair = {"export": "vs checkpoint", "fold": "unfolded -> folded"}
    rows = [
        f"{dtype}, {pair[kind]:<19} rtol {sci(t.rtol or 0):<5}  min-top1 {t.min_top1:<5g}  max-kl {sci(t.max_kl)}"
        for (dtype, kind), t in DEFAULT_TOLERANCES.items()
    ]
    rows += [
        f"{precision}, {'vs checkpoint':<19} rtol -      min-top1 {t.min_top1:<5g}  max-kl {sci(t.max_kl)}  "
        f"max-ppl x{t.max_ppl_ratio:g}  (near-tie {t.near_tie:g})"
        for precision, t in QUANTIZED_TOLERANCES.items()
    ]
    rows.append(
        "top-1 (quantized pairs): min-top1 is a rate; the decisive rows fail it when so few agree that "
        f"p < {TOP1_SIGNIFICANCE:g} (one-sided binomial)"
    )
    rows.append(f"perplexity (quantized pairs): on --text or --tokens, when {MIN_SCORED_TOKENS}+ next tokens are known")
    rows.append(
        f"graph -> graph (the fold, the fused norm): or {EXPORT_SLACK} x the first graph's own max rel "
        f"({EXPORT_SLACK**2} x its KL) if larger"
    )
    return "\n".join(rows)


@dataclass
class Metrics:
    rows: int
    max_abs: float
    max_rel: float
    mean_abs: float
    cosine: float
    top1: float
    decisive_rows: int
    top1_decisive: float
    top5: float
    kl: float
    scored: int = 0  # rows whose next token is known (the user's tokens): the perplexity's sample
    nll_reference: float = math.nan  # mean -log p(next token), nats; NaN when nothing was scored
    nll_candidate: float = math.nan

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def ppl_ratio(self) -> float:
        """perplexity(candidate) / perplexity(reference); NaN when nothing was scored."""
        return math.exp(self.nll_candidate - self.nll_reference) if self.scored else math.nan

    @staticmethod
    def merge(parts: list[Metrics]) -> Metrics:
        """Pool metrics of several batches: worst case for the maxima, row-weighted means for the rest."""
        rows = sum(p.rows for p in parts)
        decisive = sum(p.decisive_rows for p in parts)
        scored = [p for p in parts if p.scored]  # the others' NaN perplexity is "not measured", not an error

        def mean(field: str, weight: str = "rows") -> float:
            total = sum(getattr(p, weight) for p in parts)
            return sum(getattr(p, field) * getattr(p, weight) for p in parts) / total if total else 1.0

        return Metrics(
            rows=rows,
            max_abs=_worst(p.max_abs for p in parts),
            max_rel=_worst(p.max_rel for p in parts),
            mean_abs=mean("mean_abs"),
            cosine=-_worst(-p.cosine for p in parts),
            top1=mean("top1"),
            decisive_rows=decisive,
            top1_decisive=mean("top1_decisive", "decisive_rows"),
            top5=mean("top5"),
            kl=mean("kl"),
            scored=sum(p.scored for p in scored),
            nll_reference=Metrics._scored_mean(scored, "nll_reference"),
            nll_candidate=Metrics._scored_mean(scored, "nll_candidate"),
        )

    @staticmethod
    def _scored_mean(parts: list[Metrics], field: str) -> float:
        total = sum(p.scored for p in parts)
        return sum(getattr(p, field) * p.scored for p in parts) / total if total else math.nan


def _worst(values) -> float:
    """max() that lets NaN win, so a NaN in any batch is never hidden by a finite one."""
    values = list(values)
    return float("nan") if any(np.isnan(v) for v in values) else max(values)


def _rows(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).reshape(-1, x.shape[-1])


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _top_k(x: np.ndarray, k: int) -> np.ndarray:
    k = min(k, x.shape[-1])
    return np.argpartition(-x, k - 1, axis=-1)[:, :k]


def compare_logits(
    reference: np.ndarray, candidate: np.ndarray, rtol: float, next_ids: np.ndarray | None = None
) -> Metrics:
    """Metrics of `candidate` against `reference` (same shape, vocabulary last); `rtol` sets the near-tie margin
    (Tolerance.tie_margin). `next_ids`: the token each row's logits predict, row for row, -1 where it is unknown;
    the rows with one are scored for perplexity."""
    if reference.shape != candidate.shape:
        raise ValueError(f"shape {list(candidate.shape)} differs from the reference's {list(reference.shape)}")
    ref, cand = _rows(reference), _rows(candidate)
    diff = np.abs(cand - ref)
    scale = np.abs(ref).max()
    max_abs = float(diff.max())
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    norms = np.linalg.norm(ref, axis=-1) * np.linalg.norm(cand, axis=-1)
    cosine = (ref * cand).sum(axis=-1) / np.maximum(norms, np.finfo(np.float64).tiny)

    ref_top1, cand_top1 = ref.argmax(axis=-1), cand.argmax(axis=-1)
    agree = ref_top1 == cand_top1
    top2 = np.partition(ref, -2, axis=-1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > rtol * scale

    ref_top5, cand_top5 = _top_k(ref, 5), _top_k(cand, 5)
    k = ref_top5.shape[-1]
    overlap = np.array([len(np.intersect1d(a, b)) for a, b in zip(ref_top5, cand_top5)]) / k

    log_p, log_q = _log_softmax(ref), _log_softmax(cand)
    # KL ≥ 0; two near-identical rows can sum to -1e-17 in rounding, which is 0
    kl = np.maximum((np.exp(log_p) * (log_p - log_q)).sum(axis=-1), 0.0)

    nll_ref = nll_cand = math.nan
    targets = np.full(ref.shape[0], -1) if next_ids is None else np.asarray(next_ids).reshape(-1)
    known = targets >= 0
    if known.any():
        rows = np.flatnonzero(known)
        nll_ref = float(-log_p[rows, targets[known]].mean())
        nll_cand = float(-log_q[rows, targets[known]].mean())

    if not np.isfinite(cand).all():  # argmax/top-k on NaN pick arbitrary tokens; make every bound fail
        max_abs = max_rel = nll_cand = float("nan")
        kl = np.full_like(kl, np.nan)
    return Metrics(
        rows=ref.shape[0],
        max_abs=max_abs,
        max_rel=float(max_rel),
        mean_abs=float(diff.mean()),
        cosine=float(cosine.min()),
        top1=float(agree.mean()),
        decisive_rows=int(decisive.sum()),
        top1_decisive=float(agree[decisive].mean()) if decisive.any() else 1.0,
        top5=float(overlap.mean()),
        kl=float(kl.mean()),
        scored=int(known.sum()),
        nll_reference=nll_ref,
        nll_candidate=nll_cand,
    )


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space (no underflow at thousands of rows)."""
    if k >= n:
        return 1.0
    if k < 0:
        return 0.0
    if p >= 1.0:
        return 0.0
    if p <= 0.0:
        return 1.0
    logs = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p) + (n - i) * math.log1p(-p)
        for i in range(k + 1)
    ]
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in logs))


def violations(metrics: Metrics, tol: Tolerance) -> list[str]:
    """Each bound the metrics break, as 'metric value > limit'; empty when the pair passes.
    Written as `not (value <= limit)` so that NaN breaks every bound."""
    out = []
    if tol.rtol is not None and not metrics.max_rel <= tol.rtol:
        out.append(f"max_rel {metrics.max_rel:.3g} > {tol.rtol:.3g}")
    if not metrics.top1_decisive >= tol.min_top1:
        if tol.top1_significance is None:
            out.append(f"top1 {metrics.top1_decisive:.4g} < {tol.min_top1:g}")
        else:
            n = metrics.decisive_rows
            agreed = round(metrics.top1_decisive * n) if math.isfinite(metrics.top1_decisive) else 0
            p = binomial_cdf(agreed, n, tol.min_top1)
            if not p >= tol.top1_significance:
                out.append(
                    f"top1 {metrics.top1_decisive:.4g} < {tol.min_top1:g} ({agreed} of {n} decisive rows: "
                    f"p {p:.2g} < {tol.top1_significance:g} at a rate of {tol.min_top1:g})"
                )
    if not metrics.kl <= tol.max_kl:
        out.append(f"kl {metrics.kl:.3g} > {tol.max_kl:.3g}")
    judge_ppl = tol.max_ppl_ratio is not None and metrics.scored >= MIN_SCORED_TOKENS
    if judge_ppl and not metrics.ppl_ratio <= tol.max_ppl_ratio:  # type: ignore[operator]
        out.append(f"perplexity x{metrics.ppl_ratio:.4g} > x{tol.max_ppl_ratio:g}")
    if out and tol.basis:
        out[-1] += f" (bound: {tol.basis})"
    return out

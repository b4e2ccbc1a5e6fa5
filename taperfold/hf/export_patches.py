"""Changes to a family's transformers modeling code for the ONNX export alone, where torch.onnx cannot translate the
family's own code and an equal real-valued form can be traced instead (the way export._attention gives Falcon's
multi-query attention a translation of its own). Applied around export's tracing only (`export_patches`); training,
inspect, verify's torch reference and every other tool run transformers' code as it is.

- llama4 / llama4_text, deepseek_v2: the rotary embedding is complex (`torch.polar`, `view_as_complex`), which
  torch.onnx fails to translate (a ConversionError on an unsqueeze of a complex tensor). The same rotation in real
  arithmetic: the embedding returns (cos, sin)·scale as a trailing axis of 2, and each pair (a, b) of a query or key
  becomes (a·cos − b·sin, a·sin + b·cos), which is (a + ib)(cos + i·sin).
- Hybrid families' linear recurrences (Qwen3-Next's gated delta rule; the Mamba2 scan of Bamba, GraniteMoeHybrid,
  Nemotron-H, Falcon-H1, Zamba2 and Mamba2, one function each modeling file copies): transformers' torch forms pad
  the sequence to a multiple of a chunk and loop over the chunks in Python, so torch.export fixes the sequence length
  to the traced one. The same recurrence, one step per token, as
  torch's `scan` (which torch.onnx writes as an ONNX Scan): a graph that takes any length. Mamba's selective scan
  (Jamba, Zamba, Mamba, FalconMamba: `mamba_selective_scan`), a Python loop over the time steps, likewise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from unittest import mock

import torch


def _real_rotary(family: str, rotary_class: str, heads_axis: int) -> Callable[[], contextlib.AbstractContextManager]:
    """A complex rotary embedding (`torch.polar`, `view_as_complex`) in real arithmetic: the embedding returns
    (cos, sin)·scale as a trailing axis of 2, and each pair (a, b) of a query or key becomes (a·cos − b·sin,
    a·sin + b·cos). `heads_axis`: where the queries hold their heads (cos and sin broadcast over it)."""

    @contextlib.contextmanager
    def patched() -> Iterator[None]:
        import importlib

        modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")

        def rotary_forward(self, x, position_ids):
            freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
            return torch.stack([freqs.cos(), freqs.sin()], dim=-1) * self.attention_scaling

        def apply_rotary_emb(xq, xk, freqs_cis):
            cos, sin = freqs_cis[..., 0].unsqueeze(heads_axis), freqs_cis[..., 1].unsqueeze(heads_axis)

            def rotate(x: torch.Tensor) -> torch.Tensor:
                pairs = x.float().reshape(*x.shape[:-1], -1, 2)
                a, b = pairs[..., 0], pairs[..., 1]
                return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(3).type_as(x)

            return rotate(xq), rotate(xk)

        with (
            mock.patch.object(getattr(modeling, rotary_class), "forward", rotary_forward),
            mock.patch.object(modeling, "apply_rotary_emb", apply_rotary_emb),
        ):
            yield

    return patched


def _delta_rule_scan(l2norm: Callable) -> Callable:
    """transformers' torch delta rules ([batch, time, heads, dim] in and out), the time loop a scan: per token
    S ← S·exp(g), S ← S + k ⊗ β(v − kᵀS), o = qᵀS, with S [batch, heads, dk, dv] in float32. g is one number per head
    (Qwen3-Next's gated delta rule) or one per key channel (Kimi delta attention, which decays each row of S);
    `l2norm` the family's own."""

    def scan_delta_rule(
        query,
        key,
        value,
        g,
        beta,
        chunk_size=64,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        **kwargs,
    ):
        from torch._higher_order_ops.scan import scan

        dtype = query.dtype
        k_heads, dk = key.shape[-2:]
        v_heads, dv = value.shape[-2:]
        if k_heads != v_heads:  # key heads shared by groups of value heads
            query = query.repeat_interleave(v_heads // k_heads, dim=2)
            key = key.repeat_interleave(v_heads // k_heads, dim=2)
        # detached: an input that requires grad sends export's decomposition down scan's autograd path, which fails
        # on a symbolic length (the graph is for inference; export patches never run in training)
        query, key, value, beta, g = (x.detach().to(torch.float32) for x in (query, key, value, beta, g))
        if use_qk_l2norm_in_kernel:
            query, key = l2norm(query, dim=-1, eps=1e-6), l2norm(key, dim=-1, eps=1e-6)
        query = query * dk**-0.5
        state = value.new_zeros(value.shape[0], v_heads, dk, dv) if initial_state is None else initial_state.float()
        per_channel = g.dim() == key.dim()

        def step(state, inputs):
            q, k, v, g_t, beta_t = inputs  # one token: [batch, heads, dim], beta [batch, heads]
            state = state * (g_t.exp()[..., None] if per_channel else g_t.exp()[..., None, None])
            delta = (v - (state * k[..., None]).sum(-2)) * beta_t[..., None]
            state = state + k[..., None] * delta[..., None, :]
            return state, (state * q[..., None]).sum(-2)

        last, out = scan(step, state, (query, key, value, g, beta), dim=1)
        return out.to(dtype), (last if output_final_state else None)

    return scan_delta_rule


def _delta_rule_patch(module: str, chunked: str, recurrent: str) -> Callable[[], contextlib.AbstractContextManager]:
    @contextlib.contextmanager
    def patch() -> Iterator[None]:
        import importlib

        modeling = importlib.import_module(module)
        scanned = _delta_rule_scan(modeling.l2norm)
        with mock.patch.object(modeling, chunked, scanned), mock.patch.object(modeling, recurrent, scanned):
            yield

    return patch


def _scan_mamba2(
    hidden_states,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    dt_bias=None,
    initial_states=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    **kwargs,
):
    """transformers' mamba2_chunk_scan (x [batch, time, heads, dim], dt [batch, time, heads], B/C [batch, time,
    groups, state]), its recurrence a scan: per token S ← S·exp(dt·A) + (dt·x) ⊗ B, y = S·C, plus D·x."""
    from torch._higher_order_ops.scan import scan

    heads, groups = hidden_states.shape[2], B.shape[2]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).float()
    x = hidden_states.float()
    B = B.float().repeat_interleave(heads // groups, dim=2, output_size=heads)
    C = C.float().repeat_interleave(heads // groups, dim=2, output_size=heads)
    decay, inflow = torch.exp(dt * A.float()).detach(), (dt[..., None] * x).detach()  # as in the gated delta rule
    B, C = B.detach(), C.detach()
    state = x.new_zeros(x.shape[0], heads, x.shape[-1], B.shape[-1]) if initial_states is None else initial_states
    state = state.float()

    def step(state, inputs):
        decay_t, inflow_t, b_t, c_t = inputs
        state = state * decay_t[..., None, None] + inflow_t[..., None] * b_t[:, :, None, :]
        return state, (state * c_t[:, :, None, :]).sum(-1)

    last, y = scan(step, state, (decay, inflow, B, C), dim=1)
    if D is not None:
        y = y + D[..., None] * x
    return (y, last) if return_final_states else y


def _mamba2_scan(module: str) -> Callable[[], contextlib.AbstractContextManager]:
    @contextlib.contextmanager
    def patch() -> Iterator[None]:
        import importlib

        with mock.patch.object(importlib.import_module(module), "mamba2_chunk_scan", _scan_mamba2):
            yield

    return patch


def _scan_selective(
    hidden_states,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    return_last_state=False,
    **kwargs,
):
    """transformers' mamba_selective_scan, Mamba's (x and dt [batch, channels, time], A [channels, state], B/C
    [batch, state, time]), its loop over the time steps a scan: per token S ← exp(dt·A)·S + dt·B·x, y = S·C, plus
    D·x, times silu(z)."""
    from torch._higher_order_ops.scan import scan

    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = torch.nn.functional.softplus(dt)
    x = hidden_states.float()
    B, C = B.transpose(1, 2).float().detach(), C.transpose(1, 2).float().detach()  # [batch, time, state]
    step_dt = dt.transpose(1, 2)[..., None]  # [batch, time, channels, 1]
    decay = torch.exp(A[None, None] * step_dt).detach()  # [batch, time, channels, state]
    inflow = (step_dt * B[:, :, None, :] * x.transpose(1, 2)[..., None]).detach()
    state = x.new_zeros(x.shape[0], x.shape[1], A.shape[-1])

    def step(state, inputs):
        decay_t, inflow_t, c_t = inputs
        state = decay_t * state + inflow_t
        return state, (state * c_t[:, None, :]).sum(-1)

    last, y = scan(step, state, (decay, inflow, C), dim=1)
    y = y.transpose(1, 2).to(hidden_states.dtype)  # [batch, channels, time]
    if D is not None:
        y = y + hidden_states * D[None, :, None]
    if z is not None:
        y = y * torch.nn.functional.silu(z)
    return (y, last) if return_last_state else y


def _selective_scan(family: str) -> Callable[[], contextlib.AbstractContextManager]:
    @contextlib.contextmanager
    def patch() -> Iterator[None]:
        import importlib

        modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        with mock.patch.object(modeling, "mamba_selective_scan", _scan_selective):
            yield

    return patch


def _gated_delta_rule(family: str) -> Callable[[], contextlib.AbstractContextManager]:
    return _delta_rule_patch(
        f"transformers.models.{family}.modeling_{family}",
        "torch_chunk_gated_delta_rule",
        "torch_recurrent_gated_delta_rule",
    )


def _kimi_delta_attention(family: str) -> Callable[[], contextlib.AbstractContextManager]:
    return _delta_rule_patch(
        f"transformers.models.{family}.modeling_{family}",
        "chunk_kimi_delta_attention",
        "recurrent_kimi_delta_attention",
    )


def _mamba2(family: str) -> Callable[[], contextlib.AbstractContextManager]:
    return _mamba2_scan(f"transformers.models.{family}.modeling_{family}")


# model_type -> the patch; a text model type shares its modeling file with the multimodal one
PATCHES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    **{t: _real_rotary("llama4", "Llama4TextRotaryEmbedding", heads_axis=2) for t in ("llama4", "llama4_text")},
    "deepseek_v2": _real_rotary("deepseek_v2", "DeepseekV2RotaryEmbedding", heads_axis=1),
    **{t: _gated_delta_rule(t) for t in ("qwen3_next", "olmo_hybrid", "lara_mini")},
    **{t: _gated_delta_rule(f) for f in ("qwen3_5", "qwen3_5_moe", "qwen4_exp") for t in (f, f"{f}_text")},
    **{t: _kimi_delta_attention(t) for t in ("kimi_linear", "bailing_hybrid")},
    **{t: _mamba2(t) for t in ("bamba", "granitemoehybrid", "nemotron_h", "falcon_h1", "zamba2", "mamba2")},
    **{t: _selective_scan(t) for t in ("jamba", "zamba", "mamba", "falcon_mamba")},
}


def export_patches(model_type: str) -> contextlib.AbstractContextManager:
    """What to hold while a model of `model_type` is traced for ONNX (nothing for most families)."""
    return PATCHES.get(model_type, contextlib.nullcontext)()

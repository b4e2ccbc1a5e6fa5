"""Model families as data, one module each: where a family's norms sit and which linear layers read them.

One description serves taperfold's own models (taperfold.models: llama, gpt2) and transformers' alike,
because taperfold's own models use Hugging Face's module names. A family says, and says only:

- `norm`: the norm kind (taperfold.norms: "rms", "ln"), and `gain_offset` when the norm computes x·(1 + w);
- `layers`: the ModuleList of decoder layers, and `internal`: each norm of a layer with the linear layers
  that read its output (what a fold rewrites: AutoAWQ's `get_layers_for_scaling`, llm-compressor's mappings);
  `layer_readers`: where some layers' readers differ (dense and MoE layers in one model), theirs, and the norms
  only some layers have (a hybrid's Mamba or linear-attention layers); `gated`: a gated norm (forward(x, z)) of a
  layer with how it applies its gate input z; `heads`: a norm applied per head whose readers join its heads
  (their width the norm's times the heads); `gain_offsets`: a norm of a layer whose gain offset is its own;
  `post`: each post-norm of a layer (it reads a projection's output before the residual Add: Gemma 2/3,
  OLMo 2, GLM-4, EXAONE 4) with the linear layer that produces its input, whose output columns the fold
  rewrites instead; `layer_producers`: some layers' own post-norms (a hybrid's attention layers with OLMo 2's
  post-norms beside recurrent layers with pre-norms). A layer's own entry in either overrides the other's;
- `final` and `head`: the final norm and the output projection that reads it;
- `untapered`: norm-like modules that are never tapered, with the reason, by a part of their path ("q_norm") or
  the end of it ("self_attn.q_norm": a path within a layer);
- `check`: a configuration the family refuses, as a reason (None: fine);
- `context`: the context of a model whose config.json states none (ALiBi models have no position table);
- `norm_eps`: the norms' epsilon where their module has no attribute for it;
- `configure`: where one model type lays its layers out in several ways (Falcon's two architectures, StableLM's
  parallel residual), the fields that differ for a config (`Family.for_config`);
- `traced`: the family was found by tracing a transformers model whose model_type none is registered for
  (taperfold.hf.trace: generic tapering), not written by hand.

A reader is a module (nn.Linear, GPT-2's Conv1D) or a weight that F.linear applies, named by its own path: a
router's `mlp.gate.weight`, or MoE experts' stacked matrices `mlp.experts.gate_up_proj` ([experts, out, in]).

Attention, RoPE, masks and caches are the modeling code's business, never the family's. Adding a family is
a module here plus its name in `_MODULES`, or `register(Family(...))` from anywhere (examples/plugin_family.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from taperfold.errors import TaperfoldError
from taperfold.nn import Gating


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config.json's "model_type" values (taperfold's own models: ModelConfig.arch)
    norm: str  # a norm kind of taperfold.norms
    layers: str  # path of the ModuleList of decoder layers
    internal: dict[str, tuple[str, ...]]  # norm in a layer -> the modules reading its output (paths in the layer)
    final: str  # path of the final norm
    post: dict[str, str] = field(default_factory=dict)  # post-norm in a layer -> the module producing its input
    head: str = "lm_head"  # path of the output projection, which reads the final norm
    gain_offset: float = 0.0  # the norm computes x·(offset + w): 1 for Gemma
    untapered: dict[str, str] = field(default_factory=dict)  # a part or the end of a module's path -> why not tapered
    context: int | None = None  # tokens, for configs without max_position_embeddings (ALiBi: no position table)
    norm_eps: float | None = None  # the norms' epsilon where their module hard-codes it (OLMo's LayerNorm)
    check: Callable[[object], str | None] = lambda config: None  # config -> why not supported, or None
    configure: Callable[[object], dict] | None = None  # config -> the fields that differ for its layout
    traced: bool = False  # found by tracing the model (taperfold.hf.trace), not written by hand
    # layer index -> {norm in the layer: its readers} where that layer's differ from `internal` (DeepSeek-V3's
    # first layers have a dense MLP where the others route to experts)
    layer_readers: dict[int, dict[str, tuple[str, ...]]] = field(default_factory=dict)
    # layer index -> {post-norm in the layer: its producer} where that layer's differ from `post`
    layer_producers: dict[int, dict[str, str]] = field(default_factory=dict)
    # a gated norm in a layer (RMSNormGated: forward(x, z)) -> how it applies its gate input
    gated: dict[str, Gating] = field(default_factory=dict)
    # a norm in a layer applied per head (its width one head's) -> the heads each input row of its readers joins
    heads: dict[str, int] = field(default_factory=dict)
    # a norm in a layer whose gain offset is not `gain_offset` (Qwen3-Next's gated norm: γ, its others 1 + γ)
    gain_offsets: dict[str, float] = field(default_factory=dict)

    def for_config(self, config) -> Family:
        """The family as a model of `config` lays out its layers (itself unless `configure` says otherwise)."""
        return self if self.configure is None else replace(self, **self.configure(config), configure=None)

    def gating_of(self, path: str) -> Gating | None:
        """How the norm at `path` applies its gate input: a gated norm in a layer; None for any other norm."""
        return self.gated.get(self._in_layer(path))

    def gain_offset_of(self, path: str) -> float:
        """The gain offset of the norm at `path`: its own, or the family's."""
        return self.gain_offsets.get(self._in_layer(path), self.gain_offset)

    def heads_of(self, path: str) -> int:
        """How many of the norm's rows each input row of its readers joins (a per-head norm's heads), else 1."""
        return self.heads.get(self._in_layer(path), 1)

    def _in_layer(self, path: str) -> str:
        """`path` within its layer ("" for a module outside the layers)."""
        layers, _, inner = path.partition(f"{self.layers}.")
        return inner.partition(".")[2] if not layers else ""

    def norm_readers(self, n_layers: int, taper: str) -> dict[str, list[str]]:
        """The norms `taper` ("internal" | "all") covers that fold forwards, each module path with the paths of
        its readers."""
        paths = {
            f"{self.layers}.{i}.{norm}": [f"{self.layers}.{i}.{r}" for r in readers]
            for i in range(n_layers)
            for norm, readers in self.readers_in_layer(i).items()
        }
        if taper == "all":
            paths[self.final] = [self.head]
        return paths

    def readers_in_layer(self, index: int) -> dict[str, tuple[str, ...]]:
        """Each norm of layer `index` that folds forwards, with its readers (paths in the layer)."""
        own_posts = self.layer_producers.get(index, {})
        readers = {**self.internal, **self.layer_readers.get(index, {})}
        return {norm: targets for norm, targets in readers.items() if norm not in own_posts}

    def producers_in_layer(self, index: int) -> dict[str, str]:
        """Each post-norm of layer `index`, with the layer producing its input (paths in the layer)."""
        own_readers = self.layer_readers.get(index, {})
        producers = {**self.post, **self.layer_producers.get(index, {})}
        return {norm: producer for norm, producer in producers.items() if norm not in own_readers}

    def untapered_reason(self, path: str) -> str | None:
        """Why the family never tapers the module at `path`: the entry for the longest end of its path, else for a
        part of it (the nearest to its end); None when none names it."""
        parts = path.split(".")
        ends = (".".join(parts[i:]) for i in range(len(parts)))
        named = next((self.untapered[end] for end in ends if end in self.untapered), None)
        return named or next((self.untapered[part] for part in reversed(parts) if part in self.untapered), None)

    def norm_paths(self, n_layers: int, taper: str) -> list[str]:
        """Every norm `taper` covers: those folding forwards, then the post-norms."""
        return [*self.norm_readers(n_layers, taper), *self.norm_producers(n_layers)]

    def norm_producers(self, n_layers: int) -> dict[str, str]:
        """The post-norms, which fold backwards: each module path with the path of its producer."""
        return {
            f"{self.layers}.{i}.{norm}": f"{self.layers}.{i}.{producer}"
            for i in range(n_layers)
            for norm, producer in self.producers_in_layer(i).items()
        }


# The families taperfold ships, one module each.
_MODULES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3",
    "olmo2",
    "exaone4",
    "glm4",
    "granite",
    "smollm3",
    "olmo",
    "phi",
    "gpt2",
    "gpt_neox",
    "opt",
    "bloom",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "falcon",
    "stablelm",
)
_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Make `family` known for each of its model types (a later registration of a type replaces it)."""
    _load_shipped()
    for model_type in family.model_types:
        _REGISTRY[model_type] = family
    return family


def _load_shipped() -> None:
    if _REGISTRY:
        return
    for name in _MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        for model_type in module.FAMILY.model_types:
            _REGISTRY.setdefault(model_type, module.FAMILY)


def is_registered(model_type) -> bool:
    """Whether a family is shipped or registered for `model_type`."""
    _load_shipped()
    return isinstance(model_type, str) and model_type in _REGISTRY


def supported_model_types() -> list[str]:
    _load_shipped()
    return sorted(_REGISTRY)


def family_for(model_type, where: str = "config.json") -> Family:
    """The family for `model_type`; one error naming the file, the key and the supported types otherwise."""
    _load_shipped()
    family = _REGISTRY.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise TaperfoldError(
            f"{where}: key 'model_type' is {model_type!r}, which taperfold cannot taper; "
            f"supported: {', '.join(supported_model_types())} (docs/extending.md: adding a family)"
        )
    return family

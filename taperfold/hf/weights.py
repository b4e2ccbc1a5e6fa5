"""The tensors of a Hugging Face directory, read with safetensors only, under the names of the model config.json
describes.

    DIR/model.safetensors                   the tensors in one file, or
    DIR/model-0000i-of-0000n.safetensors    in shards, and
    DIR/model.safetensors.index.json        the index: each tensor's shard

`read_weights` reads either (each problem one `TaperfoldError` naming the file and the key: a shard outside the
directory or missing, a tensor in two shards or in none). `to_model_names` renames them as transformers' own
conversion mapping for the model type does: legacy names, and MoE experts saved one by one (`experts.0.w1.weight`)
stacked into the model's tensors (`experts.gate_up_proj`).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch

from taperfold.errors import TaperfoldError, first_line
from taperfold.fsutil import read_json_object
from taperfold.sources.base import read_safetensors
from taperfold.sources.checks import printable, short

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def weights_file(folder: Path) -> Path:
    """The file errors about a directory's tensors name: the index of a sharded directory, else the single file."""
    return folder / INDEX if (folder / INDEX).is_file() else folder / WEIGHTS


def read_weights(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """All tensors of a directory, single file or sharded, and the file each came from."""
    single, index = folder / WEIGHTS, folder / INDEX
    if index.is_file():
        return _read_sharded(folder, index)
    if single.is_file():
        tensors = read_safetensors(single)
        return tensors, dict.fromkeys(tensors, single)
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise TaperfoldError(
            f"{folder}: holds PyTorch pickle weights only; taperfold reads safetensors "
            "(save with save_pretrained(..., safe_serialization=True))"
        )
    raise TaperfoldError(f"{folder}: no weights ({WEIGHTS} or {INDEX}); save the model with save_pretrained")


def _read_sharded(folder: Path, index: Path) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise TaperfoldError(f"{index}: key 'weight_map' missing or empty")
    shards: dict[str, str] = {}  # shard file -> the first key naming it
    for key, shard_name in weight_map.items():
        if not isinstance(shard_name, str) or Path(shard_name).name != shard_name:
            raise TaperfoldError(
                f"{index}: key 'weight_map.{printable(key)}' must be the name of a shard file in "
                f"{folder}, got {short(shard_name)}"
            )
        shards.setdefault(shard_name, key)
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}  # tensor name -> the shard holding it
    for shard_name, key in sorted(shards.items()):
        shard = folder / shard_name
        if not shard.is_file():
            raise TaperfoldError(
                f"{index}: key 'weight_map.{printable(key)}': shard {printable(shard_name)} is missing"
            )
        for name, tensor in read_safetensors(shard).items():
            if name in tensors:
                raise TaperfoldError(f"{shard}: key '{printable(name)}' is also in {origin[name]}")
            tensors[name], origin[name] = tensor, shard
    for key, shard_name in weight_map.items():
        if key not in tensors:
            raise TaperfoldError(
                f"{index}: key 'weight_map.{printable(key)}': tensor not found in {printable(shard_name)}"
            )
    return tensors, origin


def to_model_names(model, tensors: dict, origin: dict) -> tuple[dict, dict, dict]:
    """Checkpoint names -> the model's, with transformers' own conversion mapping for the model type: renamings
    (GPT-NeoX stores its `lm_head` as `embed_out`; save_pretrained writes that legacy name, from_pretrained maps it
    back) and weight conversions (MoE experts saved one by one, `experts.0.w1.weight`, stacked into the model's
    `experts.gate_up_proj`), applied to the tensors read, as from_pretrained applies them; nothing from the
    directory runs. Returns the tensors and their files under the model's names, and each model name's name in
    the file (for a stacked tensor: its first and last source key)."""
    same = {key: key for key in tensors}
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    except ImportError:  # an older transformers: names are stored as the modules have them
        return tensors, origin, same
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if not renamings and not converters:
        return tensors, origin, same
    meta = model.state_dict()
    renamed: dict = {}
    new_origin: dict = {}
    stored: dict[str, str] = {}
    stacks: dict[str, tuple] = {}  # model name -> (its converter, {source pattern: [checkpoint keys]})
    for key in sorted(tensors, key=dot_natural_key):  # experts in index order, as from_pretrained stacks them
        new_key, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if new_key not in meta and key in meta:  # a key already the model's, renamed by a pattern for other keys (as
            # from_pretrained: DeepSeek-V4's `.norm.` -> `.kv_norm.` rule also matches `model.norm.weight`)
            new_key, pattern = rename_source_key(key, [], [], model.base_model_prefix, meta)
        if pattern is None:
            if new_key in renamed:  # a legacy name and the model's own, both stored
                _both(new_key, stored[new_key], key, origin)
            renamed[new_key], new_origin[new_key], stored[new_key] = tensors[key], origin[key], key
            continue
        if new_key not in stacks:
            converter = next(c for c in converters if pattern in c.source_patterns)
            stacks[new_key] = (copy.deepcopy(converter), {})
        converter, sources = stacks[new_key]
        converter.add_tensor(new_key, key, pattern, tensors[key])
        sources.setdefault(pattern, []).append(key)
    for new_key, (converter, sources) in stacks.items():
        keys = [key for group in sources.values() for key in group]
        _check_expert_indices(sources, origin)
        try:
            converted = converter.convert(new_key, model=model, config=model.config)
        except Exception as e:  # noqa: BLE001 - transformers' ops raise what torch raises (mismatched shapes)
            raise TaperfoldError(
                f"{origin[keys[0]]}: keys '{printable(keys[0])}' ... '{printable(keys[-1])}' do "
                f"not stack into '{new_key}' ({first_line(e)})"
            ) from None
        for name, value in converted.items():
            if name in renamed:  # the stacked tensor stored as well as the experts one by one
                _both(name, stored[name], keys[0], origin)
            renamed[name] = value[0] if isinstance(value, list) else value
            new_origin[name], stored[name] = origin[keys[0]], f"{keys[0]} ... {keys[-1]}"
    return renamed, new_origin, stored


def _both(name: str, one: str, other: str, origin: dict) -> None:
    raise TaperfoldError(
        f"{origin[other]}: keys '{printable(one)}' and '{printable(other)}' both hold the model's '{name}' "
        "(keep one form of each weight)"
    )


def _check_expert_indices(sources: dict[str, list[str]], origin: dict) -> None:
    """Each pattern with a `*` numbers the experts 0, 1, ..., n - 1 in its keys, the same n for every such pattern: a
    gap would stack the next expert in its place, with the right shape. A pattern without one names one tensor."""
    count = None
    for pattern, keys in sources.items():
        if "*" not in pattern:  # named tensors joined into one (Bailing's q/k/v conv1d), no experts: one key each
            if len(keys) > 1:
                raise TaperfoldError(
                    f"{origin[keys[1]]}: keys '{printable(keys[0])}' and '{printable(keys[1])}' both hold "
                    f"'{pattern}' (keep one of them)"
                )
            continue
        # a pattern may escape its dots as a regular expression does (Kimi Linear's r"\.experts.*.w1.weight")
        found = re.compile(re.escape(re.sub(r"\\(.)", r"\1", pattern)).replace(r"\*", r"(\d+)"))
        indices = [int(m.group(1)) if (m := found.search(key)) else -1 for key in keys]
        if indices != list(range(len(keys))) or (count is not None and len(keys) != count):
            wrong = next((key for i, key in zip(range(len(keys)), keys) if indices[i] != i), keys[-1])
            raise TaperfoldError(
                f"{origin[wrong]}: key '{printable(wrong)}' does not continue experts 0 ... "
                f"{len(keys) - 1} of '{pattern}' (every expert, numbered from 0, once)"
            )
        count = len(keys)

"""Qwen3.5 vision-language checkpoints (``Qwen3_5ForConditionalGeneration`` and its MoE): their
text tower as the text model the bridge converts, and their vision tower kept aside.

A released Qwen3.5 checkpoint is a vision-language model: its ``config.json`` nests the text
model's fields under ``text_config`` (and the vision tower's under ``vision_config``), and its
tensors are (transformers 5.19, ``modeling_qwen3_5.py``)

    model.language_model.<name>   the text model's ``model.<name>`` (embedding, layers, final norm)
    lm_head.weight                the output layer (absent when ``tie_word_embeddings``)
    mtp.*                         the multi-token-prediction layers (carried, `bridge.mapping`)
    model.visual.*                the vision tower (patch embedding, blocks, merger)

The converter maps the text tower exactly as a ``Qwen3_5ForCausalLM``'s (`text_config` is that
model's config, `text_name` / `vision_language_name` rename between the two spellings) and
writes the vision tower verbatim next to the Megatron checkpoint (`VISION_FILE` in its ``hf/``
folder, beside the vision-language ``config.json``), from where the Megatron -> HF export puts it
back. The tied-embedding switch of the vision-language model is its top-level
``tie_word_embeddings`` (transformers ties ``lm_head`` by the top-level config), not the one in
``text_config``. The Megatron model is the text tower only: images and videos are not part of
what it computes (with text alone the multimodal RoPE's three position streams are equal, so the
text tower's logits are the vision-language model's on text).
"""

from __future__ import annotations

from typing import Iterable

TEXT_ARCHITECTURE = {"Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
                     "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}
"""Each converted vision-language architecture and the text model of its text tower."""
_MODEL_TYPES = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
_TEXT_MODEL_TYPES = {"Qwen3_5ForCausalLM": "qwen3_5_text", "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text"}
TEXT_PREFIX = "model.language_model."
"""The text model's ``model.`` tensors inside a vision-language checkpoint."""
VISION_PREFIX = "model.visual."
"""The vision tower's tensors."""
VISION_FILE = "vision_tower.safetensors"
"""The vision tower, verbatim, in a converted checkpoint's ``hf/`` folder."""
_TOP_LEVEL = ("lm_head.", "mtp.")


def vision_language_architecture(cfg: dict):
    """The config's vision-language architecture (``architectures``, or without it
    ``model_type``) if it is one this module converts, else None."""
    archs = cfg.get("architectures") or []
    if not archs and cfg.get("model_type") in _MODEL_TYPES:
        archs = [_MODEL_TYPES[cfg["model_type"]]]
    return archs[0] if len(archs) == 1 and archs[0] in TEXT_ARCHITECTURE else None


def text_config(cfg: dict) -> dict:
    """The ``config.json`` of the text tower of vision-language config ``cfg``, as a text model's
    (its ``architectures``, ``model_type`` and the top-level ``tie_word_embeddings``)."""
    arch = vision_language_architecture(cfg)
    if arch is None:
        raise ValueError(f"not a Qwen3.5 vision-language config: architectures {cfg.get('architectures')!r}, "
                         f"model_type {cfg.get('model_type')!r} (converted: {', '.join(TEXT_ARCHITECTURE)})")
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{arch} config has no text_config object (got {type(text).__name__}): the text "
                         "tower's fields are read from it")
    text_arch = TEXT_ARCHITECTURE[arch]
    return {**text, "architectures": [text_arch], "model_type": _TEXT_MODEL_TYPES[text_arch],
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False))}


def text_name(name: str) -> str:
    """The text model's name of a vision-language checkpoint's text-tower tensor
    (``model.language_model.X`` -> ``model.X``; ``lm_head.*`` and ``mtp.*`` unchanged)."""
    if name.startswith(TEXT_PREFIX):
        return "model." + name[len(TEXT_PREFIX):]
    if name.startswith(_TOP_LEVEL):
        return name
    raise ValueError(f"tensor {name} is not part of the text tower ({TEXT_PREFIX}*, lm_head.*, mtp.*)")


def vision_language_name(name: str) -> str:
    """The inverse of `text_name`: a text model's tensor name in the vision-language checkpoint."""
    if name.startswith(_TOP_LEVEL):
        return name
    if name.startswith("model."):
        return TEXT_PREFIX + name[len("model."):]
    raise ValueError(f"tensor {name} is not a text model's (model.*, lm_head.*, mtp.*)")


def split_towers(names: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """A vision-language checkpoint's tensors as ({text model name: checkpoint name} of the text
    tower, sorted vision-tower names); ValueError naming a tensor that belongs to neither."""
    text, vision, other = {}, [], []
    for name in names:
        if name.startswith(VISION_PREFIX):
            vision.append(name)
        elif name.startswith(TEXT_PREFIX) or name.startswith(_TOP_LEVEL):
            text[text_name(name)] = name
        else:
            other.append(name)
    if other:
        raise ValueError(f"the vision-language checkpoint holds {len(other)} tensors outside its text tower "
                         f"({TEXT_PREFIX}*, lm_head.*, mtp.*) and vision tower ({VISION_PREFIX}*), e.g. "
                         f"{sorted(other)[:5]}: not converted")
    if not vision:
        raise ValueError(f"the vision-language checkpoint holds no vision-tower tensors ({VISION_PREFIX}*); "
                         "a text model's checkpoint is converted with its text config (Qwen3_5ForCausalLM)")
    return text, sorted(vision)

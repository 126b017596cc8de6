"""Tier a/b: the text tower of a Qwen3.5 vision-language checkpoint (`bridge.vision_language`).

Its config and names (the text config a text model's, the tensor names both ways, what is refused),
and on tiny random vision-language models built from a config (dense and MoE, fp32, with MTP
tensors): HF -> Megatron -> HF bit for bit, the vision tower included, loading as the
vision-language model; Megatron's logits equal transformers' vision-language model's on text
within the converter's HYBRID_LOGIT_TOL (the delta rule in both runs in fp32 torch code, as in
tests/bridge/test_hybrid.py); the text-only export is the text model with the same logits.
"""

import json
import os

import pytest
import torch

from stapo_megatron.bridge import spec_from_hf_config
from stapo_megatron.bridge.tiny import save_tiny_vision_language_model
from stapo_megatron.bridge.vision_language import (VISION_FILE, split_towers, text_config, text_name,
                                                   vision_language_architecture, vision_language_name)
from stapo_megatron.conversion.cli import main
from stapo_megatron.conversion.safetensors_io import index_checkpoint, read_header
from tests.helpers.conversion_parity import _assert_bit_exact
from tests.helpers.qwen_configs import QWEN35_27B_TEXT, QWEN35_27B_VL


def _version_gap():
    from stapo_megatron.bridge.hybrid import delta_net_version_gap

    return delta_net_version_gap()


def test_text_config_is_the_text_models():
    """The 27B vision-language config's text tower is the 27B text model, field for field."""
    assert vision_language_architecture(QWEN35_27B_VL) == "Qwen3_5ForConditionalGeneration"
    assert vision_language_architecture({"model_type": "qwen3_5_moe"}) == "Qwen3_5MoeForConditionalGeneration"
    assert vision_language_architecture(QWEN35_27B_TEXT) is None
    text = text_config(QWEN35_27B_VL)
    assert (text["architectures"], text["model_type"]) == (["Qwen3_5ForCausalLM"], "qwen3_5_text")
    assert spec_from_hf_config(text) == spec_from_hf_config(QWEN35_27B_TEXT)
    # the vision-language model ties lm_head by its top-level switch, not text_config's
    tied = {**QWEN35_27B_VL, "tie_word_embeddings": True}
    assert spec_from_hf_config(text_config(tied)).tie_word_embeddings
    with pytest.raises(ValueError, match="'Qwen3_5ForConditionalGeneration' is a vision-language checkpoint"):
        spec_from_hf_config(QWEN35_27B_VL)  # the model built from a config is a text model
    with pytest.raises(ValueError, match="has no text_config object"):
        text_config({k: v for k, v in QWEN35_27B_VL.items() if k != "text_config"})
    with pytest.raises(ValueError, match="not a Qwen3.5 vision-language config"):
        text_config({"architectures": ["Qwen3VLForConditionalGeneration"]})


def test_names_both_ways_and_what_is_refused():
    names = ["model.language_model.embed_tokens.weight", "model.language_model.layers.3.self_attn.q_proj.weight",
             "model.language_model.norm.weight", "lm_head.weight", "mtp.fc.weight",
             "model.visual.blocks.0.attn.qkv.weight", "model.visual.merger.norm.bias"]
    text, vision = split_towers(names)
    assert text == {"model.embed_tokens.weight": names[0], "model.layers.3.self_attn.q_proj.weight": names[1],
                    "model.norm.weight": names[2], "lm_head.weight": names[3], "mtp.fc.weight": names[4]}
    assert vision == sorted(names[5:])
    assert all(vision_language_name(t) == n for t, n in text.items())
    assert text_name(names[1]) == "model.layers.3.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=r"1 tensors outside its text tower .* e.g. \['model.layers.0.mlp.up_proj"):
        split_towers(names + ["model.layers.0.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match="holds no vision-tower tensors"):
        split_towers(names[:5])
    with pytest.raises(ValueError, match="not part of the text tower"):
        text_name("model.visual.pos_embed.weight")


@pytest.fixture(scope="module", params=["qwen3.5", "qwen3.5-moe"])
def converted(request, tmp_path_factory):
    """A tiny fp32 Qwen3.5 vision-language model (dense or MoE), its conversion and its export."""
    root = tmp_path_factory.mktemp(request.param + "-vl")
    hf, ckpt, back = str(root / "hf"), str(root / "ckpt"), str(root / "back")
    save_tiny_vision_language_model(hf, request.param, dtype=torch.float32)
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", ckpt]) == 0
    assert main(["mcore-to-hf", "--ckpt", ckpt, "--out", back]) == 0
    return hf, ckpt, back


def test_round_trip_is_bit_exact_with_the_vision_tower(converted):
    """HF -> Megatron -> HF gives the checkpoint back bit for bit (text tower, MTP and vision
    tower), with the vision-language config, and transformers loads it as the vision-language model."""
    from transformers import AutoModelForImageTextToText

    hf, ckpt, back = converted
    _assert_bit_exact(hf, back)
    vision = {n for n in index_checkpoint(hf) if n.startswith("model.visual.")}
    assert len(vision) > 20 and set(read_header(os.path.join(ckpt, "hf", VISION_FILE))) == vision
    with open(os.path.join(ckpt, "stapo_conversion.json")) as f:
        record = json.load(f)["vision_language"]
    assert record == {"architecture": _config(hf)["architectures"][0], "vision_tower": f"hf/{VISION_FILE}",
                      "num_vision_tensors": len(vision)}
    assert _config(back) == _config(hf)
    model = AutoModelForImageTextToText.from_pretrained(back, dtype=torch.float32)
    assert type(model).__name__ == _config(hf)["architectures"][0]


def _config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def test_tied_round_trip(tmp_path):
    """Tied by the top-level switch: no lm_head in the checkpoint, the converted spec tied, and
    the round trip bit-exact."""
    from stapo_megatron.conversion.hf_to_mcore import load_spec

    hf, ckpt, back = (str(tmp_path / n) for n in ("hf", "ckpt", "back"))
    save_tiny_vision_language_model(hf, "qwen3.5", dtype=torch.bfloat16, tie_word_embeddings=True)
    assert "lm_head.weight" not in index_checkpoint(hf) and load_spec(hf)[1].tie_word_embeddings
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", ckpt]) == 0
    assert main(["mcore-to-hf", "--ckpt", ckpt, "--out", back]) == 0
    _assert_bit_exact(hf, back)


@pytest.mark.skipif(_version_gap() is not None, reason=str(_version_gap()))
def test_megatron_logits_equal_the_vision_language_models_on_text(converted):
    from stapo_megatron.bridge import build_gpt_model, load_checkpoint
    from stapo_megatron.conversion.hf_to_mcore import load_spec
    from stapo_megatron.conversion.verify import HYBRID_LOGIT_TOL, _megatron_forward, compare, fixed_prompts, hf_logits
    from tests.helpers.dist_utils import one_rank_parallel

    hf, ckpt, _ = converted
    cfg, spec = load_spec(hf)
    tokens_BS = fixed_prompts(spec.vocab_size, num_prompts=2, seq_len=24)
    ref_BSV = hf_logits(hf, tokens_BS)  # Qwen3_5(Moe)ForConditionalGeneration on input_ids alone
    with one_rank_parallel():
        model = build_gpt_model(cfg, parallel_output=False)
        load_checkpoint(model, ckpt)
        model.eval()
        with torch.no_grad():
            got_BSV = _megatron_forward(model, tokens_BS)[..., :spec.vocab_size]
    row = compare(ref_BSV, got_BSV, 1, 1)
    assert row.ok(HYBRID_LOGIT_TOL), row
    assert row.logit_scale > 1.0  # O(1) logits: the comparison is not of near-zero numbers


def test_text_only_export_is_the_text_model(converted, tmp_path):
    """--text-only writes the text tower as the text model (text config, model.* names, no
    vision tower), whose transformers logits are the vision-language model's on text."""
    from stapo_megatron.conversion.verify import fixed_prompts, hf_logits

    hf, ckpt, _ = converted
    text = str(tmp_path / "text")
    assert main(["mcore-to-hf", "--ckpt", ckpt, "--out", text, "--text-only"]) == 0
    cfg = _config(text)
    assert cfg["architectures"][0] == text_config(_config(hf))["architectures"][0] and "vision_config" not in cfg
    names = set(index_checkpoint(text))
    assert {text_name(n) for n in index_checkpoint(hf) if not n.startswith("model.visual.")} == names
    tokens_BS = fixed_prompts(cfg["vocab_size"], num_prompts=2, seq_len=16)
    # the same transformers modules on the same weights (on text the vision-language model runs
    # its text tower alone, with plain RoPE positions): the same logits, bit for bit
    assert torch.equal(hf_logits(text, tokens_BS), hf_logits(hf, tokens_BS))


def test_text_tower_is_the_tiny_text_model(converted, tmp_path):
    """The tiny vision-language model's text tower is `save_tiny_hf_model`'s text model (the
    weights tests/bridge/test_hybrid.py checks): its tensors, renamed, bit for bit."""
    from stapo_megatron.bridge.tiny import save_tiny_hf_model
    from stapo_megatron.conversion.safetensors_io import read_rows

    hf, _, _ = converted
    variant = "qwen3.5-moe" if "Moe" in _config(hf)["architectures"][0] else "qwen3.5"
    save_tiny_hf_model(str(tmp_path / "text"), variant, dtype=torch.float32)
    text, vl = index_checkpoint(str(tmp_path / "text")), index_checkpoint(hf)
    assert {vision_language_name(n) for n in text} == {n for n in vl if not n.startswith("model.visual.")}
    for name, info in text.items():
        assert torch.equal(read_rows(info), read_rows(vl[vision_language_name(name)])), name


def test_what_is_not_converted_is_refused(converted, tmp_path, capsys):
    """A text model's checkpoint refuses --text-only; an export whose config is the
    vision-language one but whose side folder holds no vision tower names both ways out."""
    import shutil

    hf, ckpt, back = converted
    side = tmp_path / "side"
    side.mkdir()
    shutil.copy(os.path.join(hf, "config.json"), side / "config.json")
    assert main(["mcore-to-hf", "--ckpt", ckpt, "--out", str(tmp_path / "a"), "--hf-config", str(side)]) == 2
    err = capsys.readouterr().err
    assert "is a vision-language config but neither" in err and "--text-only" in err
    # the vision-language HF folder itself holds the vision tower: the export takes it from there
    assert main(["mcore-to-hf", "--ckpt", ckpt, "--out", str(tmp_path / "b"), "--hf-config", hf]) == 0
    _assert_bit_exact(hf, str(tmp_path / "b"))
    with open(side / "config.json", "w") as f:
        json.dump(text_config(_config(hf)), f)
    assert main(["mcore-to-hf", "--ckpt", ckpt, "--out", str(tmp_path / "c"), "--hf-config", str(side),
                 "--text-only"]) == 2
    assert "--text-only exports a vision-language checkpoint's text tower" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "c")


@pytest.mark.slow
@pytest.mark.skipif(_version_gap() is not None, reason=str(_version_gap()))
def test_verify_at_tp2(converted):
    """`stapo-convert verify` on the vision-language folder: its text config to the Megatron
    ranks, the vision-language model as the reference, at TP = 2."""
    from stapo_megatron.conversion.verify import HYBRID_LOGIT_TOL, verify

    hf, ckpt, _ = converted
    row, = verify(hf, ckpt, [(2, 1)], num_prompts=2, seq_len=24)
    assert row.ok(HYBRID_LOGIT_TOL), row

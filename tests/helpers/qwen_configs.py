"""Published Qwen config.json files, as the bridge's tests read them."""

# A Qwen2.5-7B-Instruct config.json as published (transformers-4 spelling: rope_theta, torch_dtype).
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 152064, "rope_scaling": None,
}


# Qwen3-14B-Base in transformers-5 spelling (rope_parameters), head_dim explicit.
QWEN3_14B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 17408, "max_position_embeddings": 32768,
    "model_type": "qwen3", "num_attention_heads": 40, "num_hidden_layers": 40, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936,
}


# A Qwen3.5-27B-sized text model (the text_config of the released vision-language checkpoint, saved
# as a Qwen3_5ForCausalLM): 64 layers, every fourth full attention, 248,320-token vocabulary.
QWEN35_27B_TEXT = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "attention_bias": False, "head_dim": 256,
    "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 17408,
    "max_position_embeddings": 262144, "num_attention_heads": 24, "num_hidden_layers": 64, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "vocab_size": 248320, "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "mtp_num_hidden_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}

# The vision-language checkpoint around it: `spec_from_hf_config` refuses it by name (not a text model
# config); the converter takes its text tower (`bridge.vision_language.text_config`).
QWEN35_27B_VL = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
    "text_config": {k: v for k, v in QWEN35_27B_TEXT.items() if k not in ("architectures", "model_type")},
    "vision_config": {"depth": 27, "hidden_size": 1152, "model_type": "qwen3_5_vision"},
    "tie_word_embeddings": False,
}

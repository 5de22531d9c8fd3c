"""The tiny configs of `trl_prefix_sharing.testing.make_config`: per model type, the fields that make a model of it
small enough to build and run on a CPU in a test (and the families the equivalence suites run on)."""

__all__ = ["FAMILIES", "TINY_CONFIGS"]

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

_MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
#: multi-head latent attention (DeepSeek-V2/V3 style): small ranks and head dims, one key/value head per query head
#: (the latent keys and values are expanded per head), `head_dim` the rotary part as these configs define it
_MLA_ATTENTION = dict(
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    qk_head_dim=8,
    v_head_dim=8,
    num_key_value_heads=4,
)
_MLA = dict(**_MLA_ATTENTION, n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1)
#: a vision/audio tower's transformer, small (multimodal types build it; the text-only sweep never runs it)
_TINY_VIT = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
#: Inkling 2's text model: small heads and experts (its unpadded vocabulary follows `vocab_size`)
_INKLING2 = dict(
    unpadded_vocab_size=None,
    head_dim=8,
    swa_head_dim=8,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=2,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    intermediate_size=16,
)
#: DeepSeek sparse attention's indexer (its top-k stays above these sequence lengths: every visible key is kept)
_DSA = dict(index_head_dim=8, index_n_heads=2)
#: family (model_type) -> what its tiny config needs on top of `make_config`'s common sizes (any model_type
#: transformers knows is accepted; these are the ones whose defaults do not fit a tiny model or that need small
#: experts)
TINY_CONFIGS = {
    "deepseek_v2": {**_MOE, **_MLA},
    "deepseek_v3": {**_MOE, **_MLA},
    "glm4_moe": {**_MOE, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
    "gpt_oss": {**_MOE, "intermediate_size": 32, "head_dim": 8},
    "mixtral": _MOE,
    "qwen2_moe": {**_MOE, "shared_expert_intermediate_size": 32},
    "qwen3_moe": {**_MOE, "head_dim": 8},
    "olmoe": _MOE,
    "granitemoe": _MOE,
    "jetmoe": {**_MOE, "kv_channels": 8},
    "gemma": {"head_dim": 8},
    "gemma2": {"head_dim": 8, "query_pre_attn_scalar": 8},
    "gemma3_text": {"head_dim": 8, "query_pre_attn_scalar": 8},
    "cohere2": {"head_dim": 8},
    "gptj": {"rotary_dim": 4},
    "helium": {"head_dim": 8},
    "hunyuan_v1_dense": {"head_dim": 8},
    "hunyuan_v1_moe": {**_MOE, "head_dim": 8},
    "ministral": {"head_dim": 8},
    # training-time randomness TRL's `disable_dropout` does not reach: off, or no two stock runs agree either
    "phimoe": {**_MOE, "router_jitter_noise": 0.0},
    "seed_oss": {"residual_dropout": 0.0, "attention_dropout": 0.0},
    "emu3_text_model": {"attention_dropout": 0.0},
    # MLA families: without `_MLA_ATTENTION` their key/value heads (2) do not match the query heads and stock TRL fails
    "axk1": {**_MOE, **_MLA, "head_dim": 4},
    "axk2": {**_MOE, **_MLA, **_DSA, "head_dim": 4, "n_group": 1, "topk_group": 1},
    "deepseek_v32": {**_MOE, **_MLA, **_DSA, "head_dim": 4},
    "glm4_moe_lite": {**_MOE, **_MLA, "head_dim": 4},
    "glm_moe_dsa": {**_MOE, **_MLA, **_DSA, "head_dim": 4},
    "hy_v4": {**_MOE, **_MLA, **_DSA, "head_dim": 4},
    "longcat_flash": {
        **_MLA_ATTENTION,
        "head_dim": 4,
        "n_routed_experts": 4,
        "moe_topk": 2,
        "zero_expert_num": 2,
        "expert_ffn_hidden_size": 16,
        "ffn_hidden_size": 64,
    },
    "minicpm3": {**_MLA_ATTENTION, "head_dim": 4},
    "sarvam_mla": {**_MOE, **_MLA, "head_dim": 4},
    "youtu": {**_MLA_ATTENTION, "head_dim": 4},
    # MoE families whose defaults are hundreds of experts
    "dots1": {**_MOE, "n_shared_experts": 1, "first_k_dense_replace": 1},
    "ernie4_5_moe": {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 16, "moe_num_shared_experts": 1},
    "exaone_moe": {**_MOE, "num_shared_experts": 1},
    "flint": {  # the first two layers are dense by default: a 2-layer model had no experts, TRL's aux loss failed
        **_MOE,
        "head_dim": 8,
        "mlp_only_layers": [0],
        "shared_expert_intermediate_size": 32,
        "layer_types": ["full_attention", "sliding_attention"],
    },
    "granitemoe_swa": _MOE,
    "granitemoeshared": {**_MOE, "shared_intermediate_size": 32},
    "hy_v3": {**_MOE, "head_dim": 8, "num_shared_experts": 1},
    "sarvam_moe": {**_MOE, "head_dim": 8},
    "codegen": {"rotary_dim": 4},
    "cohere_compass_text": {  # RoPE parameters per layer type (its rotary embedding reads them so)
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
    "dbrx": {  # real DBRX configs carry `rope_theta` in `attn_config`, which DBRX's attention reads
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
        "d_model": 32,  # its own names: the common sizes' `hidden_size` does not reach the experts
        "n_heads": 4,
        "n_layers": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    },
    # dense Doge keeps MoE fields: TRL turns its router loss on and finds no router logits (and Doge's product-key
    # router does not fit TRL's Mixtral loss either), so stock fails unless the coefficient is 0
    "doge": {"router_aux_loss_coef": 0.0},
    # Gemma 3n / 4: per-layer embeddings as wide as the vocabulary, small
    "gemma3n_text": {
        "head_dim": 8,
        "num_hidden_layers": 4,  # two layers reuse the keys and values of the two before
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": None,
        "laurel_rank": 4,
    },
    "gemma4_text": {"head_dim": 8, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": None},
    # Inkling: hybrid attention + short-convolution layers, small experts and heads
    "inkling_text": {
        "head_dim": 8,
        "swa_head_dim": 8,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 16,
    },
    "inkling2_text": _INKLING2,
    "inkling2_loop_text": {
        **_INKLING2,
        "n_layers_per_attn_res_block": 1,
        "loop_layer_index_start": 1,
        "loop_layer_index_end": 2,
        "loop_num_passes": 2,
        "loop_gate_rank": 4,
    },
    "deepseek_v4": {  # compressed attention every layer (blocks of 4 and 8 positions), hash-routed then top-k experts
        "head_dim": 8,
        "partial_rotary_factor": 0.5,
        "num_key_value_heads": 1,
        "q_lora_rank": 16,
        "o_groups": 2,
        "o_lora_rank": 8,
        "n_routed_experts": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "index_n_heads": 2,
        "index_head_dim": 8,
        "hc_mult": 2,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
        "mlp_layer_types": ["hash_moe", "moe"],
    },
    "dots3_note_text": {  # MLA with DeepSeek sparse attention, and a sliding layer of its own head sizes
        **_MOE,
        **_MLA,
        **_DSA,
        "head_dim": 8,
        "shared_experts_intermediate_size": 16,
        "layer_types": ["indexed_attention", "sliding_attention"],
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 4,
        "swa_q_lora_rank": 16,
        "swa_kv_lora_rank": 16,
        "swa_head_dim": 8,
        "swa_qk_nope_head_dim": 4,
        "swa_v_head_dim": 8,
    },
    "reformer": {  # a causal LM only as a decoder; fixed LSH hashes and no dropout, or no two runs agree
        "is_decoder": True,
        "attention_head_size": 8,
        "attn_layers": ["local", "lsh"],
        "axial_pos_embds": False,
        "feed_forward_size": 64,
        "local_attn_chunk_length": 8,
        "lsh_attn_chunk_length": 8,
        "num_buckets": 4,
        "hash_seed": 0,
        "hidden_dropout_prob": 0.0,
        "local_attention_probs_dropout_prob": 0.0,
        "lsh_attention_probs_dropout_prob": 0.0,
    },
    "blt": {  # byte-level: every part reads the (here word-level) vocabulary
        "patcher_config": {
            "vocab_size": None,
            "hidden_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 32,
        },
        "encoder_config": {
            "vocab_size": None,
            "hidden_size": 16,
            "hidden_size_global": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 32,
        },
        "decoder_config": {
            "vocab_size": None,
            "hidden_size": 16,
            "hidden_size_global": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 32,
        },
        "global_config": {
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "intermediate_size": 64,
        },
        "encoder_hash_byte_group_size": [3, 4],
        "encoder_hash_byte_group_vocab": 64,
    },
    "git": {"vision_config": {**_TINY_VIT, "image_size": 8, "patch_size": 4}},
    "phi4_multimodal": {
        "vision_config": {**_TINY_VIT, "image_size": 28, "patch_size": 14, "crop_size": 28},
        "audio_config": {
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_blocks": 1,
            "num_attention_heads": 2,
            "ext_pw_out_channel": 16,
            "depthwise_separable_out_channel": 16,
            "nemo_conv_channels": 16,
        },
    },
    # multimodal types (`TEXT_PARTS`): the towers, small
    "dots3_note": {
        "vision_config": {
            **_TINY_VIT,
            "adapter_in_dim": 16,
            "adapter_out_dim": 32,
            "mlp_layer_types": ["dense"],
            "per_layer_config": {},
        },
        "audio_config": {
            **_TINY_VIT,
            "downsample_hidden_size": 8,
            "feature_size": 8,
            "adapter_input_size": 16,
            "adapter_out_dim": 32,
        },
    },
    "gemma3": {"vision_config": {**_TINY_VIT, "image_size": 8, "patch_size": 4}, "mm_tokens_per_image": 4},
    "gemma4_assistant": {  # a drafter: every layer reads the target model's keys and values
        "text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "num_kv_shared_layers": 2},
        "backbone_hidden_size": 32,
        "num_centroids": 4,
        "centroid_intermediate_top_k": 2,
    },
    "gemma4_unified_assistant": {
        "text_config": {"num_kv_shared_layers": 2},
        "backbone_hidden_size": 32,
        "num_centroids": 4,
        "centroid_intermediate_top_k": 2,
    },
    "got_ocr2": {
        "vision_config": {
            **_TINY_VIT,
            "output_channels": 8,
            "image_size": 64,
            "patch_size": 16,
            "window_size": 2,
            "global_attn_indexes": [0],
            "mlp_dim": 32,
        }
    },
    "mllama": {
        "text_config": {"cross_attention_layers": [1]},
        "vision_config": {
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_global_layers": 1,
            "attention_heads": 2,
            "vision_output_dim": 32,
            "intermediate_layers_indices": [0],
            "image_size": 8,
            "patch_size": 4,
        },
    },
    "moss_transcribe_diarize": {
        "audio_config": {
            **_TINY_VIT,
            "num_mel_bins": 8,
            "max_source_positions": 16,
        }
    },
    "qwen4_exp": {
        "vision_config": {
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 32,
            "num_position_embeddings": 16,
            "patch_size": 4,
        }
    },
    # linear-attention hybrids (refused whatever they measure), small
    "lara_mini": {
        **_MOE,
        "head_dim": 8,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "shared_expert_intermediate_size": 16,
    },
    "qwen4_exp_text": {
        **_MOE,
        "head_dim": 8,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "shared_expert_intermediate_size": 16,
        "layer_types": ["linear_attention", "full_attention"],
        "hc_lowrank": 4,
        # its full-attention layers build the sparse-attention indexer (a budget above these lengths: all kept)
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 8,
        "indexer_budget": 1024,
        "indexer_compress_ratio": 4,
    },
}

"""Config fields of the random-weight targets the benchmarks build (no weights, no download)."""

LLAMA31_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
              "vocab_size": 128256, "rope_theta": 500000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
              "num_hidden_layers": 32, "tie_word_embeddings": False}
SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
                "vocab_size": 49152, "rope_theta": 100000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                "num_hidden_layers": 30, "tie_word_embeddings": True}

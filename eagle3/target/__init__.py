"""The target model: resolving and loading it (HF folder, GGUF, tiny random), fingerprints, tiny targets for tests."""

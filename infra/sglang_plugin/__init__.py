"""Model classes that SGLang loads in place of its own (``SGLANG_EXTERNAL_MODEL_PACKAGE=infra.sglang_plugin``).

Imported only inside an SGLang server process; nothing else in the project imports this package.
"""

"""Export a trained drafter for serving: the SGLang (official EAGLE-3) layout and the speculators layout.

``<run>/export/sglang/`` (SGLang's and vLLM's LlamaForCausalLMEagle3): config.json with the drafter's llama fields,
num_hidden_layers 1, the target vocab_size, draft_vocab_size, target_hidden_size and eagle_config; weights fc.weight,
midlayer.*, norm.weight, lm_head.weight, d2t int64 [Vd], t2d bool [V]; no embed_tokens (the target's are shared)
unless target_hidden_size differs. ``<run>/export/speculators/`` (vLLM): an Eagle3Speculator config whose flags
describe our drafter, ``layers.0.*`` for ``midlayer.*``. Each folder also gets eagle3_export.json (with the selected
checkpoint and why: model_card), eagle3_run_config.json and README.md (the model card); no engine reads them.

Aux layer ids name the same tensors in three conventions: ours = output of layer j ([1, N//2-1, N-4]); SGLang's
eagle_config = the same numbers (its Llama code adds 1 and captures before layer j+1); speculators/vLLM = capture
before layer j+1 ([2, N//2, N-3]). SGLang silently skips unknown weight names, so every export is checked for the
exact key set, shapes and dtypes (ExportError). Layouts, conventions and what was verified: docs/export.md.

    checks.py       what both layouts share: file names, dtypes, aux-id conventions, Llama fields, the tensor check
    folder.py       writing one folder atomically
    sglang.py       the SGLang layout: write, check, load back as our drafter
    speculators.py  the speculators layout: write, check
    model_card.py   which checkpoint ships and why; README.md of each folder
    stage.py        the export stage (key, run_export) and its CLI:
    python -m eagle3.export --config runs/smollm2-demo/config.json
"""

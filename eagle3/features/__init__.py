"""Hidden-state capture: the feature contract (spec), shards, backends (hf, sglang), the capture stage (stage.py).

The stage's identity is here, below both the stage module and the code that writes its manifest (capture.py).
"""

from eagle3.run.layout import FEATURES_DIR
from eagle3.run.stage import StageId

STAGE = StageId("capture", FEATURES_DIR)
"""The capture stage in the run directory: features/capture.manifest.json."""
ONLINE_SKIP = "skipped: train.features=online computes the target's states inside each training step (no feature disk)"
"""Why capture does not run for a run that trains online (the capture CLI, the pipeline flow and the run report)."""

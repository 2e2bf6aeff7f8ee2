"""A run directory and its stages: paths, the stage registry and CLI, manifests and keys, journals, progress, slices."""

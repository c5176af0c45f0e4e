"""Canonical Orbax checkpoints with manifests and layout-independent fingerprints."""

"""What keeps a run alive or stops it cleanly: non-finite steps, preemption signals, peers that
die or never join, hung steps, checkpoint directories that are not shared."""

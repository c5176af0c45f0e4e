"""What a run reports: metrics, FLOPs and MFU, HLO statistics, profiler traces."""

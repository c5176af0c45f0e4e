"""The training system: configs, the parallel plan, the one assembly function, steps, state, the loop."""

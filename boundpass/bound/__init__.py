"""Bounds: BoundTerm, BudgetTable and the one step law (device_peak), Knob, the ops' time models and knees, and the
composed per-rank budget of a launch configuration."""

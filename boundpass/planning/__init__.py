"""Choosing and explaining: the one planner (knobs against the step's peak, the fail-fast error), explain's report,
block traces at symbolic N, and boundpass.plan at full scale."""

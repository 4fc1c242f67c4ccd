"""The layer below everything: errors, byte units, the shared sympy symbols, boundpass.Config, plan's validated
inputs and model-source interface, report text. Imports no torch."""

"""boundpass.compile's module and its Dynamo backends: BoundedModule, the one lowering, the per-block backend of
torchtitan's compile, the MoP layout's backends, and the torch workarounds they need."""

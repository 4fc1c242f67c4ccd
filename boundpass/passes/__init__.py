"""Graph passes: the protocol and driver (pipeline), vocab -> Ring-DTP, dispatch -> PipelinedLLEP (torchtitan's experts,
plain-PyTorch and HF experts by structure), SCO (checkpoint boundaries, after partitioning), the optimizer swap."""

"""The bounded operators, usable without the compiler (import boundpass.runtime)."""
from boundpass.runtime.ring_dtp import (  # noqa: F401
    choose_branch,
    reference_loss,
    ring_dtp_bound,
    ring_dtp_loss,
    vocab_shard_range,
    vocab_shard_sizes,
)
from boundpass.runtime.offload_adamw import OffloadStreamAdamW  # noqa: F401
from boundpass.runtime.pipelined_llep import llep, pipelined_llep, pipelined_llep_bound, standard_ep  # noqa: F401
from boundpass.runtime.sco import apply_sco, sco_device_bound, sco_host_bound  # noqa: F401

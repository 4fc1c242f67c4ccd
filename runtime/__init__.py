"""The bounded operators, usable without the compiler (import boundpass.runtime)."""
from boundpass.runtime.agreement import global_max_tokens  # noqa: F401
from boundpass.runtime.attention_blocks import sublayer as attention_sublayer  # noqa: F401
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
from boundpass.runtime.seq_to_head import (  # noqa: F401
    SeqToHeadAttention,
    seq_to_head_attention,
    seq_to_head_bound,
    shard_positions,
    shard_sequence,
)

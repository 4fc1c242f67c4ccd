"""How the runtime's custom ops name a process group: torch.library schemas take a string, not a group object."""
from __future__ import annotations


def group_name_of(group) -> str:
    """The name a custom op resolves its process group by ('' = no group: one rank, no exchange)."""
    return "" if group is None else group.group_name

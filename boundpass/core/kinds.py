"""A str enum that prints and serialises as its value: the kinds of terms and storages are such names."""
import enum


class NamedKind(str, enum.Enum):
    """Members compare equal to their plain names and print as them (``str(TermKind.HOST) == "host"``)."""

    def __str__(self) -> str:
        return self.value

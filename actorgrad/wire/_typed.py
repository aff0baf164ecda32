"""Typed messages of the layers above, carried as plain tuples.

The handler of a target knows which message type it receives, so only the field
values need to travel: pickling a reference to the message class (and rebuilding a
frozen dataclass through ``copyreg``) cost several microseconds each way, more than
the rest of a small message.
"""

from __future__ import annotations

from typing import Any, TypeVar

from .._errors import ProtocolError
from ._codec import Payload

M = TypeVar("M", bound="TupleMessage")


class TupleMessage:
    """Base of slotted dataclasses that travel as the tuple of their field values."""

    __slots__ = ()

    def dump(self, main_by_name: bool = False) -> Payload:
        """The message's payload (``main_by_name``: see ``Payload.dump``)."""
        names: tuple[str, ...] = type(self).__slots__  # the dataclass's fields, in order
        return Payload.dump(tuple(getattr(self, name) for name in names), main_by_name=main_by_name)

    @classmethod
    def load(cls: type[M], payload: Payload) -> M:
        values: Any = payload.load()
        names: tuple[str, ...] = cls.__slots__
        if type(values) is not tuple or len(values) != len(names):
            raise ProtocolError(f"malformed {cls.__name__} message")
        message = object.__new__(cls)  # the fields as they came: no keyword __init__ call
        for name, value in zip(names, values, strict=True):
            _set(message, name, value)  # frozen dataclasses refuse plain assignment
        return message


_set = object.__setattr__

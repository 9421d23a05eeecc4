"""`runtime.messages`: every message type is a frozen `msgspec.Struct` (`Message`) whose
constructor takes its fields by position and by keyword, with their defaults, and refuses
assignment, extra and missing arguments."""

from __future__ import annotations

import inspect

import msgspec
import pytest

import runtime.messages as messages

MESSAGE_TYPES = [obj for obj in vars(messages).values()
                 if inspect.isclass(obj) and issubclass(obj, messages.Message) and obj is not messages.Message]


def test_every_message_type_is_a_frozen_struct():
    assert len(MESSAGE_TYPES) > 20
    for cls in MESSAGE_TYPES:
        assert issubclass(cls, msgspec.Struct) and cls.__struct_config__.frozen, cls
        assert "__dict__" not in dir(cls(*[None] * (len(cls.__struct_fields__) - len(cls.__struct_defaults__))))


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_init_matches_the_fields(cls):
    names = cls.__struct_fields__
    defaults = cls.__struct_defaults__
    values = [object() for _ in names]
    by_position = cls(*values)
    by_keyword = cls(**dict(zip(names, values)))
    for name, v in zip(names, values):
        assert getattr(by_position, name) is v and getattr(by_keyword, name) is v
    assert by_position == by_keyword
    required = len(names) - len(defaults)
    minimal = cls(*values[:required])
    for name, default in zip(names[required:], defaults):
        assert getattr(minimal, name) == default
    with pytest.raises(AttributeError):
        setattr(by_position, names[0], None)
    with pytest.raises(TypeError):
        cls(*values, object())
    if required:
        with pytest.raises(TypeError):
            cls(*values[: required - 1])

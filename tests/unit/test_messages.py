"""`runtime.messages.message`: every message type keeps the frozen dataclass's behaviour with
its quicker `__init__` (fields stored through their slot descriptors).

Checked against a broken `message` that stores each field through another field's descriptor:
25 of the 32 fail (the rest: the census test, and types whose field order reads the same reversed)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import runtime.messages as messages

MESSAGE_TYPES = [obj for obj in vars(messages).values()
                 if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and obj.__module__ == messages.__name__]


def test_every_message_type_is_built_by_message():
    assert len(MESSAGE_TYPES) > 20
    for cls in MESSAGE_TYPES:
        assert cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"
        params = cls.__dataclass_params__
        assert params.frozen and "__slots__" in vars(cls), cls


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_init_matches_the_dataclass_fields(cls):
    fs = dataclasses.fields(cls)
    values = [object() for _ in fs]
    by_position = cls(*values)
    by_keyword = cls(**{f.name: v for f, v in zip(fs, values)})
    for f, v in zip(fs, values):
        assert getattr(by_position, f.name) is v and getattr(by_keyword, f.name) is v
    assert by_position == by_keyword
    required = [f for f in fs if f.default is dataclasses.MISSING]
    minimal = cls(*values[: len(required)])
    for f in fs[len(required):]:
        assert getattr(minimal, f.name) == f.default
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(by_position, fs[0].name, None)
    with pytest.raises(TypeError):
        cls(*values, object())
    if required:
        with pytest.raises(TypeError):
            cls(*values[: len(required) - 1])

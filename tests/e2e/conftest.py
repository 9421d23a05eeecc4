"""Fixtures shared by the end-to-end tests: the tiny random Llama and its reference copy.

Module-scoped, as each test module had them: every module builds its own model (``seed=0``),
so nothing one module does to its model reaches another's. ``transformers`` is imported only
when a fixture is used; the test modules that use them ``importorskip`` it first.
"""

from __future__ import annotations

import copy

import pytest


@pytest.fixture(scope="module")
def model():
    from runtime.integrations.hf_llama import tiny_llama
    from tests.e2e.support import DEVICE

    return tiny_llama(seed=0).to(DEVICE)


@pytest.fixture(scope="module")
def bamba():
    """The tiny random hybrid model (Mamba2 + attention) of the hybrid adapter's tests."""
    from runtime.integrations.hf_hybrid import tiny_bamba
    from tests.e2e.support import DEVICE

    return tiny_bamba(seed=0).to(DEVICE)


@pytest.fixture(scope="module")
def ref_bamba():
    """The same weights run by transformers' own attention, cache and Mamba2 path."""
    from runtime.integrations.hf_hybrid import tiny_bamba
    from tests.e2e.support import DEVICE

    ref = tiny_bamba(seed=0).to(DEVICE)
    ref.set_attn_implementation("sdpa")
    return ref


@pytest.fixture(scope="module")
def ref_model(model):
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")  # transformers' own attention and KV cache
    return ref


@pytest.fixture(scope="module")
def deepseek():
    """The tiny random DeepSeek-V3 (MLA) of the MLA tests."""
    from runtime.integrations.hf_mla import tiny_deepseek_v3
    from tests.e2e.support import DEVICE

    return tiny_deepseek_v3(seed=0).to(DEVICE)


@pytest.fixture(scope="module")
def ref_deepseek():
    """The same weights, never hooked: transformers' own attention and cache."""
    from runtime.integrations.hf_mla import tiny_deepseek_v3
    from tests.e2e.support import DEVICE

    return tiny_deepseek_v3(seed=0).to(DEVICE)

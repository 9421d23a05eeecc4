"""Optional model integrations (need the ``model`` extra: transformers, gguf, accelerate).

Nothing here is imported by the runtime itself; import the submodule you need, e.g.
``from runtime.integrations.hf_llama import PagedKVModel``.
"""

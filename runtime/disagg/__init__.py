"""Disaggregated serving: moving KV pages between processes (a prefill side and a decode side)."""

"""Tiers and copies below the device tier: host copies, decode offload, the storage tier."""

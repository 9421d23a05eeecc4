"""Pool groups: one rule object per kind of model state (docs/ARCHITECTURE.md, "Pool groups")."""

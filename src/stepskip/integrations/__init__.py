"""Integrations with training frameworks; each module imports its framework (``stepskip`` imports none)."""

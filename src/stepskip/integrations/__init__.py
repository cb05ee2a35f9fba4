"""Adapters that put stepskip under other training frameworks' own code (``stepskip.integrations.verl``)."""

"""Adapters that put stepskip under other training frameworks' own code (``stepskip.integrations.verl``,
``stepskip.integrations.trl``); each imports its framework, and ``import stepskip`` imports none of them."""

"""Reading a role's entries: the reader (probe, classify, read, fidelity, rebind), the steps a role's
entries make up (one flat entry, or a V1 step's inner entries) and the reused directory listings."""

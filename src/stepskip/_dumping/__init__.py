"""Writing entries: a role's dump pipeline, the background worker and the helper processes.

A role owns one :class:`~stepskip._dumping.dumper.Dumper`: it snapshots a result on the caller's
thread, then writes it at once or queues it on the process-wide
:class:`~stepskip._dumping.worker.DumpWorker` (small entries in batches, written by the helper
processes of :mod:`stepskip._dumping.helper` where they help). What counts as *committed* is the
role's commit strategy (:mod:`stepskip._dumping.commit`): a flat entry is published by its own
write; a V1 step once its last inner entry is written, by one directory rename or by its manifest.

Nothing here is imported by ``import stepskip`` beyond the worker (the helper imports torch).
"""

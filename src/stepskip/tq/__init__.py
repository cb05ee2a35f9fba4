"""TransferQueue support: the in-process client and row operations on TensorDicts."""

from stepskip.tq.client import InProcessTQClient, KVBatchMeta
from stepskip.tq.rows import concat_rows, select_rows

__all__ = ["InProcessTQClient", "KVBatchMeta", "concat_rows", "select_rows"]

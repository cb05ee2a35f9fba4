"""TransferQueue support: the client protocol, the in-process client and row operations on TensorDicts."""

from stepskip.tq.client import InProcessTQClient, KVBatchMeta, TQClient
from stepskip.tq.rows import concat_rows, select_rows

__all__ = ["InProcessTQClient", "KVBatchMeta", "TQClient", "concat_rows", "select_rows"]

"""Open Inference Protocol tensor datatypes and their numpy equivalents.

Source: the Open Inference Protocol (KServe V2) "Tensor Data Types" table.
BYTES tensors are numpy ``object`` arrays whose elements are ``bytes``.
"""

from __future__ import annotations

import numpy as np

#: V2 datatype name -> numpy dtype (``object`` for BYTES).
NUMPY_DTYPES: dict[str, np.dtype[np.generic]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}

DATATYPES: frozenset[str] = frozenset(NUMPY_DTYPES)
FLOAT_DATATYPES: frozenset[str] = frozenset({"FP16", "FP32", "FP64"})
INT_DATATYPES: frozenset[str] = frozenset(
    {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"}
)



def ragged(rows: list[np.ndarray] | np.ndarray) -> np.ndarray:
    """A ragged tensor: an ``object`` array ``[B]`` whose item i is ``rows[i]``, an array
    ``[n_i, ...]`` (n_i may differ per item). numpy would build a 2-D object array, or a plain
    3-D one, from equal-length rows: this never does."""
    out = np.empty(len(rows), dtype=object)
    for i, row in enumerate(rows):
        out[i] = row
    return out

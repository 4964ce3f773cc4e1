"""Token rows padded into a model's inputs, with an explicit pad id on either side (numpy only).

A tokenizer without a pad token (Llama's, GPT-2's) pads once its handler names one
(``app.handlers.decoders``); padding on the left keeps a decoder's last token in the last column.
Source: vLLM's pooling models pad token ids themselves, as text-embeddings-inference does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["Alloc", "pad"]

#: Makes an int64 array of a shape (``np.empty``, or a view of a pinned host buffer).
Alloc = Callable[[tuple[int, ...]], npt.NDArray[np.int64]]
#: One string's token ids (or token type ids), int32 ``[n]``.
_Ids = npt.NDArray[np.int32]
_EMPTY: _Ids = np.zeros(0, dtype=np.int32)


def pad(
    rows: Sequence[_Ids],
    pad_id: int | None,
    *,
    side: str = "right",
    type_rows: Sequence[_Ids] | None = None,
    single_type_id: int = 0,
    type_ids: bool = False,
    alloc: Alloc | None = None,
) -> dict[str, npt.NDArray[np.int64]]:
    """Rows of token ids padded to the longest into the model's inputs.

    Args:
        rows: U >= 1 rows, int32 ``[n_u]`` each.
        pad_id: the id of padding positions (None: every row must have the same length).
        side: where padding goes, ``"right"`` or ``"left"``.
        type_rows: each row's token type ids (pairs); None: ``single_type_id`` everywhere.
        type_ids: whether to return ``token_type_ids``.
        alloc: where the arrays are made (``np.empty`` by default; a pinned buffer on a GPU).

    Returns:
        ``input_ids``, ``attention_mask`` (1 on real tokens) and, with ``type_ids``,
        ``token_type_ids``: int64 ``[U, T]``, T the longest row (at least 1).

    Raises:
        ValueError: rows of different lengths and no ``pad_id``.
    """
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    width = max(1, int(lengths.max())) if len(rows) else 1
    make: Alloc = alloc if alloc is not None else (lambda shape: np.empty(shape, dtype=np.int64))
    positions = np.arange(width)
    real = positions >= (width - lengths)[:, None] if side == "left" else positions < lengths[:, None]
    if pad_id is None and not bool(real.all()):
        raise ValueError("the tokenizer has no pad token: rows of different lengths cannot be batched")
    flat = np.concatenate(rows) if len(rows) else _EMPTY
    shape = (len(rows), width)
    ids = make(shape)
    ids.fill(pad_id or 0)
    ids[real] = flat
    mask = make(shape)
    np.copyto(mask, real)
    features = {"input_ids": ids, "attention_mask": mask}
    if type_ids:
        types = make(shape)
        types.fill(0)
        if type_rows is not None:
            types[real] = np.concatenate(type_rows) if len(type_rows) else _EMPTY
        elif single_type_id:
            types[real] = single_type_id
        features["token_type_ids"] = types
    return features

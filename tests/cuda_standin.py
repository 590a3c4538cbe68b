"""A stand-in for the cuda backend's kernel library, for testing its load and its users on the CPU: what
ctypes.CDLL would return, with every export mla_decode.cuda.build types at load as a Python function, and a
DecodeCall layout (mla_decode_call_fields, mla_decode_call_layout) that is the ctypes struct's unless given."""

from types import SimpleNamespace

import mla_decode.cuda.build as B


def standin_library(path: str = "libstandin.so", layout: list[int] | None = None, **exports) -> SimpleNamespace:
    """The stand-in: `layout` is what mla_decode_call_layout writes (each field's offset, then the size; its fields
    are one fewer), `exports` replace the defaults (a library of the mma.sync kernel: 16-row units, one CTA an SM, no
    MXFP4; launches return 0)."""
    layout = B.decode_call_layout() if layout is None else layout

    def mla_decode_call_layout(offsets) -> None:
        for i, offset in enumerate(layout):
            offsets[i] = offset

    defaults = dict(mla_decode_call_layout=mla_decode_call_layout, mla_decode_call_fields=lambda: len(layout) - 1,
                    mla_decode=lambda address: 0, mla_schedule=lambda address: 0,
                    mla_limit_shared_memory=lambda limit: 0, mla_limit_wide_ctas=lambda ctas: None,
                    mla_supports_mxfp4=lambda: 0, mla_supports_bf16=lambda: 0, mla_bf16_ctas_per_sm=lambda: 0,
                    mla_max_unit_rows=lambda: 16,
                    mla_unit_ctas_per_sm=lambda unit_rows: 1)
    return SimpleNamespace(path=path, **(defaults | exports))

"""Render-time repair of one docstring the API page shows but this branch may not edit.

``flashlab.tiled.tiled_attention`` (owned by the tiled rung's branch) opens its ``Args:``
section with an entry that has no ``name:``, which napoleon turns into broken RST. Until
that docstring is fixed at the source, this handler splits the entry into named ones before
napoleon reads it. It changes nothing once the source is fixed (the lines no longer match):
delete this file and its line in ``_config.yml`` then.
"""

_TILED_ARGS = [
    "  query ``[batch, q_seq, heads, d]``; key, value ``[batch, kv_seq, kv_heads, d]``; bias,",
    "  mask and the mask keywords as :func:`flashlab.reference.naive_attention`.",
]
_TILED_FIXED = [
    "  query: ``[batch, q_seq, heads, d]``.",
    "  key, value: ``[batch, kv_seq, kv_heads, d]``.",
    "  bias, mask: as in :func:`flashlab.reference.naive_attention`, like the mask keywords.",
]


def _repair(app, what, name, obj, options, lines):
    if getattr(obj, "__qualname__", None) != "tiled_attention":
        return
    for i in range(len(lines) - 1):
        if lines[i:i + 2] == _TILED_ARGS:
            lines[i:i + 2] = _TILED_FIXED
            return


def setup(app):
    app.connect("autodoc-process-docstring", _repair, priority=100)   # before napoleon (500)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

"""The private DDP attributes SCOUT's gradient-bucket trace reads, written against torch 2.13.

Only here: `DistributedDataParallel._comm_hooks` (the Python comm hooks already registered),
`_get_ddp_logging_data()["comm_hook"]` (the name of any hook, C++ built-ins included) and
`_use_python_reducer` (compiled autograd's reducer, which calls hooks per parameter, not per
bucket). If a later torch drops one, these answer "unknown" / True and the trace is not installed
rather than risking a second registration or the wrong hook signature.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger(__name__)

UNKNOWN = "unknown"


def registered_hook_name(ddp: Any) -> Optional[str]:
    """The name of the comm hook already registered on `ddp`; None when there is none; UNKNOWN
    when this torch does not expose it (treated as registered: DDP accepts only one hook)."""
    hooks = getattr(ddp, "_comm_hooks", None)
    if hooks:
        return getattr(hooks[-1][0], "__qualname__", repr(hooks[-1][0]))
    try:
        name = ddp._get_ddp_logging_data().get("comm_hook")
    except Exception as exc:  # noqa: BLE001 - a torch without the logging data: fail closed
        logger.debug("DDP logging data unavailable: %r", exc)
        return UNKNOWN
    if hooks is None:
        return UNKNOWN
    return name or None


def uses_python_reducer(ddp: Any) -> bool:
    """True when DDP reduces through its Python reducer (compiled autograd), whose hooks receive
    (grad, param) pairs, not buckets; also True when this torch does not say (fail closed)."""
    return bool(getattr(ddp, "_use_python_reducer", True))

"""The private DDP attributes SCOUT's gradient-bucket trace reads, written against torch 2.13.

Only here: `DistributedDataParallel._comm_hooks` (the Python comm hooks already registered) and
`_get_ddp_logging_data()["comm_hook"]` (the name of any hook, C++ built-ins included). If a later
torch drops either, `registered_hook_name` says so (returns "unknown") and the trace is not
installed rather than risking a second registration.
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

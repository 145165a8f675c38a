"""`ResiliencyError`: the one base of every exception the library raises to its users.

Catch it to handle any lm-resiliency failure in one place. Each exception also keeps the builtin
base it had before (`ValueError`, `RuntimeError`, `TypeError`, `OSError`), so existing handlers
keep working. Left out on purpose: `NodeRetired` (a `SystemExit` that ends a retired node's
worker) and the sweep's private control-flow signals.
"""

from __future__ import annotations


class ResiliencyError(Exception):
    """Base of every lm-resiliency exception."""

"""`full`: the whole cache, as the reference keeps it (the control arm)."""

from __future__ import annotations

from lmtrace.kvlab.policies.base import Policy


class Full(Policy):
    name = "full"
    evicting = False
    about = "every position (the control: equals the reference bit for bit)"

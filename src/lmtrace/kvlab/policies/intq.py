"""`int4` / `int2` (`:group=G,residual=R,backend=quanto|hqq`): KIVI-style integer KV through
transformers' QuantizedCache: keys and values quantized in groups of G with a scale and a
zero point per group; the R most recent positions wait in full precision until R of them
have gathered, then everything is re-quantized. Needs an optional backend package:
`pip install 'lmtrace[kvquant]'` (optimum-quanto and hqq)."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

from lmtrace.kvlab.policies.base import Param, Policy, invalid


class IntQ(Policy):
    name = "int4"
    bits = 4
    params = {
        "group": Param("int", 64),
        "residual": Param("int", 128),
        "backend": Param("choice", "quanto", choices=("quanto", "hqq")),
    }
    evicting = False
    about = "every position, stored as 4-bit integers in groups (KIVI-style), a full-precision residual"

    def validate(self) -> None:
        package = {"quanto": "optimum.quanto", "hqq": "hqq"}[self["backend"]]
        try:
            found = importlib.util.find_spec(package) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise invalid(self.name, f"backend {self['backend']} is not installed (pip install 'lmtrace[kvquant]')")

    def make_cache(self, model: Any) -> Any:
        from transformers import QuantizedCache

        return QuantizedCache(backend=self["backend"], config=model.config, nbits=self.bits,
                              q_group_size=self["group"], residual_length=self["residual"])  # fmt: skip

    def layer_formula(self, kv_heads: int, head_dim: int, dtype_size: int, batch: int = 1):
        group = self["group"]

        hqq = self["backend"] == "hqq"

        def packed(slots: int) -> int:
            groups = math.ceil(batch * kv_heads * slots * head_dim / group)
            # both reshape to (groups, group); optimum-quanto packs 8 / bits group rows into one byte
            # row (rounding the rows up), hqq packs within each group (rounding the columns up)
            data = groups * math.ceil(group * self.bits / 8) if hqq else math.ceil(groups * self.bits / 8) * group
            return data + 2 * groups * dtype_size  # + a scale and a zero point per group

        def formula(layer: int, slots: int, residual: int = 0) -> int:
            quantized = slots - residual
            return 2 * packed(quantized) + 2 * batch * kv_heads * residual * head_dim * dtype_size

        return formula


class Int2(IntQ):
    name = "int2"
    bits = 2
    about = "every position, stored as 2-bit integers in groups (KIVI-style), a full-precision residual"

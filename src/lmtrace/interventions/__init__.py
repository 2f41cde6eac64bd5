"""Interventions traced: the reference generation beside runs with a block or a head ablated or
a steering vector added, token by token (`lmtrace.intervene`), and steering vectors from
contrast prompts (`steer_vector`). The hooks that change the forward: lmtrace.inside.intervene."""

from lmtrace.interventions.arms import InterveneOptions, InterventionResult, intervene
from lmtrace.interventions.vectors import steer_vector

__all__ = ["InterveneOptions", "InterventionResult", "intervene", "steer_vector"]

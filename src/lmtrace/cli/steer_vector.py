"""`lmtrace steer-vector`: a steering vector from contrast texts (the mean difference of the
residuals after a layer), for `lmtrace intervene --steer L:FILE.pt:ALPHA`."""

from __future__ import annotations

import click

from lmtrace.cli.common import cli, consoles, load_model
from lmtrace.cli.options import model_options
from lmtrace.errors import InvalidParameter


@cli.command("steer-vector")
@click.option("--positive", multiple=True, required=True, metavar="TEXT", help="A wanted-side text (repeatable).")
@click.option("--negative", multiple=True, required=True, metavar="TEXT", help="An other-side text (repeatable).")
@click.option("--layer", type=int, required=True, help="The decoder layer (0-based) whose output residual is read.")
@click.option("--out", "out", required=True, metavar="FILE.pt", help="Where to write the vector (torch.save).")
@model_options
def steer_vector(positive, negative, layer, out, model, device, dtype, allow_pickle, trust_remote_code, **kw):
    """Mean residual after --layer over the --positive texts minus that over the --negative
    texts (each text's residual: the mean over its tokens)."""
    if layer < 0:
        raise InvalidParameter(f"layer must be >= 0, got {layer}")
    if not out.endswith(".pt"):
        raise InvalidParameter(f"out: the file must end in .pt, got {out!r}")
    view, status = consoles(None, False)
    lm = load_model(status, model, device, dtype, allow_pickle, trust_remote_code)
    from lmtrace.interventions.vectors import save_vector
    from lmtrace.interventions.vectors import steer_vector as build

    vector = build(lm, list(positive), list(negative), layer)
    save_vector(out, vector, layer, {"model": lm.source, "positive": list(positive), "negative": list(negative)})
    view.print(f"steering vector for layer {layer}: width {vector.numel()}, norm {float(vector.norm()):.4f}; "
               f"written to {out}")  # fmt: skip

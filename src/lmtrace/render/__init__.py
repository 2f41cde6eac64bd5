"""Views of traces, grouped by medium: html/ (self-contained pages), terminal/ (rich), plots/
(matplotlib PNGs); a feature has the same module name in each (html/stability.py,
terminal/stability.py, plots/stability.py). What every medium shares lives here: kinds.py (what
a record is), tokens.py (token text made visible), views.py (a step as plain data), anatomy.py
(the KV cache's anatomy), speculative.py (draft blocks). No torch here: renderers read records only."""

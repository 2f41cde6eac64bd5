"""Views of traces. No torch here: renderers read records only."""

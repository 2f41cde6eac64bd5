"""Checks against another computation: teacher-forced scoring, rescoring a trace, verifying
the loop against model.generate."""

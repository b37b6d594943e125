"""Evaluation: RULER's synthetic tasks generated offline (``oa_core.eval.ruler``)."""

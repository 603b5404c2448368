"""Offline acceptance evaluation (``specdec-eval``): trace replay, live runs, sweeps, reports."""

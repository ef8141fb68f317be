"""Experiment scripts: each regenerates one results file under experiments/results/ (see report.py)."""

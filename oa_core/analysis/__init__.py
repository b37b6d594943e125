"""Measurements on a real model: attention error against dense, per-layer metrics, the needle and the demo."""

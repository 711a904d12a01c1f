"""Observability: metrics, per-stage spans (trace export), plots and the live view."""

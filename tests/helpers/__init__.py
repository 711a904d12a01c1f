"""Helpers that tests of several folders share (`tests/` is on pytest's `pythonpath`,
so `from helpers.<module> import ...` works from any test file and on every xdist
worker): a tiny base and job factories (`pipeline_support`), a scripted service backend
and tenants (`service_support`), a live uvicorn server (`live_support`), tiny models of
several architectures (`tiny_archs`). Helpers of one folder stay in that folder."""

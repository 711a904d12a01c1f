"""Environments: the async Env interface, built-in task families, graders, the sandbox."""

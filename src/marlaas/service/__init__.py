"""The HTTP service: tenants submit and manage RL jobs over a versioned JSON API.

Layers, outermost first: `app` (the FastAPI app, middleware, lifespan) -> `api/*`
(routes, one module per audience) -> `jobs`, `auth`, `quotas`, `datasets` (the rules)
-> `models` + `db` (SQLAlchemy tables, sessions, Alembic migrations). Wire schemas live
in `schemas` and are converted explicitly from the tables. `backend` declares the one
boundary to whatever runs the jobs (the in-process pipeline), and `reporter` is how that
runner writes progress back.

Invariants:
- every tenant-owned row is read through a query filtered by the caller's tenant, so
  another tenant's id is indistinguishable from a missing one (same 404, same body);
- API keys are stored only as a keyed hash; the secret is shown once, when issued;
- a request that fails leaves nothing behind (one transaction per request).
"""

"""HTTP routes, one module per audience: `jobs` and `datasets` for tenants, `admin` for
the operator, `ops` for probes and metrics. `deps` holds the shared dependencies."""
